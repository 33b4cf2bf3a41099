"""The layers a rank applies itself, checked (docs/design.md, "Placements"): :func:`apply_here`, what every
placement runs on the states it holds, and :class:`Local`, where every rank holds every state and whole gradients
(one process, or DDP with ``strategy="inverse"``)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import Tensor

from hylo.pipeline.apply import GroupedApply, GroupedResults
from hylo.pipeline.placement.base import Applied, Placement, Ready
from hylo.pipeline.stage import UpdateStage
from hylo.solvers import LayerState


def apply_here(grouped: GroupedApply, singles: GroupedApply, ready: Ready, members: Sequence[int]) -> GroupedResults:
    """The ready layers at positions ``members`` (each holding a :class:`LayerState`) applied and checked here by
    their group kernels: per group (``grouped``), or one layer a group (``singles``, with ``grouped=False``).

    A grouped kernel that raises, whatever it raises, hands the step to the kernels one layer a group: a layer
    whose own apply raises is named there (docs/reliability.md, "Registration"); where every layer applies on its
    own, the step goes on with those results and a warning names the layers and the grouped kernel's error."""
    layers = [ready.layers[i] for i in members]
    states = [ready.states[i] for i in members]
    held = [state for state in states if isinstance(state, LayerState)]
    assert len(held) == len(states), "a rank applies only the states it holds"
    indices = [ready.indices[i] for i in members]
    names = [layer.name for layer, _ in layers]
    if ready.config.grouped:
        try:
            done = grouped.checked(layers, held, indices, ready.norms, ready.watch)
        except Exception as err:
            done = singles.checked(layers, held, indices, ready.norms, ready.watch)
            warnings.warn(
                f"the grouped step raised {type(err).__name__}: {err}; this step's layers were applied layer by "
                f"layer instead, with the same results to round-off ({', '.join(names)}); please report it "
                "(grouped=False applies layer by layer at every step)",
                stacklevel=6,
            )
    else:
        done = singles.checked(layers, held, indices, ready.norms, ready.watch)
    ready.watch.lap("precondition", names)
    return done


class Local(Placement):
    """Every rank holds every state and whole gradients: the grouped step, or one layer a group
    (``grouped=False``)."""

    def __init__(self, stage: UpdateStage) -> None:
        super().__init__(stage)
        self.grouped = GroupedApply()
        self.singles = GroupedApply(singles=True)

    def tensors(self) -> list[Tensor]:
        """Both plans' stacked copies and limits."""
        return self.grouped.tensors() + self.singles.tensors()

    def run(self, ready: Ready) -> Applied:
        """Per group, or one layer a group: the same results to round-off (``tests/library/test_grouped_step.py``)."""
        done = apply_here(self.grouped, self.singles, ready, range(len(ready.layers)))
        ready.kl_clipped(done.stacks, done.terms, done.norms, done.ok)
        return done.in_ready_order(), done.checked(), done.successors
