"""What the preconditioner holds for each registered layer: its math, hooks, solver, state and owner."""

from __future__ import annotations

from dataclasses import dataclass

from hylo.layers.capture import LayerCapture
from hylo.layers.math import LayerMath
from hylo.records import LayerInfo
from hylo.solvers import HeldState

#: ``owner`` of a layer whose carried statistics no rank has solved yet (recomputed at the next update).
UNSOLVED = -1


@dataclass
class RegisteredLayer:
    """One preconditioned layer: its math, its hooks, its solver and what it holds.

    ``solver`` is the configured solver until the first update, then the one the latest
    update used; ``owner`` is the rank that solved ``state`` (the one place it is kept).
    """

    name: str
    math: LayerMath
    capture: LayerCapture
    solver: str
    state: HeldState | None = None
    owner: int = 0

    def info(self) -> LayerInfo:
        """The layer as :meth:`hylo.HyLoPreconditioner.layer_info` reports it."""
        math = self.math
        return LayerInfo(
            self.name, math.module_type, math.d_a, math.d_g, math.bias is not None, self.solver, self.owner
        )
