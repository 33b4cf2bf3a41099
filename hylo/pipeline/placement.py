"""Where a step's apply runs: chosen once at construction from the layout and the strategy, both fixed
(docs/design.md, "Placements").

A placement preconditions the ready layers' gradients, checks every result and scales them by ``kl_clip``; the
preconditioner calls it without knowing which one it holds:

- :class:`Local`: every rank holds every state and whole gradients (one process, or DDP with
  ``strategy="inverse"``): the grouped step (:mod:`hylo.pipeline.apply`), or layer by layer with
  ``grouped=False``, the reference;
- :class:`Owners`: ``strategy="gradient"`` with P > 1: each layer's owner applies and checks its state and
  broadcasts the result; every rank then checks finiteness only;
- :class:`Sharded`: FSDP2, each rank holding rows of every ∇W: the partial products exchanged in one fused
  all-reduce and one all-gather, the check's sums in one all-reduce (:mod:`hylo.pipeline.sharding`).
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from hylo.config import HyLoConfig
from hylo.layers.gradmatrix import GradMatrix, checked_results
from hylo.pipeline import sharding
from hylo.pipeline.apply import Checked, GroupedApply
from hylo.pipeline.stage import UpdateStage
from hylo.solvers import HeldState, LayerState
from hylo.solvers.base import Clock
from hylo.state import RegisteredLayer


@dataclass(frozen=True)
class Ready:
    """What a step hands its placement: the ready layers with their gradients, each one's state and owner after
    this step's update, its index among the registered layers, every registered layer's ‖∇W‖ (float64, over every
    rank's rows), ``kl_clip`` and lr (or None), the options and the clock."""

    layers: Sequence[tuple[RegisteredLayer, GradMatrix]]
    states: Sequence[HeldState]
    owners: Sequence[int]
    indices: Sequence[int]
    norms: Tensor
    clip: tuple[float, float] | None
    config: HyLoConfig
    watch: Clock

    @property
    def names(self) -> list[str]:
        """The layers' names."""
        return [layer.name for layer, _ in self.layers]

    @property
    def grads(self) -> list[GradMatrix]:
        """The layers' ∇W."""
        return [grad for _, grad in self.layers]

    def held(self) -> list[LayerState]:
        """The states, every one held on this rank (the placements where every rank holds every state)."""
        held = [state for state in self.states if isinstance(state, LayerState)]
        assert len(held) == len(self.states), "every rank holds every state here"
        return held

    def layer_norms(self) -> list[Tensor]:
        """Each layer's ‖∇W‖ (0-dim)."""
        return [self.norms[i] for i in self.indices]


#: Each layer's result (not yet written back), the check and the successors of the states that advance (not yet
#: stored).
Applied = tuple[list[Tensor], Checked, dict[str, LayerState]]


class Placement(ABC):
    """The apply, the check and ``kl_clip`` of a step for one layout of states and gradients."""

    def __init__(self, stage: UpdateStage) -> None:
        self.stage = stage

    @abstractmethod
    def precondition(self, ready: Ready) -> Applied:
        """Each ready layer's result, the fallbacks and the successors of the states that advance."""

    def tensors(self) -> list[Tensor]:
        """Tensors the placement keeps between steps (counted by ``memory_breakdown``)."""
        return []


class Local(Placement):
    """Every rank holds every state and whole gradients: the grouped step, or layer by layer (``grouped=False``)."""

    def __init__(self, stage: UpdateStage) -> None:
        super().__init__(stage)
        self.grouped = GroupedApply()

    def tensors(self) -> list[Tensor]:
        """The apply plan's stacked copies and limits."""
        return self.grouped.tensors()

    def precondition(self, ready: Ready) -> Applied:
        """Per group, or per layer: the same results to round-off (``tests/library/test_grouped_step.py``).

        A grouped kernel that raises, whatever it raises, hands the step to the per-layer path: a layer whose own
        math raises is named there (docs/reliability.md, "Registration"); where every layer applies on its own,
        the step goes on with the per-layer results and a warning names the layers and the kernel's error."""
        held, names = ready.held(), ready.names
        items = list(zip(names, held, ready.grads, strict=True))
        if ready.config.grouped:
            try:
                applied = self.grouped.precondition(ready.layers, held, ready.indices, ready.norms, ready.clip)
            except Exception as err:
                results, successors = self.stage.apply_layers(items, ready.watch)
                warnings.warn(
                    f"the grouped step raised {type(err).__name__}: {err}; this step's layers were applied layer by "
                    f"layer instead, with the same results to round-off ({', '.join(names)}); please report it "
                    "(grouped=False applies layer by layer at every step)",
                    stacklevel=5,
                )
            else:
                ready.watch.lap("precondition", names)
                return applied
        else:
            results, successors = self.stage.apply_layers(items, ready.watch)
        bounds = [state.bound for state in held]
        outputs = [results[name] for name in names]
        written, flags, terms = checked_results(ready.grads, outputs, ready.layer_norms(), bounds, ready.clip)
        ready.watch.lap("precondition", names)
        return written, Checked(list(ready.indices), flags, terms), successors


class Owners(Placement):
    """``strategy="gradient"`` with P > 1: owners apply, check and broadcast; every rank checks finiteness only,
    with one scale for all, so that every rank computes the same ⟨∇W, V̂⟩ for ``kl_clip`` and the ranks' weights
    stay equal bit for bit."""

    def precondition(self, ready: Ready) -> Applied:
        """The owners' checked results, shared; then the finiteness check and ``kl_clip`` on every rank."""
        names, grads, norms = ready.names, ready.grads, ready.layer_norms()
        items = list(zip(names, ready.states, ready.owners, grads, strict=True))
        results, successors = self.stage.apply_owned(items, dict(zip(names, norms, strict=True)), ready.watch)
        unbounded: list[float | None] = [None] * len(names)
        written, flags, terms = checked_results(grads, [results[n] for n in names], norms, unbounded, ready.clip)
        ready.watch.lap("precondition", names)
        return written, Checked(list(ready.indices), flags, terms), successors


class Sharded(Placement):
    """FSDP2: every rank holds every state and rows of every ∇W; everything a layer reduces over its gradient is
    made global by one collective (docs/distributed.md, "FSDP2")."""

    def precondition(self, ready: Ready) -> Applied:
        """Each rank's rows of every result, decided over every rank's rows."""
        held, names, grads = ready.held(), ready.names, ready.grads
        results, successors = sharding.precondition(
            self.stage.comm, list(zip(names, held, grads, strict=True)), ready.watch
        )
        outputs = [results[n] for n in names]
        bounds = [state.bound for state in held]
        comm = self.stage.comm
        written, flags, terms = sharding.agree_results(comm, grads, outputs, ready.layer_norms(), bounds, ready.clip)
        ready.watch.lap("precondition", names)
        return written, Checked(list(ready.indices), flags, terms), successors


def placement_for(stage: UpdateStage, sharded: bool, config: HyLoConfig) -> Placement:
    """The placement of a preconditioner whose layers are ``sharded`` (FSDP2) or not, with ``config``'s strategy
    (both fixed at construction)."""
    if sharded:
        return Sharded(stage)
    if config.distributed.strategy == "gradient" and stage.comm.world_size > 1:
        return Owners(stage)
    return Local(stage)
