"""The layers a rank applies itself, checked (docs/design.md, "Placements"): :class:`Local`, where every rank holds
every state and whole gradients (one process, or DDP with ``strategy="inverse"``), and the part of
:class:`~hylo.pipeline.placement.owners.Owners` each rank computes."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hylo.layers.gradmatrix import checked_results
from hylo.numerics import kl_scale
from hylo.pipeline.apply import Checked, GroupedApply
from hylo.pipeline.placement.base import Applied, Placement, Ready
from hylo.pipeline.stage import UpdateStage
from hylo.solvers import LayerState


@dataclass(frozen=True)
class Here:
    """Some ready layers applied on this rank and checked, before ``kl_clip``: each one's result (in the order of
    the layers asked for), the tensors that hold them all (what ``kl_clip`` scales in place), and per row of the
    check — the layers in ``rows``' order (their indices among the registered layers: a list, a device tensor, or
    None for all in order) — ‖∇W‖, the verdict, 1 where a result fell back, and the float64 terms; ``placed``: the
    row of each layer asked for (None: row i is layer i); and the successors of the states that advance."""

    results: list[Tensor]
    stacks: list[Tensor]
    norms: Tensor
    ok: Tensor
    fell: Tensor
    terms: Tensor
    rows: list[int] | Tensor | None
    placed: Tensor | None
    successors: dict[str, LayerState]


def apply_here(grouped: GroupedApply, stage: UpdateStage, ready: Ready, members: Sequence[int]) -> Here:
    """The ready layers at positions ``members`` (each holding a :class:`LayerState`) applied and checked here: per
    group (:class:`~hylo.pipeline.apply.GroupedApply`), or layer by layer with ``grouped=False``, the reference.

    A grouped kernel that raises, whatever it raises, hands the step to the per-layer path: a layer whose own math
    raises is named there (docs/reliability.md, "Registration"); where every layer applies on its own, the step
    goes on with the per-layer results and a warning names the layers and the kernel's error."""
    layers = [ready.layers[i] for i in members]
    states = [ready.states[i] for i in members]
    held = [state for state in states if isinstance(state, LayerState)]
    assert len(held) == len(states), "a rank applies only the states it holds"
    indices = [ready.indices[i] for i in members]
    names = [layer.name for layer, _ in layers]
    if ready.config.grouped:
        try:
            done = grouped.checked(layers, held, indices, ready.norms)
        except Exception as err:
            here = _layer_by_layer(stage, ready, members, held)
            warnings.warn(
                f"the grouped step raised {type(err).__name__}: {err}; this step's layers were applied layer by "
                f"layer instead, with the same results to round-off ({', '.join(names)}); please report it "
                "(grouped=False applies layer by layer at every step)",
                stacklevel=6,
            )
            return here
        plan = done.plan
        fell = torch.where(done.ok, plan.zero, plan.one)
        placed = plan.placed if plan.order is not None or len(plan.groups) > 1 else None
        results = done.in_ready_order()
        ready.watch.lap("precondition", names)
        return Here(results, done.stacks, done.norms, done.ok, fell, done.terms, plan.order, placed, done.successors)
    return _layer_by_layer(stage, ready, members, held)


def _layer_by_layer(stage: UpdateStage, ready: Ready, members: Sequence[int], held: Sequence[LayerState]) -> Here:
    """:func:`apply_here` one layer at a time: each state's own ``advance`` and the layer-by-layer check."""
    grads = [ready.layers[i][1] for i in members]
    names = [ready.layers[i][0].name for i in members]
    results, successors = stage.apply_layers(list(zip(names, held, grads, strict=True)), ready.watch)
    norms = [ready.norms[ready.indices[i]] for i in members]
    bounds = [state.bound for state in held]
    written, fell, terms = checked_results(grads, [results[name] for name in names], norms, bounds)
    ready.watch.lap("precondition", names)
    rows = [ready.indices[i] for i in members]
    return Here(written, written, torch.stack(norms), fell == 0, fell, terms, rows, None, successors)


class Local(Placement):
    """Every rank holds every state and whole gradients: the grouped step, or layer by layer (``grouped=False``)."""

    def __init__(self, stage: UpdateStage) -> None:
        super().__init__(stage)
        self.grouped = GroupedApply()

    def tensors(self) -> list[Tensor]:
        """The apply plan's stacked copies and limits."""
        return self.grouped.tensors()

    def run(self, ready: Ready) -> Applied:
        """Per group, or per layer: the same results to round-off (``tests/library/test_grouped_step.py``)."""
        here = apply_here(self.grouped, self.stage, ready, range(len(ready.layers)))
        if ready.clip is not None:
            torch._foreach_mul_(here.stacks, kl_scale(here.terms, here.norms, here.ok, *ready.clip))
        return here.results, Checked(here.rows, here.fell, here.terms), here.successors
