"""The K-FAC family's group kernels (docs/design.md, "The apply plan"): the eigen method's and the inverse method's
apply for a group of equal layers, from their states' tensors stacked once."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hylo.solvers.base import GroupKernel, LayerState, stacked
from hylo.solvers.blockdiag import layout_for, left, rotated_in, rotated_out, times


class EigenKernel(GroupKernel):
    """Eigen-method states: Q_a, Q_g and the divisors e_g e_aᵀ + λ stacked once (each a (d, d) or (d_g, d_a) tensor
    per layer); V̂ in five batched products for the whole group."""

    def __init__(self, evecs_a: Sequence[Tensor], evecs_g: Sequence[Tensor], divisors: Sequence[Tensor]) -> None:
        dtype = evecs_a[0].dtype
        self.evecs_a = stacked(evecs_a, dtype)
        self.evecs_g = stacked(evecs_g, dtype)
        self.divisors = stacked(divisors, dtype)
        d_g, d_a = self.divisors.shape[-2:]
        #: (G's, A's) block layouts where a side is held as packed blocks (docs/solvers.md, "Blocked factors").
        self.layouts = (layout_for(self.evecs_g, d_g, batched=True), layout_for(self.evecs_a, d_a, batched=True))

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ of every layer at once (block by block where blocked)."""
        if self.layouts != (None, None):
            rotated = rotated_in(grads, self.evecs_g, self.evecs_a, self.layouts).div(self.divisors)
            return rotated_out(rotated, self.evecs_g, self.evecs_a, self.layouts), list(states)
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
        """(G + δ_g I)⁻¹ ∇W (A + δ_a I)⁻¹ of every layer at once (block by block where blocked)."""
        if self.inverse_a.dim() == 2 or self.inverse_g.dim() == 2:
            layout_a = layout_for(self.inverse_a, grads.shape[-1], batched=True)
            layout_g = layout_for(self.inverse_g, grads.shape[-2], batched=True)
            return left(self.inverse_g, times(grads, self.inverse_a, layout_a), layout_g), list(states)
        return torch.bmm(self.inverse_g, torch.bmm(grads, self.inverse_a)), list(states)
