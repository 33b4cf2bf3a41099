"""HyLoPreconditioner: runs a step — check, decide, update stage, precondition, commit — and nothing else.

docs/design.md, "Data path of one step". Its collaborators each do one job: the
:class:`~hylo.pipeline.planner.Planner` (cadence and what hooks keep), the :class:`~hylo.pipeline.guard.Guard`
(gradients, finiteness, agreement across ranks), the :class:`~hylo.policy.SolverPolicy`, the
:class:`~hylo.pipeline.stage.UpdateStage` (solver families and collectives),
:mod:`hylo.pipeline.checkpoint`, :mod:`hylo.memory` and :class:`~hylo.telemetry.monitor.Telemetry`. The
configuration has one holder, :attr:`HyLoPreconditioner.config`; every collaborator receives it
per call, so :meth:`~HyLoPreconditioner.reconfigure` and ``load_state_dict`` reach all of them.
"""

from __future__ import annotations

import os
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hylo import memory, views
from hylo.config import HyLoConfig, options
from hylo.distributed import Communicator, default_communicator
from hylo.fingerprint import Fingerprint
from hylo.layers.batch import LayerBatch
from hylo.layers.capture import KeptCalls
from hylo.layers.coverage import Coverage
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.statistics import CapturedCall, capture_call
from hylo.layers.walk import NoLayerError, register_layers
from hylo.memory import MemoryUsage
from hylo.pipeline import checkpoint, liveness
from hylo.pipeline.apply import write_back
from hylo.pipeline.checkpoint import OptionsOnLoad
from hylo.pipeline.effect import EffectWatch
from hylo.pipeline.guard import Agreement, Guard
from hylo.pipeline.loss_scale import LossScale
from hylo.pipeline.placement import placement_for
from hylo.pipeline.planner import Planner
from hylo.pipeline.stage import UpdateStage
from hylo.pipeline.step import Outcome, StepValues, apply, refresh, update
from hylo.policy import SolverPolicy, check_kfac_budget
from hylo.records import Decision, LayerInfo, Progress, format_summary
from hylo.state import RegisteredLayer, layer_parameters, registered_layers
from hylo.telemetry import recording
from hylo.telemetry.monitor import Telemetry
from hylo.version import __version__

#: Decisions kept in ``decision_log`` (oldest dropped first).
DECISION_LOG_SIZE = 100_000
#: Options that cannot change after construction (their effect is built in: hooks, files, layer math).
FIXED_OPTIONS = frozenset(spec.name for spec in options() if spec.fixed)


def _weakly(method: Callable[..., Any], fallback: Any) -> Callable[..., Any]:
    """``method`` called through a weak reference (``fallback(*args)`` once its object is gone); a closure,
    so that a deep copy of the model shares it rather than copying the reference."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return fallback(*args) if bound is None else bound(*args)

    return call


def _checked_config(config: object) -> HyLoConfig | None:
    """``config`` if it is a :class:`HyLoConfig` or None, else ``ValueError``."""
    if config is not None and not isinstance(config, HyLoConfig):
        raise ValueError(f"config must be a hylo.HyLoConfig (or None), got {type(config).__name__}")
    return config


class HyLoPreconditioner:
    """Drop-in natural-gradient preconditioner: call ``step()`` between backward and ``optimizer.step()``.

    ``step()`` rewrites ``.grad`` of every registered layer (``nn.Linear``, ``nn.Conv2d``,
    ``nn.Embedding``, ``nn.MultiheadAttention``'s projections, and types added with
    :func:`hylo.register_layer_type`) in place with (F̃ + λI)⁻¹ ∇W for the layer's curvature
    estimate F̃ (see :class:`hylo.HyLoConfig` for the options). Layer inputs and output gradients
    are captured only on update steps (``step % update_freq == 0``; step 0 is one); in between the
    stored state is reused.

    Args:
        model: the model, optionally wrapped in ``DistributedDataParallel``.
        config: a :class:`HyLoConfig`; keyword options override its fields.
        communicator: collectives between ranks; default: torch.distributed's default group
            when initialised with more than one rank, else a 1-rank stand-in.
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss, if any (:attr:`grad_scaler`): captured
            output gradients are divided by its scale, and steps whose gradients it found non-finite are skipped
            without a warning. Call ``step()`` after ``scaler.unscale_(optimizer)``, before ``scaler.step(optimizer)``.
        **options: any option of :class:`HyLoConfig`, flat, e.g. ``damping=1e-3``, ``update_freq=20``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: HyLoConfig | None = None,
        communicator: Communicator | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        **options: Any,
    ) -> None:
        self._scale = LossScale(grad_scaler)
        base = _checked_config(config) or HyLoConfig()
        self._config = base.replace(**options) if options else base
        self.comm = communicator or default_communicator(self._config.distributed.bucket_cap_mb)
        #: Per-update decisions (bounded; oldest dropped first).
        self.decision_log: deque[Decision] = deque(maxlen=DECISION_LOG_SIZE)
        self._stage = UpdateStage(self.comm)
        self._generator = torch.Generator().manual_seed(self._config.lowrank.seed)
        self._removed = False
        found = register_layers(model, self._config)
        self._registration = found
        self._layers = registered_layers(found, self._config)  # K-FAC's memory budget checked
        self._effect = EffectWatch(self._layers)
        self._index = {layer.name: i for i, layer in enumerate(self._layers)}
        self._kept = KeptCalls([layer.capture for layer in self._layers])  # a failed step's calls, for a retry
        for index, layer in enumerate(self._layers):
            layer.capture.reducer = self._reducer(index)
        found.warn_unsupported()
        if not self._layers:
            raise NoLayerError()
        self._policy = SolverPolicy([layer.name for layer in self._layers])
        self._planner = Planner(self._layers, self._policy, self.comm.world_size, self._config)
        try:  # FSDP2-sharded layers: checked here, before any step (docs/distributed.md, "FSDP2")
            #: Every decision that depends on the distribution, chosen once (docs/design.md, "Placements")
            self._placement = placement_for(self._stage, self._layers, self._config)
            self._guard = Guard(self._layers, self.comm, self._placement)
            self._telemetry = Telemetry.open(self._config, self.comm, self._layers, __version__)
        except Exception:
            self.remove()  # a refused profile_dir or sharding leaves the model without hylo's hooks
            raise
        self._fingerprint = Fingerprint(self.comm, self._layers, self._guard, self._planner)
        liveness.claim(self, self._layers)  # built: supersede a live one holding these layers, with a warning

    def _reducer(self, index: int) -> Callable[[Tensor, Tensor], CapturedCall]:
        """Layer ``index``'s gradient-hook reduction, through a weak reference to this preconditioner."""
        math = self._layers[index].math
        reduce = _weakly(self._reduce_call, lambda i, x, g: CapturedCall.of(math, (x, g)))
        return lambda x, g: reduce(index, x, g)

    # ------------------------------------------------------------------ configuration
    @property
    def config(self) -> HyLoConfig:
        """The options in force: the one holder every collaborator reads (change them with :meth:`reconfigure`)."""
        return self._config

    @property
    def steps(self) -> int:
        """``step()`` calls that succeeded so far."""
        return self._planner.step

    def reconfigure(self, config: HyLoConfig | None = None, **options: Any) -> None:
        """Replace the options, between steps: ``config`` and/or flat ``options`` (checked like a new config).

        Every collaborator reads the new options from the next step on; a new ``seed`` reseeds the
        generator of KIS's draws. Options built into the hooks, the files or the layers' math
        (:data:`FIXED_OPTIONS`, e.g. ``skip_layers``, ``conv_rows``, ``strategy``, ``profile_dir``)
        cannot change: ``ValueError``, and nothing changes.
        """
        new = (_checked_config(config) or self._config).replace(**options)
        changed = sorted(name for name in FIXED_OPTIONS if new.value(name) != self._config.value(name))
        if changed:
            raise ValueError(f"options {changed} cannot change after construction: create a new HyLoPreconditioner")
        check_kfac_budget([layer.shape() for layer in self._layers], new)
        if new.lowrank.seed != self._config.lowrank.seed:
            self._generator = torch.Generator().manual_seed(new.lowrank.seed)
        self._config = new
        self._planner.reset(new)

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler whose scale divides the captured output gradients (``grad_scaler=``); set it between steps,
        e.g. to the one a training stack made after the optimizer (docs/transformers.md, "Mixed precision")."""
        return self._scale.scaler

    @grad_scaler.setter
    def grad_scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        self._scale.scaler = scaler

    def _plan_inputs(self) -> tuple[bool, float]:
        """What a step's plans depend on besides the config: whether a study samples this update (its
        reference needs raw calls) and 1 over the loss scale. Read once per step, when the plans are made."""
        return any(self._telemetry.studies_due(self._planner.updates, self._config)), 1.0 / self._scale.value()

    def _reduce_call(self, index: int, x: Tensor, grad_out: Tensor) -> CapturedCall:
        """Layer ``index``'s call reduced in its gradient hook as this step's plan says (docs/design.md, "Memory")."""
        layer, watch = self._layers[index], self._telemetry.watch
        begin = watch.mark()
        plan = self._planner.plan(index, self._config, self._plan_inputs)
        call = capture_call(layer.math, x, grad_out, plan, self._planner.sample(index, self._config))
        watch.hook(layer.name, begin)
        return call

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of all registered layers in place.

        A step applies whole or not at all: if it raises, the step count, every layer's state and
        the gradients are as they were, and its captured calls are kept, so that calling ``step()``
        again without a new forward and backward (after fixing what made it raise) gives what a step
        that never failed gives (docs/reliability.md, "Transactional steps"). With P > 1 ranks, the
        first step (and the first after the options change) checks that every rank registered the
        same layers with the same options: ``ValueError`` on every rank naming what differs
        (docs/reliability.md, "Agreement across ranks").
        """
        if self._removed:
            raise RuntimeError(liveness.removed_message(self))
        config, step, watch = self._config, self._planner.step, self._telemetry.watch
        self._kept.settle()
        watch.start()
        traffic = self._telemetry.traffic()
        try:
            values = StepValues.at(config, step)
            is_update, refreshing = self._planner.cadence(config)
            if self._fingerprint.compared is None:  # before any other collective
                self._fingerprint.compare(config, step, values)
            grads = self._guard.gradients()
            capturing = [self._planner.capturing(config, layer.name) for layer in self._layers]
            agreed = self._guard.agree(
                step, grads, capturing, config.statistics(), self._fingerprint.compared is config
            )
            if agreed.recheck:  # some rank's options changed (reconfigure, load_state_dict): compare them again
                self._fingerprint.compare(config, step, values)
            watch.lap("check")
            generator, trend = self._generator.get_state(), self._policy.trend.snapshot()
            try:
                outcome = self._compute(step, config, values, grads, agreed, is_update, capturing)
            except BaseException:
                self._generator.set_state(generator)
                self._policy.trend.restore(trend)
                raise
        except BaseException:
            watch.finish()  # nothing of a failed step is recorded
            self._kept.keep()
            raise
        for layer in self._layers:
            layer.capture.clear()
        if outcome.kind == "update" and outcome.checked is not None and outcome.norms is not None:
            self._effect.check(step, outcome, values.damping)
        self._commit(step, outcome, traffic)

    def _compute(
        self,
        step: int,
        config: HyLoConfig,
        values: StepValues,
        grads: list[GradMatrix | None],
        agreed: Agreement,
        is_update: bool,
        capturing: list[bool],
    ) -> Outcome:
        """Everything a step computes, nothing stored on the preconditioner yet (see :meth:`_commit`)."""
        needs_update = self._planner.needs_update
        if not agreed.finite:
            if not self._scale.enabled():  # a GradScaler found the infs too: it skips the step and backs off
                self._guard.warn_non_finite(step, grads)
            return Outcome("skipped", needs_update=needs_update or is_update)
        present = agreed.present
        self._policy.trend.observe(
            agreed.norms,
            config.policy.decay,
            None if all(present) else torch.tensor(present, device=agreed.norms.device),
        )
        outcome = Outcome("apply", needs_update=needs_update, norms=agreed.norms)
        if any(capturing):
            taking = [c and p for c, p in zip(capturing, present, strict=True)]
            without_rows: list[RegisteredLayer] = []
            for layer, took, rows in zip(self._layers, taking, agreed.rows, strict=True):
                if took and not rows and layer.capture.idle:
                    layer.idle += 1  # an expert no token was routed to (docs/moe.md, "Idle experts")
                elif took:
                    (outcome.worked if rows else without_rows).append(layer)
            self._guard.warn_no_rows(step, without_rows, bool(outcome.worked))
            scale, convention = self._scale.value(), config.damping_convention
            outcome.batches = self._guard.routed_scales(
                [
                    LayerBatch.of(layer.math, layer.capture.calls(), config.lowrank.rows_kept, scale, convention)
                    for layer in outcome.worked
                ]
            )
            self._telemetry.watch.lap("capture", [layer.name for layer in outcome.worked])
            if is_update:
                outcome.kind = "update"
                self._update(step, config, values, outcome, agreed)
                worked_grads = [g for layer in outcome.worked if (g := grads[self._index[layer.name]]) is not None]
                outcome.study = self._telemetry.run_studies(
                    step,
                    self._planner.updates,
                    config,
                    [layer.name for layer in outcome.worked],
                    outcome.batches,
                    worked_grads,
                    values.context(config, self.comm.rank, 0, self._telemetry.watch),
                )
            elif outcome.worked:
                outcome.kind = "refresh"  # no draws (seed 0): a refresh keeps the KIS generator's sequence
                context = values.context(config, self.comm.rank, 0, self._telemetry.watch)
                refresh(self._stage, self._placement, step, context, outcome)
        ready = [
            (layer, g)
            for layer, g, p in zip(self._layers, grads, present, strict=True)
            if p and g is not None and outcome.solved(layer, self._placement)
        ]
        if ready:
            indices = [self._index[layer.name] for layer, _ in ready]
            outcome.written, outcome.checked = apply(
                self._placement, ready, indices, agreed.norms, outcome, values, config, self._telemetry.watch
            )
        return outcome

    def _update(self, step: int, config: HyLoConfig, values: StepValues, outcome: Outcome, agreed: Agreement) -> None:
        """Decide the solvers of the layers with rows and run the update stage on them (:func:`hylo.pipeline.step.update`)."""
        batch_of = dict(zip([layer.name for layer in outcome.worked], outcome.batches, strict=True))
        outcome.decisions = self._planner.decide(step, config, batch_of, agreed.gives, self.comm, self._guard.device)
        self._telemetry.watch.lap("decide")
        seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
        context = values.context(config, self.comm.rank, seed, self._telemetry.watch)
        update(self._stage, self._placement, step, context, outcome, self._planner.rejected)

    def _commit(self, step: int, outcome: Outcome, traffic: dict[str, int]) -> None:
        """Store what a successful step computed, write the gradients back and record the step."""
        for layer in self._layers:
            if layer.name in outcome.states:
                layer.state = outcome.states[layer.name]
                layer.owner = outcome.owners.get(layer.name, layer.owner)
            if layer.name in outcome.chosen:
                counts = outcome.chosen[layer.name]
                layer.kept = sum(r for _, r in counts), sum(n for n, _ in counts)
        for decision in outcome.decisions:
            self._layers[self._index[decision.layer]].solver = decision.solver
        self.decision_log.extend(outcome.decisions)
        if outcome.checked is not None:
            self._guard.count_fallbacks(outcome.checked.indices, outcome.checked.flags)
        if outcome.kind == "update":
            self._guard.report_fallbacks(step)
        write_back(self._layers, outcome.written, outcome.grads)
        self._guard.mark_seen(bool(outcome.written))
        self._telemetry.watch.lap("precondition")
        if outcome.kind == "update":
            updated = {layer.name for layer in outcome.worked}
            self._planner.rejected = (self._planner.rejected - updated) | set(outcome.rejected)
        self._planner.advance(outcome.kind == "update", outcome.needs_update, self._config)
        if outcome.norms is not None:
            self._telemetry.record_norms(step, self._layers, outcome.norms, outcome.written, self._policy.trend)
        worked = list(zip(outcome.worked, outcome.batches, strict=True))
        self._telemetry.record(step, outcome.kind, outcome.decisions, outcome.study, traffic, worked, outcome.chosen)

    # ------------------------------------------------------------------ introspection
    def layer_info(self) -> list[LayerInfo]:
        """Each registered layer as it stands, read-only: shapes, solver, owner, state, captured calls, the policy's
        and the guard's facts of it (docs/usage.md, "Inspecting layers"); reads its counters from the device."""
        return views.layer_infos(self._layers, self._config, self._policy.trend, self._planner, self._guard)

    def progress(self) -> Progress:
        """Where the run stands: steps, updates, an update owed, profiling (docs/usage.md, "Inspecting layers")."""
        return views.progress(self._planner, self._telemetry)

    def parameters(self, *, solved: bool | None = None) -> list[nn.Parameter]:
        """The parameters whose gradients ``step()`` rewrites, each once (a parameter several layers share, such as
        MultiheadAttention's ``in_proj_weight``, once). For a solver whose result is the whole
        update direction, give them to an optimizer that applies only lr and weight decay (docs/usage.md,
        "Adaptive solvers"). ``solved``: only those of layers that hold a state (True), or of layers that hold
        none yet, whose gradients ``step()`` leaves raw (False)."""
        layers = self._layers if solved is None else [x for x in self._layers if (x.state is not None) is solved]
        return layer_parameters(layers)

    def solver_of(self, name: str) -> str:
        """The solver layer ``name`` used at the latest update (its configured one before any)."""
        if name not in self._index:
            raise KeyError(f"no registered layer named {name!r}")
        return self._layers[self._index[name]].solver

    def memory_usage(self) -> dict[str, int]:
        """Bytes of curvature state held per layer."""
        return memory.state_bytes(self._layers)

    def memory_breakdown(self) -> MemoryUsage:
        """Everything the preconditioner holds, by distinct storage: states, captured calls, bookkeeping.

        Between steps ``captured`` is 0 and the state bytes equal :meth:`memory_usage` (docs/design.md,
        "Memory"); during a step's forward and backward, ``captured`` is what the hooks keep for ``step()``;
        after a step that raised, it also counts that step's calls, kept for a retry until the next ``step()``.
        """
        held = [*self._guard.tensors(), *self._placement.tensors(), *self._policy.trend.tensors()]
        return memory.breakdown(self._layers, held)

    def coverage(self) -> Coverage:
        """The share of the model's trainable matrix parameters (by elements) hylo preconditions, and what it leaves
        alone by reason, as registered at construction (docs/usage.md, "Coverage")."""
        return self._registration.coverage

    def summary(self) -> str:
        """A printable table of registered layers and of the modules left alone, ending with the :meth:`coverage`."""
        head = f"HyLoPreconditioner(solver={self._config.solver!r}, layers={len(self._layers)}, "
        head += f"world_size={self.comm.world_size})"
        table = format_summary(head, self.layer_info(), [*self._registration.skipped, *self._registration.unsupported])
        return f"{table}\n{self._registration.coverage.line()}"

    __repr__ = summary

    # ------------------------------------------------------------------ lifecycle
    def remove(self) -> None:
        """Detach every hook and close the profile files; the model trains as if hylo had never been attached."""
        self._registration.remove()
        self._removed = True
        liveness.release(self)
        self.close()

    def flush_profile(self) -> dict[str, int]:
        """Write the queued profile rows to disk (``fsync``); each file's size by name, to save with a checkpoint
        (docs/profiling.md, "Checkpoints and kills"). Empty when not profiling."""
        return self._telemetry.flush()

    @staticmethod
    def rewind_profile(profile_dir: str | os.PathLike[str], sizes: Mapping[str, int]) -> list[str]:
        """Cut hylo's files in ``profile_dir`` back to ``sizes`` (a saved :meth:`flush_profile`) before resuming;
        the files cut or removed, or ``ValueError`` changing nothing (docs/profiling.md, "Checkpoints and kills")."""
        return recording.rewind_profile(profile_dir, sizes)

    @staticmethod
    def profile_files(profile_dir: str | os.PathLike[str]) -> list[str]:
        """hylo's files (any rank's) in ``profile_dir``: what a new preconditioner refuses unless ``profile_append``."""
        return recording.existing_files(profile_dir, rank=0)

    def close(self) -> None:
        """Flush and close the ``profile_dir`` files and stop recording (idempotent; also run at exit)."""
        telemetry = getattr(self, "_telemetry", None)
        if telemetry is not None:
            telemetry.close()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: step, constant options, per-layer states, sealed with a
        checksum of all of it that ``load_state_dict`` verifies (docs/reliability.md, "Checkpoints")."""
        return checkpoint.save(
            self._layers, self._planner, self._generator, self._policy.trend, self._config, self.comm
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], *, options: OptionsOnLoad = "restore", where: str | None = None
    ) -> None:
        """Restore a ``state_dict``, possibly saved at another world size or rank (docs/reliability.md,
        "Checkpoints").

        Everything is checked before anything changes — the checksum first, then every entry — and a
        state that does not fit raises ``ValueError`` (naming ``where``, e.g. the file it was read from,
        when given; :func:`hylo.load_checkpoint` passes the path) and leaves this preconditioner as it
        was. With P > 1 ranks every rank must call it: the ranks agree (one all-reduce) that all of them
        load, or none does, and whether any must recompute a layer at the next step.

        ``options`` says what becomes of the saved options (docs/usage.md, "Checkpoints"): ``"restore"``
        (as ``torch.optim`` does): the saved ``update_freq``, ``damping``, ``factor_decay``, ``kl_clip``,
        ``lr``, ``rank_ratio``, ``rank``, ``rank_energy``, ``rank_cap`` and ``seed`` replace this preconditioner's (where they are not
        callables), as :meth:`reconfigure` would, and one warning lists every option that differs;
        ``"keep"``: this preconditioner's options stay (a different ``seed`` reseeds KIS's generator);
        ``"refuse"``: a state saved with any other option is refused.
        """
        mode = checkpoint.check_mode(options)
        restored, error = None, None
        try:
            restored = checkpoint.read(
                state_dict, self._layers, self._config, self.comm, self._placement.keeps_remote, mode, where
            )
        except ValueError as err:
            error = err
        restored = checkpoint.agree(restored, error, self.comm, self._guard.device)
        # ---- everything fits on every rank: apply (nothing below raises)
        self._config, self._generator = restored.config, restored.generator
        checkpoint.restore(restored, self._layers, self._planner, self._policy, where)
