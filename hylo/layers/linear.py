"""``nn.Linear`` and a Linear stored transposed: every leading position of the input is a row
(docs/solvers.md, "Notation")."""

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
        """Every leading position is a row for both paths; ``ValueError`` when the input and the output gradient
        have different leading positions (the call was not this Linear applied to its first argument)."""
        rows = x.numel() // x.shape[-1]
        if grad_out.numel() // max(grad_out.shape[-1], 1) != rows:
            raise ValueError(
                f"layer {self.name!r}: a call's input has shape {tuple(x.shape)} and its output "
                f"{tuple(grad_out.shape)}: not one output row per input row, so the call was not the layer "
                "applied to its first argument"
            )
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
        return self.gram(a), self.gram(g)

    def sampled_call(self, x: Tensor, grad_out: Tensor, stride: int, offset: int) -> tuple[Tensor, Tensor] | None:
        """The rows (leading positions, across all sequences of the batch) ≡ ``offset`` (mod ``stride``): strided
        views; None with fewer rows than ``stride``."""
        a = x.reshape(-1, x.shape[-1])
        if a.shape[0] < stride:
            return None
        return a[offset::stride], grad_out.reshape(-1, grad_out.shape[-1])[offset::stride]


class TransposedLinearMath(LinearMath):
    """A Linear whose ``weight`` is stored as (d_in, d_out), y = x·weight + bias (Hugging Face's ``Conv1D``).

    hylo's W is ``weight``ᵀ, a view: ∇W is read from, and the result written into, a transposed
    view of ``weight.grad``. Rows and factors are a Linear's (docs/extending.md, "Layers of other
    packages").
    """

    def _stored(self) -> Tensor:
        """The module's weight as stored, (d_in, d_out) (read on every access: replacing the Parameter is followed)."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight

    @property
    def weight(self) -> Tensor:
        """hylo's W (d_out × d_in): the stored weight transposed (a view)."""
        return self._stored().mT

    def grad_tensor(self) -> Tensor | None:
        """The parameter's own ``.grad``: its identity and version say a backward reached the layer."""
        return self._stored().grad

    def weight_grad(self) -> Tensor | None:
        """∇W as a transposed view of ``weight.grad`` (written in place)."""
        grad = self.grad_tensor()
        return None if grad is None else grad.mT
