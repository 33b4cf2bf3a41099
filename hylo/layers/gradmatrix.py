"""A layer's gradient ∇W (d_g × d_a) as its weight part and bias column, never concatenated.

docs/design.md, "Memory": hylo's matrix W has the bias as its last column, but the parameters
keep weight and bias apart. Rather than copy both into one (d_g, d_a) matrix at every step,
the solvers read ∇W through the few products they need, each split into a weight part and a
bias part. A plain (d_g, d_a) tensor is a :class:`GradMatrix` without a bias.
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

    def norm(self, dtype: torch.dtype) -> Tensor:
        """‖∇W‖_F computed in ``dtype``."""
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.to(dtype)) for p in self._parts()]))

    def all_finite(self) -> Tensor:
        """Whether every entry is finite (a 0-dim bool tensor, no host sync)."""
        return torch.stack([torch.isfinite(p).all() for p in self._parts()]).all()

    def dot(self, other: Tensor) -> Tensor:
        """⟨∇W, other⟩ for a (d_g, d_a) ``other``, in float64."""
        d_w = self.weight.shape[1]
        total = (other[:, :d_w] * self.weight).sum().to(torch.float64)
        if self.bias is not None:
            total = total + (other[:, d_w] * self.bias).sum().to(torch.float64)
        return total

    def times(self, right: Tensor) -> Tensor:
        """∇W @ ``right`` for a (d_a, k) matrix: W_w @ right[:d_w] plus the bias's rank-one term."""
        d_w = self.weight.shape[1]
        product = self.weight @ right[:d_w]
        if self.bias is not None:  # a k = 1 matrix product: addr_ runs ~1000x slower on 2 busy CPU threads
            product.addmm_(self.bias.unsqueeze(1), right[d_w : d_w + 1])
        return product

    def row_products(self, g: Tensor, a: Tensor) -> Tensor:
        """g_iᵀ ∇W a_i for the rows of ``g`` (m, d_g) and ``a`` (m, d_a)."""
        d_w = self.weight.shape[1]
        products = ((g @ self.weight) * a[:, :d_w]).sum(dim=1)
        if self.bias is not None:
            products = products + (g @ self.bias) * a[:, d_w]
        return products

    def add_to(self, out: Tensor, alpha: float) -> Tensor:
        """``out`` + alpha·∇W, written into ``out`` (d_g, d_a)."""
        d_w = self.weight.shape[1]
        out[:, :d_w].add_(self.weight, alpha=alpha)
        if self.bias is not None:
            out[:, d_w].add_(self.bias, alpha=alpha)
        return out

    def fill_where_not(self, ok: Tensor, out: Tensor) -> Tensor:
        """``out`` where ``ok`` (a 0-dim bool tensor), else ∇W: written into ``out``, no host sync."""
        d_w = self.weight.shape[1]
        weight_part = out[:, :d_w]
        torch.where(ok, weight_part, self.weight.to(out.dtype), out=weight_part)
        if self.bias is not None:
            bias_part = out[:, d_w]
            torch.where(ok, bias_part, self.bias.to(out.dtype), out=bias_part)
        return out
