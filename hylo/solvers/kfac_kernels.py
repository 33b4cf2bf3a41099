"""The K-FAC family's group kernels (docs/design.md, "The apply plan"): the eigen method's and the inverse method's
apply for a group of equal layers, from their states' tensors stacked once."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hylo.solvers.base import GroupKernel, LayerState, stacked


class EigenKernel(GroupKernel):
    """Eigen-method states: Q_a, Q_g and the divisors e_g e_aᵀ + λ stacked once (each a (d, d) or (d_g, d_a) tensor
    per layer); V̂ in five batched products for the whole group."""

    def __init__(self, evecs_a: Sequence[Tensor], evecs_g: Sequence[Tensor], divisors: Sequence[Tensor]) -> None:
        dtype = evecs_a[0].dtype
        self.evecs_a = stacked(evecs_a, dtype)
        self.evecs_g = stacked(evecs_g, dtype)
        self.divisors = stacked(divisors, dtype)

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ of every layer at once."""
        rotated = torch.bmm(self.evecs_g.mT, torch.bmm(grads, self.evecs_a)).div_(self.divisors)
        return torch.bmm(torch.bmm(self.evecs_g, rotated), self.evecs_a.mT), list(states)


class InverseKernel(GroupKernel):
    """Inverse-method states: the damped inverses (A + δ_a I)⁻¹ and (G + δ_g I)⁻¹ stacked once; V̂ in two batched
    products."""

    def __init__(self, inverse_a: Sequence[Tensor], inverse_g: Sequence[Tensor]) -> None:
        dtype = inverse_a[0].dtype
        self.inverse_a = stacked(inverse_a, dtype)
        self.inverse_g = stacked(inverse_g, dtype)

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """(G + δ_g I)⁻¹ ∇W (A + δ_a I)⁻¹ of every layer at once."""
        return torch.bmm(self.inverse_g, torch.bmm(grads, self.inverse_a)), list(states)
