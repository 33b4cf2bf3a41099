"""The K-FAC family's group kernels (docs/design.md, "The apply plan"): the eigen method's and the inverse method's
apply for a group of equal layers, from their states' tensors stacked once."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hylo.layers.gradmatrix import GradShard
from hylo.solvers.base import LayerState
from hylo.solvers.blockdiag import layout_for, left, rotated_in, rotated_out, times
from hylo.solvers.kernel import Exchange, GroupKernel, stacked, whole_from_rows


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

    def shard_partial(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState]
    ) -> list[tuple[Exchange, Tensor]]:
        """This rank's part of ∇W Q_a: Q_gᵀ (∇W Q_a) mixes all rows, so a rank's rows of it are gathered; from a
        rank's columns of ∇W, ∇W Q_a is a sum over ranks (d_g·d_a numbers per layer either way). Blocked: ∇W
        gathered whole."""
        if self.layouts != (None, None):
            return super().shard_partial(grads, shard, states)
        if shard.axis == 0:
            return [(Exchange.ROWS, torch.bmm(grads, self.evecs_a).transpose(0, 1).contiguous())]
        return [(Exchange.SUM, torch.bmm(grads, self.evecs_a[:, shard.start : shard.stop]))]

    def shard_finish(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState], received: Sequence[Tensor]
    ) -> tuple[Tensor, list[LayerState]]:
        """This rank's rows (or columns) of Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ from the whole ∇W Q_a."""
        if self.layouts != (None, None):
            return super().shard_finish(grads, shard, states, received)
        projected = whole_from_rows(received[0], shard) if shard.axis == 0 else received[0]
        rotated = torch.bmm(self.evecs_g.mT, projected).div_(self.divisors)
        if shard.axis == 0:
            return torch.bmm(torch.bmm(self.evecs_g[:, shard.start : shard.stop], rotated), self.evecs_a.mT), list(
                states
            )
        return torch.bmm(torch.bmm(self.evecs_g, rotated), self.evecs_a[:, shard.start : shard.stop].mT), list(states)


class InverseKernel(GroupKernel):
    """Inverse-method states: the damped inverses (A + δ_a I)⁻¹ and (G + δ_g I)⁻¹ stacked once; V̂ in two batched
    products."""

    def __init__(self, inverse_a: Sequence[Tensor], inverse_g: Sequence[Tensor]) -> None:
        dtype = inverse_a[0].dtype
        self.inverse_a = stacked(inverse_a, dtype)
        self.inverse_g = stacked(inverse_g, dtype)

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """(G + δ_g I)⁻¹ ∇W (A + δ_a I)⁻¹ of every layer at once (block by block where blocked)."""
        if self.blocked:
            layout_a = layout_for(self.inverse_a, grads.shape[-1], batched=True)
            layout_g = layout_for(self.inverse_g, grads.shape[-2], batched=True)
            return left(self.inverse_g, times(grads, self.inverse_a, layout_a), layout_g), list(states)
        return torch.bmm(self.inverse_g, torch.bmm(grads, self.inverse_a)), list(states)

    @property
    def blocked(self) -> bool:
        """Whether a side holds packed blocks (docs/solvers.md, "Blocked factors")."""
        return self.inverse_a.dim() == 2 or self.inverse_g.dim() == 2

    def shard_partial(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState]
    ) -> list[tuple[Exchange, Tensor]]:
        """This rank's term of V̂ = Σ_ranks G⁻¹[:, rows] ∇W[rows] A⁻¹ (or G⁻¹ ∇W[:, cols] A⁻¹[cols]), summed over
        ranks (d_g·d_a numbers per layer). Blocked: ∇W gathered whole."""
        if self.blocked:
            return super().shard_partial(grads, shard, states)
        if shard.axis == 0:
            inverse_g = self.inverse_g[:, :, shard.start : shard.stop]
            return [(Exchange.SUM, torch.bmm(inverse_g, torch.bmm(grads, self.inverse_a)))]
        inverse_a = self.inverse_a[:, shard.start : shard.stop]
        return [(Exchange.SUM, torch.bmm(self.inverse_g, torch.bmm(grads, inverse_a)))]

    def shard_finish(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState], received: Sequence[Tensor]
    ) -> tuple[Tensor, list[LayerState]]:
        """This rank's rows (or columns) of the summed V̂."""
        if self.blocked:
            return super().shard_finish(grads, shard, states, received)
        if shard.axis == 0:
            return received[0][:, shard.start : shard.stop], list(states)
        return received[0][:, :, shard.start : shard.stop], list(states)
