"""What every placement is handed and returns (docs/design.md, "Placements")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.layers.gradmatrix import GradMatrix
from hylo.numerics import kl_scale
from hylo.pipeline.apply import Checked
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

    def kl_clipped(self, results: Sequence[Tensor], terms: Tensor, norms: Tensor, ok: Tensor) -> None:
        """``results`` scaled in place by ``kl_clip``'s one factor (:func:`~hylo.numerics.kl_scale`) from each
        result's terms [⟨∇W, V̂⟩, ‖V̂‖²], ‖∇W‖ and whether it is sound: every placement's last step, from the same
        terms on every rank; nothing without ``kl_clip``."""
        if self.clip is not None:
            torch._foreach_mul_(list(results), kl_scale(terms, norms, ok, *self.clip))


#: Each layer's result (not yet written back), the check and the successors of the states that advance (not yet
#: stored).
Applied = tuple[list[Tensor], Checked, dict[str, LayerState]]


class Placement(ABC):
    """The apply, the check and ``kl_clip`` of a step for one layout of states and gradients."""

    def __init__(self, stage: UpdateStage) -> None:
        self.stage = stage

    @abstractmethod
    def run(self, ready: Ready) -> Applied:
        """Each ready layer's result, the fallbacks and the successors of the states that advance."""

    def tensors(self) -> list[Tensor]:
        """Tensors the placement keeps between steps (counted by ``memory_breakdown``)."""
        return []
