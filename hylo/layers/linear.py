"""``nn.Linear``: every leading position of the input is a row (docs/solvers.md, "Notation")."""

from __future__ import annotations

from torch import Tensor

from hylo.layers.math import LayerMath, with_ones
from hylo.layers.rows import FactoredRows


class LinearMath(LayerMath):
    """``nn.Linear`` on inputs of shape (..., d_in): every leading position is a row."""

    def _rows(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        dtype = self.dtype
        a = x.reshape(-1, x.shape[-1]).to(dtype)
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        if self.bias is not None:
            a = with_ones(a)
        return a, g * scale

    def row_counts(self, x: Tensor, grad_out: Tensor) -> tuple[int, int]:
        """Every leading position is a row for both paths."""
        rows = x.numel() // x.shape[-1]
        return rows, rows

    def lowrank_rows(self, x: Tensor, grad_out: Tensor, scale: float) -> FactoredRows:
        """Rows a_i (bias 1 appended) and g_i = scale·∂L/∂s_i, one per leading position."""
        return FactoredRows(*self._rows(x, grad_out, scale))

    def row_work(self, rows: int, kfac_rows: int) -> float:
        """Nothing beyond a copy: the rows are the layer's inputs and output gradients."""
        return 0.0

    def kfac_factors(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Σ a aᵀ and Σ g gᵀ over rows (A, G are their means)."""
        a, g = self._rows(x, grad_out, scale)
        return a.mT @ a, g.mT @ g
