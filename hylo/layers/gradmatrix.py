"""A layer's gradient ∇W (d_g × d_a) as its weight part and bias column, as the parameters keep them.

docs/design.md, "Memory": hylo's matrix W has the bias as its last column, but the parameters
keep weight and bias apart. A step copies both parts of every layer of a group into the group's
stacked (k, d_g, d_a) gradients at once (docs/design.md, "The apply plan"), and writes the results
back into the parts. A plain (d_g, d_a) tensor is a :class:`GradMatrix` without a bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class GradShard:
    """The part of ∇W one rank holds under FSDP2: rows (``axis`` 0) or columns (``axis`` 1) ``start:stop`` of
    ``total`` (docs/distributed.md, "FSDP2")."""

    start: int
    stop: int
    total: int
    axis: int = 0


@dataclass(frozen=True)
class GradMatrix:
    """∇W = [weight | bias]: ``weight`` (d_g, d_w) and ``bias`` (d_g,) or None (then d_a = d_w).

    With ``shard`` set, the parts are only those rows of ∇W (``weight`` (stop − start, d_w)), or those
    columns (``weight`` (d_g, stop − start), no bias).
    """

    weight: Tensor
    bias: Tensor | None = None
    shard: GradShard | None = None

    @classmethod
    def of(cls, grad: Tensor | GradMatrix) -> GradMatrix:
        """``grad`` itself, or a whole (d_g, d_a) matrix as a weight part without a bias."""
        return grad if isinstance(grad, GradMatrix) else cls(grad)

    @property
    def shape(self) -> tuple[int, int]:
        """(d_g, d_a); the rows or columns held, under FSDP2."""
        return int(self.weight.shape[0]), int(self.weight.shape[1]) + (0 if self.bias is None else 1)

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the gradient."""
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        """Device of the gradient."""
        return self.weight.device

    def _parts(self) -> list[Tensor]:
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    def to(self, dtype: torch.dtype) -> GradMatrix:
        """Both parts in ``dtype`` (no copy when they already are)."""
        return GradMatrix(self.weight.to(dtype), None if self.bias is None else self.bias.to(dtype), self.shard)

    def full(self) -> Tensor:
        """The concatenated (d_g, d_a) matrix (a copy when there is a bias; for the rare paths)."""
        if self.bias is None:
            return self.weight
        return torch.cat([self.weight, self.bias.unsqueeze(1)], dim=1)

    def all_finite(self) -> Tensor:
        """Whether every entry is finite (a 0-dim bool tensor, no host sync)."""
        return torch.stack([torch.isfinite(p).all() for p in self._parts()]).all()
