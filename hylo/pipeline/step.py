"""One step's hyperparameters and the record of what it computed (docs/reliability.md, "Transactional steps").

A step evaluates every schedule first (:class:`StepValues`), computes everything into an
:class:`Outcome` without touching the preconditioner, and only then commits it. :func:`update` and
:func:`refresh` run the update stage's jobs into the outcome; :func:`apply` is the last
phase, the states applied to the gradients with the raw-gradient fallback and the whole step's
``kl_clip`` trust region.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Collection, Sequence

from torch import Tensor

from hylo.config import HyLoConfig, resolve
from hylo.layers.batch import LayerBatch
from hylo.layers.gradmatrix import GradMatrix
from hylo.pipeline.apply import Checked
from hylo.pipeline.placement import Placement, Ready
from hylo.pipeline.stage import UpdateStage
from hylo.records import Decision, StudyResult
from hylo.solvers import HeldState, RemoteState, UpdateContext
from hylo.solvers.base import Clock, UpdateJob
from hylo.state import UNSOLVED, RegisteredLayer


@dataclasses.dataclass(frozen=True)
class StepValues:
    """A step's hyperparameters, evaluated and checked before anything changes."""

    damping: float
    factor_decay: float
    kl_clip: float | None
    lr: float | None

    @classmethod
    def at(cls, config: HyLoConfig, step: int) -> StepValues:
        """Every schedule of ``config`` evaluated (and checked) at ``step``."""
        kl_clip = config.kl_clip
        return cls(
            damping=resolve("damping", config.damping, step),
            factor_decay=resolve("factor_decay", config.kfac.factor_decay, step),
            kl_clip=None if kl_clip is None else resolve("kl_clip", kl_clip, step),
            lr=None if config.lr is None or kl_clip is None else resolve("lr", config.lr, step),
        )

    def context(self, config: HyLoConfig, rank: int, seed: int, watch: Clock) -> UpdateContext:
        """The per-update values the solver families read (``seed``: of this update's random draws)."""
        return UpdateContext(
            rank=rank,
            damping=self.damping,
            factor_decay=self.factor_decay,
            seed=seed,
            watch=watch,
            options=config.family_options(),
        )


@dataclasses.dataclass
class Outcome:
    """Everything a step computed; stored on the preconditioner only once the whole step succeeded."""

    kind: str
    needs_update: bool
    norms: Tensor | None = None
    worked: list[RegisteredLayer] = dataclasses.field(default_factory=list)
    batches: list[LayerBatch] = dataclasses.field(default_factory=list)
    decisions: list[Decision] = dataclasses.field(default_factory=list)
    states: dict[str, HeldState] = dataclasses.field(default_factory=dict)
    owners: dict[str, int] = dataclasses.field(default_factory=dict)
    written: dict[str, Tensor] = dataclasses.field(default_factory=dict)
    #: The ∇W each written result replaces, by layer (the gradients the step read: the write-back's targets).
    grads: dict[str, GradMatrix] = dataclasses.field(default_factory=dict)
    #: Each low-rank layer's (rows, rows kept) per rank at this update (:attr:`UpdateResult.chosen`).
    chosen: dict[str, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    #: Layers whose new state this update rejected (non-finite): they keep their previous one.
    rejected: list[str] = dataclasses.field(default_factory=list)
    #: The check of the preconditioned layers' results: where each fell back to its raw gradient, and its terms.
    checked: Checked | None = None
    study: StudyResult | None = None

    def state_of(self, layer: RegisteredLayer) -> HeldState | None:
        """The layer's state after this step: the new one if the step made one, else its current one."""
        return self.states.get(layer.name, layer.state)

    def solved(self, layer: RegisteredLayer, placement: Placement) -> bool:
        """Whether the layer's state after this step can precondition: solved here, or by its owner where the
        placement applies remote states (:attr:`~hylo.pipeline.placement.Placement.applies_remote`)."""
        state = self.state_of(layer)
        if isinstance(state, RemoteState):
            return placement.applies_remote and self.owners.get(layer.name, layer.owner) != UNSOLVED
        return state is not None


def update(
    stage: UpdateStage,
    placement: Placement,
    step: int,
    context: UpdateContext,
    outcome: Outcome,
    rejected_before: Collection[str],
) -> None:
    """Run the update stage on the layers with rows, with the solvers decided (``outcome.decisions``); their new
    states go to ``outcome``. A non-finite state is rejected: the layer keeps its previous state until its next
    scheduled update, the other layers keep their cadence, and a warning names it once per run of rejections
    (``rejected_before``: the layers rejected at their previous update; docs/reliability.md, "Non-finite values")."""
    solvers = [decision.solver for decision in outcome.decisions]
    jobs = [
        UpdateJob(layer.name, solver, batch, layer.state)
        for layer, batch, solver in zip(outcome.worked, outcome.batches, solvers, strict=True)
    ]
    outcome.needs_update = False
    if not jobs:
        return
    result = stage.update(jobs, context, placement)
    outcome.rejected = list(result.rejected)
    new = [name for name in result.rejected if name not in rejected_before]
    if new:
        warnings.warn(
            f"step {step}: non-finite curvature for {new}; keeping their previous state (none before their first "
            "update: their gradients are left raw) until their next scheduled update",
            stacklevel=5,
        )
    for job in jobs:
        if job.name not in result.rejected:
            outcome.states[job.name] = result.states[job.name]
            outcome.owners[job.name] = result.owners[job.name]
            if job.name in result.chosen:
                outcome.chosen[job.name] = result.chosen[job.name]
    outcome.decisions = [
        dataclasses.replace(d, rows_kept=sum(r for _, r in outcome.chosen[d.layer])) if d.layer in outcome.chosen else d
        for d in outcome.decisions
    ]
    outcome.decisions = [
        dataclasses.replace(d, notes=result.notes[d.layer])
        if d.layer in result.notes and d.layer not in result.rejected
        else d
        for d in outcome.decisions
    ]


def refresh(stage: UpdateStage, placement: Placement, step: int, context: UpdateContext, outcome: Outcome) -> None:
    """A ``factor_update_freq`` step: fold the batches into the running statistics (no solve)."""
    jobs = [
        UpdateJob(layer.name, layer.solver, batch, layer.state)
        for layer, batch in zip(outcome.worked, outcome.batches, strict=True)
    ]
    result = stage.refresh(jobs, context, placement)
    if result.rejected:
        warnings.warn(
            f"step {step}: non-finite factors for {result.rejected}; keeping their previous ones", stacklevel=4
        )
    outcome.states.update((k, v) for k, v in result.states.items() if k not in result.rejected)


def apply(
    placement: Placement,
    ready: Sequence[tuple[RegisteredLayer, GradMatrix]],
    indices: Sequence[int],
    norms: Tensor,
    outcome: Outcome,
    values: StepValues,
    config: HyLoConfig,
    watch: Clock,
) -> tuple[dict[str, Tensor], Checked]:
    """Every ready layer's preconditioned gradient (with kl_clip scaling), by layer, not yet written back,
    and the check (:class:`~hylo.pipeline.apply.Checked`; ``indices``: each ready layer's among the registered
    ones). ``norms``: every registered layer's ‖∇W‖ (float64, over every
    rank's rows: the guard's). The placement chosen at construction runs it (:mod:`hylo.pipeline.placement`).

    A layer whose result is not finite although its gradient is (an overflow in the solve's
    arithmetic), or that is not a descent direction no longer than ‖∇W‖/λ as its damped system
    guarantees (:func:`~hylo.numerics.sound`), keeps its raw gradient this step, decided on
    device (docs/reliability.md, "Fallbacks").
    """
    clip = None
    if values.kl_clip is not None:
        assert values.lr is not None
        clip = values.kl_clip, values.lr
    states = [state for layer, _ in ready if (state := outcome.state_of(layer)) is not None]
    assert len(states) == len(ready), "a ready layer holds a state"
    owners = [outcome.owners.get(layer.name, layer.owner) for layer, _ in ready]
    results, checked, successors = placement.run(Ready(ready, states, owners, indices, norms, clip, config, watch))
    outcome.states.update(successors)  # stored with the rest of the step, once it succeeds
    outcome.grads = {layer.name: grad for layer, grad in ready}
    return {layer.name: v for (layer, _), v in zip(ready, results, strict=True)}, checked
