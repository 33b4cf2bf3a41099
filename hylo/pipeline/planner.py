"""The cadence of a run and what each layer's hooks keep at a step (docs/design.md, "Memory").

The planner owns the run's position — the step count, the number of updates, whether an update
is owed — and answers, for the current step:

- **cadence**: is it an update step (``step % update_freq == 0``, or an update is owed), which layers it
  updates (all; under ``stagger_updates`` those whose offset is ``step % update_freq``, all at step 0 and
  when an update is owed: :func:`stagger_offsets`), and which layers refresh K-FAC's running factors
  (``factor_update_freq``);
- **capture plan**: what each layer's gradient hook reduces a call to — the statistic of each
  family the layer may take (:class:`~hylo.layers.statistics.CapturePlan`), or nothing (raw calls,
  for a user ``solver_fn`` and at study updates, whose reference needs raw calls). Under the hybrid
  policy a layer keeps its low-rank rows always and K-FAC's factors where the policy's
  **forecast** (its rule on this step's row counts and the current critical flags, the trend not
  sampled) picks K-FAC;
- **row sample**: the rows of each call K-FAC's factors are formed from (``factor_sample``, a pure function
  of the seed, the step and the layer's name: docs/solvers.md, "Sampled factors");
- **reconciliation**: after the policy's one decision per update, a layer whose calls every rank
  reduced for one family only, but decided for another, keeps the family its data serves (reason
  ``"planned"``).

Everything here is a pure function of the config, the layers and the planner's counters: the
cadence and the plans are computed once per step, at its first hook or at ``step()`` (the plans again
after a window a GradScaler skipped: :meth:`Planner.plan`), and no collective is ever issued from a hook.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hylo.config import HyLoConfig, resolve
from hylo.distributed import Communicator
from hylo.layers.batch import LayerBatch, LayerShape
from hylo.layers.capture import LayerCapture, backward_pass
from hylo.layers.sampling import RowSample, row_sample
from hylo.layers.statistics import CallStatistic, CapturedCall, CapturePlan
from hylo.payload import CONTROL, Payload
from hylo.policy import SolverPolicy, decode_decisions, encode_decisions, is_dynamic, kfac_refusal
from hylo.records import Decision
from hylo.solvers import SolverFamily, family_of
from hylo.state import RegisteredLayer


def stagger_offsets(costs: Sequence[float], update_freq: int) -> list[int]:
    """Each layer's offset in a cycle of ``update_freq`` steps under ``stagger_updates``: layers by estimated
    solve cost, largest first, each to the offset with the least cost so far (the fewest layers on a tie, then
    the lowest), so that every step of the cycle carries about the same share of the update's work."""
    load = [(0.0, 0, slot) for slot in range(update_freq)]
    offsets = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        slot = min(range(update_freq), key=lambda k: load[k])
        cost, count, _ = load[slot]
        load[slot] = (cost + costs[i], count + 1, slot)
        offsets[i] = slot
    return offsets


def _disarm(captures: list[LayerCapture]) -> None:
    for capture in captures:
        capture.arm(False)


class Planner:
    """The run's cadence counters and each step's capture plans."""

    def __init__(
        self, layers: Sequence[RegisteredLayer], policy: SolverPolicy, world_size: int, config: HyLoConfig
    ) -> None:
        self.layers = list(layers)
        self.policy = policy
        self.world_size = world_size
        #: ``step()`` calls so far (the current step's index).
        self.step = 0
        #: Update steps so far (the studies sample by it).
        self.updates = 0
        #: Whether the next step must update whatever the cadence (a skipped update step, or a state a load lacks).
        self.needs_update = False
        #: The layers whose state their last update rejected (non-finite): warned once until one is accepted.
        self.rejected: set[str] = set()
        self._cadence: tuple[int, bool, frozenset[str], int, frozenset[str] | None] = (-1, False, frozenset(), 0, None)
        self._offsets: dict[int, list[int]] = {}
        self._plans: tuple[int, list[CapturePlan | None]] = (-1, [])
        #: The (1 over the loss scale, backward pass) the current plans were last checked at (:meth:`plan`).
        self._planned: tuple[float, int | None] = (1.0, None)
        self._arm_error: tuple[int, Exception] | None = None
        #: Each layer's (rows, K-FAC rows) at its last update: the whole window of an accumulating loop, which the
        #: forecast assumes again (docs/design.md, "Memory").
        self._window: dict[str, tuple[int, int]] = {}
        self.arm(config)
        # a preconditioner dropped without remove() leaves hooks that must capture nothing
        weakref.finalize(self, _disarm, [layer.capture for layer in self.layers])

    def reset(self, config: HyLoConfig) -> None:
        """Forget the current step's cadence and plans (after a load or a new config); arm the hooks anew."""
        self._cadence = (-1, False, frozenset(), 0, None)
        self._offsets = {}
        self._plans = (-1, [])
        self.arm(config)

    def arm(self, config: HyLoConfig) -> None:
        """Set each layer's capture flag for the current step, between steps (docs/wrappers.md, "torch.compile").

        The hooks read these plain flags, never this planner: on steps that do not capture, compiled
        code traces them to nothing; on steps that do, compiled code runs eagerly.

        A callable option (``update_freq``, ``factor_update_freq``) that raises or returns an invalid value
        here leaves the hooks unarmed, and the step's :meth:`cadence` raises that error from ``step()``,
        before anything changes — never from the model's forward or backward (docs/reliability.md,
        "Transactional steps").
        """
        self._arm_error = None
        try:
            wanted = [self.capturing(config, layer.name) for layer in self.layers]
        except Exception as err:  # the user's callable: whatever it raises, step() raises
            wanted = [False] * len(self.layers)
            self._arm_error = (self.step, err)
        for layer, active in zip(self.layers, wanted, strict=True):
            layer.capture.arm(active)

    def cadence(self, config: HyLoConfig) -> tuple[bool, frozenset[str]]:
        """This step's (update?, layers refreshing their running statistics), computed once per step.

        An update step captures the layers it updates (:meth:`updating`). Otherwise, at a
        ``factor_update_freq`` step, the layers whose family keeps running statistics (K-FAC) capture
        and refresh them.
        """
        return self._cadence_of(config)[:2]

    def update_freq(self, config: HyLoConfig) -> int:
        """``update_freq``'s value at this step (its callable called once per step)."""
        return self._cadence_of(config)[2]

    def updating(self, config: HyLoConfig, name: str) -> bool:
        """Whether this step updates layer ``name``: every layer at an update step, or under ``stagger_updates``
        the layers whose offset this step is (every layer at step 0 and when an update is owed)."""
        update, _, _, due = self._cadence_of(config)
        return update and (due is None or name in due)

    def _cadence_of(self, config: HyLoConfig) -> tuple[bool, frozenset[str], int, frozenset[str] | None]:
        """(update?, layers refreshing, update_freq's value, the layers updated: None for all) of this step, each
        callable evaluated once per step."""
        step, update, refreshing, freq, due = self._cadence
        if step != self.step:
            if self._arm_error is not None and self._arm_error[0] == self.step:
                # the hooks were left unarmed for this step's forward: this step cannot capture
                raise self._arm_error[1]
            freq = resolve("update_freq", config.update_freq, self.step)
            due = None
            if config.stagger_updates and not self.needs_update and self.step > 0:
                offsets = self._stagger(config, freq)
                due = frozenset(
                    layer.name for layer, offset in zip(self.layers, offsets, strict=True) if offset == self.step % freq
                )
                update = bool(due)
            else:
                update = self.needs_update or self.step % freq == 0
            refreshing = frozenset()
            factor_freq = config.kfac.factor_update_freq
            if not update and factor_freq is not None:
                if self.step % resolve("factor_update_freq", factor_freq, self.step) == 0:
                    refreshing = frozenset(
                        layer.name
                        for layer in self.layers
                        if layer.state is not None and family_of(layer.solver).refreshes
                    )
            self._cadence = (self.step, update, refreshing, freq, due)
        return update, refreshing, freq, due

    def _stagger(self, config: HyLoConfig, freq: int) -> list[int]:
        """The layers' offsets for ``freq`` (:func:`stagger_offsets` on each layer's configured solver's estimated
        solve, computed once per value of ``update_freq``)."""
        if freq not in self._offsets:
            costs = []
            options = config.family_options()
            for layer in self.layers:
                solver = config.initial_solver(layer.name)
                shape = LayerShape.of(layer.math, 0, 0, 0, self.world_size)
                costs.append(family_of(solver).cost(shape, solver, options).solve)
            self._offsets[freq] = stagger_offsets(costs, freq)
        return self._offsets[freq]

    def sample(self, index: int, config: HyLoConfig) -> RowSample | None:
        """The rows layer ``index``'s factors are formed from at this step (None: every row; docs/solvers.md,
        "Sampled factors"): the same in its gradient hook and at ``step()``, on every rank and after a resume."""
        kfac = config.kfac
        return row_sample(
            kfac.factor_sample, kfac.factor_sampler, config.lowrank.seed, self.step, self.layers[index].name
        )

    def capturing(self, config: HyLoConfig, name: str) -> bool:
        """Whether this step captures layer ``name``'s inputs and output gradients."""
        _, refreshing = self.cadence(config)
        return self.updating(config, name) or name in refreshing

    def plan(self, index: int, config: HyLoConfig, inputs: Callable[[], tuple[bool, float]]) -> CapturePlan | None:
        """What layer ``index``'s calls are reduced to at this step (None: kept raw), fixed at the step's
        first backward hook. ``inputs()``, called then and at the first hook of each later backward pass,
        says whether a study samples this update and what multiplies the output gradients (1 over the loss
        scale: one host sync per backward pass on CUDA, with a GradScaler).

        Within a step's window the loss scale cannot change: only a GradScaler's ``update()`` changes it,
        which comes after ``step()``. A scale that differs from the plans' therefore means ``update()`` ran
        without a ``step()``: the scaler skipped the window the plans were made for (``scaler.step`` found
        infs and did not call the optimizer form's ``step()``). Its calls are dropped and the plans made again
        at the current scale, so that the step is that of a run that never saw the skipped batch (docs/transformers.md,
        "Mixed precision"). A scaler that grew after a successful step is no skip: that step made new plans.
        """
        step, plans = self._plans
        current = backward_pass()  # None where torch does not tell: check at every hook
        if step != self.step:
            study, scale = inputs()
            plans = self._make_plans(config, study, scale)
            self._plans, self._planned = (self.step, plans), (scale, current)
        elif current is None or current != self._planned[1]:
            study, scale = inputs()
            if scale != self._planned[0]:
                for layer in self.layers:
                    layer.capture.drop_completed()  # the skipped window's; this pass's calls await their backward
                plans = self._make_plans(config, study, scale)
                self._plans = (self.step, plans)
            self._planned = (scale, current)
        return plans[index]

    def _make_plans(self, config: HyLoConfig, study_due: bool, scale: float) -> list[CapturePlan | None]:
        update, refreshing = self.cadence(config)
        if not update:  # the layers refreshing their family's running statistics capture that statistic
            return [
                CapturePlan(frozenset({family_of(layer.solver).statistic}), scale) if layer.name in refreshing else None
                for layer in self.layers
            ]
        if study_due:
            return [None] * len(self.layers)
        fixed = [self._fixed_family(layer.name, config) for layer in self.layers]
        forecast: list[SolverFamily] | None = None
        plans: list[CapturePlan | None] = []
        for i, family in enumerate(fixed):
            if not self.updating(config, self.layers[i].name):
                plans.append(None)  # not captured at this step (stagger_updates)
            elif family is not None:
                plans.append(CapturePlan(frozenset({family.statistic}), scale))
            elif config.policy.solver_fn is not None:
                plans.append(None)  # a user's rule sees the step's stats only at step(): keep the calls raw
            else:
                forecast = forecast or self.forecast(config)
                # the hybrid rule's low-rank path stays open (rows are cheap) beside the forecast's family
                lowrank = {family_of(config.policy.critical_variant), family_of(config.policy.stable_variant)}
                plans.append(CapturePlan(frozenset(f.statistic for f in {*lowrank, forecast[i]}), scale))
        return plans

    @staticmethod
    def _fixed_family(name: str, config: HyLoConfig) -> SolverFamily | None:
        """The family of a layer whose solver is fixed (an override, or a fixed solver without ``solver_fn``)."""
        forced = config.policy.override_for(name)
        if forced is not None or not is_dynamic(config):
            return family_of(forced or config.solver)
        return None

    def forecast(self, config: HyLoConfig) -> list[SolverFamily]:
        """The family the policy is expected to give each layer: on the rows captured so far or, when more, the rows
        of the layer's last update (a window of gradient accumulation is seen whole only at ``step()``); K-FAC's,
        which keeps every family open, for a layer not updated yet (docs/design.md, "Memory")."""
        shapes, unseen = [], []
        for layer in self.layers:
            counts = [CapturedCall.of(layer.math, call) for call in layer.capture.calls()]
            rows, kfac_rows = sum(c.rows for c in counts), sum(c.kfac_rows for c in counts)
            for record in layer.capture.pending():
                assert record.inputs is not None
                grad_like = record.inputs if record.out_shape is None else torch.empty(record.out_shape, device="meta")
                more = layer.math.row_counts(record.inputs, grad_like)
                rows, kfac_rows = rows + more[0], kfac_rows + more[1]
            window = self._window.get(layer.name)
            unseen.append(window is None)
            if window is not None and window[0] > rows:
                rows, kfac_rows = window
            kept = config.lowrank.expected_rows(rows, layer.kept) if rows else 0
            shapes.append(LayerShape.of(layer.math, rows, kfac_rows, kept, self.world_size))
        families = self.policy.forecast(self.step, shapes, self._cadence_of(config)[2], self.world_size, config)
        kfac = family_of(config.policy.kfac_solver)
        return [
            kfac
            if first and kfac_refusal(s.d_a, s.d_g, s.itemsize, config, config.policy.kfac_solver) is None
            else family
            for family, first, s in zip(families, unseen, shapes, strict=True)
        ]

    def decide(
        self,
        step: int,
        config: HyLoConfig,
        batch_of: Mapping[str, LayerBatch],
        gives: dict[CallStatistic[Any], list[bool]],
        comm: Communicator,
        device: torch.device,
    ) -> list[Decision]:
        """The solver of every layer in ``batch_of`` (the layers this update works on), chosen once and identically
        on all ranks (rank 0's choice is broadcast when it can differ); a layer whose calls serve another family
        keeps that one (:meth:`reconcile`)."""
        freq = self._cadence_of(config)[2]  # ``step`` is this planner's current step
        world = comm.world_size
        for name, batch in batch_of.items():
            if batch.rows:
                self._window[name] = (batch.rows, batch.kfac_rows)
        shapes = [
            batch_of[layer.name].shape(world, config.lowrank.expected_rows(batch_of[layer.name].rows, layer.kept))
            if layer.name in batch_of
            else LayerShape(layer.math.d_a, layer.math.d_g, world_size=world, blocks=layer.math.factor_blocks)
            for layer in self.layers
        ]
        decisions = self.policy.decide(step, shapes, freq, world, config)
        if world > 1 and is_dynamic(config):
            key = (CONTROL, "decisions")
            encoded = comm.broadcast(Payload({key: encode_decisions(decisions, device)}), src=0)[key]
            decisions = decode_decisions(encoded, step, [layer.name for layer in self.layers])
        worked = [decision for decision in decisions if decision.layer in batch_of]
        return self.reconcile(worked, gives, config)

    def reconcile(
        self, decisions: Sequence[Decision], gives: dict[CallStatistic[Any], list[bool]], config: HyLoConfig
    ) -> list[Decision]:
        """``decisions`` moved, where needed, to a family every rank's calls of the layer can serve.

        ``gives[statistic][i]``: whether layer i's calls give ``statistic`` on every rank. A decision
        whose family's statistic is missing takes the first family whose statistic is there, with
        the solver the policy gives that family in the layer's regime (reason ``"planned"``).
        """
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        reconciled = []
        for decision in decisions:
            i = index[decision.layer]
            if not gives[family_of(decision.solver).statistic][i]:
                served = [family for family in config.families() if gives[family.statistic][i]]
                if served:
                    decision = self.policy.substitute(decision, served[0], config)
            reconciled.append(decision)
        return reconciled

    def advance(self, update: bool, needs_update: bool, config: HyLoConfig) -> None:
        """Move to the next step after a successful one (the layers' new states stored) and arm its hooks."""
        self.step += 1
        self.updates += int(update)
        self.needs_update = needs_update
        self.arm(config)
