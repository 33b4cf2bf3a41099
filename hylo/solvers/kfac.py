"""K-FAC: (A ⊗ G + λI)⁻¹ vec ∇W through the eigendecompositions of the running factors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hylo.numerics import eigh_many


@dataclass
class KFACState:
    """Running Kronecker factors of one layer and their eigendecompositions.

    ``precondition`` computes V̂ = Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ, which is exactly
    (A ⊗ G + λI)⁻¹ vec ∇W for the stored A, G and the damping λ of the last update.
    """

    factor_a: Tensor
    factor_g: Tensor
    evals_a: Tensor
    evecs_a: Tensor
    evals_g: Tensor
    evecs_g: Tensor
    damping: float

    kind = "kfac"

    def precondition(self, grad: Tensor) -> Tensor:
        """Preconditioned (d_g, d_a) gradient."""
        g = grad.to(self.evecs_a.dtype)
        rotated = self.evecs_g.mT @ g @ self.evecs_a
        rotated.div_(torch.outer(self.evals_g, self.evals_a).add_(self.damping))
        return (self.evecs_g @ rotated @ self.evecs_a.mT).to(grad.dtype)

    def nbytes(self) -> int:
        """Bytes held by this state."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, Tensor]:
        """The tensors of this state by name."""
        return {
            "factor_a": self.factor_a,
            "factor_g": self.factor_g,
            "evals_a": self.evals_a,
            "evecs_a": self.evecs_a,
            "evals_g": self.evals_g,
            "evecs_g": self.evecs_g,
        }


def blend_factors(
    previous: tuple[Tensor, Tensor] | None, batch: tuple[Tensor, Tensor], decay: float
) -> tuple[Tensor, Tensor]:
    """Running averages A ← β A + (1 − β) A_batch (same for G); the first update takes the batch."""
    if previous is None:
        return batch
    return (
        decay * previous[0] + (1.0 - decay) * batch[0],
        decay * previous[1] + (1.0 - decay) * batch[1],
    )


def kfac_update_many(factors: Sequence[tuple[Tensor, Tensor]], damping: float) -> list[KFACState]:
    """K-FAC states of running factors (A, G): all eigendecompositions batched by shape."""
    decompositions = eigh_many([m for pair in factors for m in pair])
    states = []
    for i, (fa, fg) in enumerate(factors):
        (ea, qa), (eg, qg) = decompositions[2 * i], decompositions[2 * i + 1]
        states.append(KFACState(fa, fg, ea, qa, eg, qg, damping))
    return states
