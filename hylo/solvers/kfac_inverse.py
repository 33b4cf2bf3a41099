"""K-FAC's inverse method: damped inverses of the running factors with factored damping (docs/solvers.md, "The
inverse method"), dense or in blocks (docs/solvers.md, "Blocked factors")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hylo.layers.blocks import BlockLayout
from hylo.layers.gradmatrix import GradMatrix
from hylo.solvers.base import LayerState, checked_tensors, positive_number
from hylo.solvers.blockdiag import diagonal
from hylo.solvers.kernel import applied_alone
from hylo.solvers.kfac_blocks import held_shapes
from hylo.solvers.kfac_kernels import InverseKernel


@dataclass
class KFACInverseState(LayerState):
    """Running Kronecker factors of one layer and their damped inverses (``kfac_method="inverse"``).

    Its apply (:class:`~hylo.solvers.kfac_kernels.InverseKernel`) computes V̂ = (G + δ_g I)⁻¹ ∇W (A + δ_a I)⁻¹ with δ_a δ_g = λ (:func:`split_damping`): the
    inverse of (A + δ_a I) ⊗ (G + δ_g I) = A ⊗ G + λI + δ_g A ⊗ I + δ_a I ⊗ G, a damping larger than λ's alone,
    in two products (docs/solvers.md, "The inverse method").
    """

    family: ClassVar[str] = "kfac"

    factor_a: Tensor
    factor_g: Tensor
    inverse_a: Tensor
    inverse_g: Tensor
    damping: float

    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """Preconditioned (d_g, d_a) gradient: the inverse kernel on a group of one."""
        return applied_alone(inverse_kernel([self]), self, grad, self.inverse_a.dtype)[0]

    @property
    def blocked(self) -> bool:
        """Whether a side holds packed blocks (docs/solvers.md, "Blocked factors")."""
        return self.inverse_a.dim() == 1 or self.inverse_g.dim() == 1

    def plan_parts(self) -> tuple[object, ...]:
        """The damped inverses and λ (a refresh, which replaces only the factors, keeps the group kernel)."""
        return (self.inverse_a, self.inverse_g, self.damping)

    def tensors(self) -> dict[str, Tensor]:
        """Factors and damped inverses by name."""
        return {
            "factor_a": self.factor_a,
            "factor_g": self.factor_g,
            "inverse_a": self.inverse_a,
            "inverse_g": self.inverse_g,
        }

    def carried(self) -> dict[str, Tensor]:
        """The running factors, which the next update blends with its batch factors."""
        return {"factor_a": self.factor_a, "factor_g": self.factor_g}

    @classmethod
    def from_dict(
        cls, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> KFACInverseState:
        """A state saved by ``to_dict``; ``ValueError`` naming the field unless every tensor has its shape and
        ``dtype`` and the damping is a finite number > 0 (docs/reliability.md, "Validation")."""
        if "divisor" in entry:
            raise ValueError("state_dict entry holds a divisor, which a K-FAC state has none of")
        damping = positive_number(entry, "damping")
        dense = {"factor_a": (d_a, d_a), "factor_g": (d_g, d_g), "inverse_a": (d_a, d_a), "inverse_g": (d_g, d_g)}
        shapes = held_shapes(entry.get("tensors"), d_a, d_g, dense)
        t = checked_tensors(entry.get("tensors"), shapes, dict.fromkeys(shapes, dtype), device)
        return cls(t["factor_a"], t["factor_g"], t["inverse_a"], t["inverse_g"], damping)


def inverse_kernel(states: Sequence[KFACInverseState]) -> InverseKernel:
    """The inverse method's kernel of ``states``: the damped inverses stacked."""
    return InverseKernel([s.inverse_a for s in states], [s.inverse_g for s in states])


def split_damping(
    factor_a: Tensor, factor_g: Tensor, damping: float, layouts: Sequence[BlockLayout | None] = (None, None)
) -> tuple[Tensor, Tensor]:
    """Factored Tikhonov damping (δ_a, δ_g) = (π√λ, √λ/π), π = sqrt((tr A / d_a) / (tr G / d_g)) (1 where a trace
    is not finite and > 0), so δ_a δ_g = λ: the shift of each factor in proportion to its mean eigenvalue (Martens
    & Grosse's π; docs/solvers.md, "The inverse method"). 0-dim float64 tensors, no host sync. A blocked side's
    trace is its blocks' (``layouts``: A's and G's; the one π of the whole layer, docs/solvers.md, "Blocked
    factors")."""
    diag_a, diag_g = diagonal(factor_a, layouts[0]), diagonal(factor_g, layouts[1])
    mean_a = diag_a.sum(dtype=torch.float64) / diag_a.shape[0]
    mean_g = diag_g.sum(dtype=torch.float64) / diag_g.shape[0]
    ratio = mean_a / mean_g
    usable = (mean_a > 0) & (mean_g > 0) & torch.isfinite(ratio) & (ratio > 0)
    pi = torch.where(usable, ratio, torch.ones_like(ratio)).sqrt()
    root = damping**0.5
    return pi * root, root / pi
