"""A layer's gradient ∇W (d_g × d_a) as its weight part and bias column, never concatenated.

docs/design.md, "Memory": hylo's matrix W has the bias as its last column, but the parameters
keep weight and bias apart. Rather than copy both into one (d_g, d_a) matrix at every step,
the solvers read ∇W through the few products they need, each split into a weight part and a
bias part. A plain (d_g, d_a) tensor is a :class:`GradMatrix` without a bias.

The layer-by-layer check of a preconditioned result V̂ against its ∇W reads it the same way: :func:`result_terms`
(⟨∇W, V̂⟩ and ‖V̂‖², never concatenated) and :func:`checked_results`, which judges them by
:func:`hylo.numerics.sound_results` (docs/reliability.md, "Fallbacks").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hylo.numerics import result_scale, sound_results


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


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """⟨a, b⟩ in float64 of two equally shaped 2-D or 1-D tensors: one BLAS dot over their memory when they share
    a dense layout (no copy), else row-wise products summed in float64."""
    if a.dim() == 1:
        return torch.dot(a, b).to(torch.float64)
    if a.stride() == b.stride():
        for view in (a, a.mT):
            if view.is_contiguous():
                flip = view is not a
                return torch.dot(view.reshape(-1), (b.mT if flip else b).reshape(-1)).to(torch.float64)
    return torch.linalg.vecdot(a, b).sum(dtype=torch.float64)


#: On the CPU the check scales V̂ in chunks of rows of about this many bytes into one reused buffer, which
#: stays in a core's L2 cache for the two dots that read it (1.7× faster on a 1024×1024 float32 layer).
CHUNK_BYTES = 2**19


def _unit_sums(weight: Tensor, part: Tensor, scale: Tensor, measured: bool) -> list[Tensor]:
    """[⟨g, U⟩, ‖U‖²] (float32 or float64, several partial sums each) of ∇W's weight block ``weight`` and
    U = ``scale``·``part``, U written in ``weight``'s layout (whole, or in cache-sized chunks of rows)."""
    rows = weight.shape[0]
    step = rows
    if weight.device.type == "cpu" and weight.is_contiguous():
        step = max(1, CHUNK_BYTES // max(1, weight.shape[1] * weight.element_size()))
    buffer = torch.empty_like(weight[:step])  # ∇W's layout, so that one dot runs over both
    dots, squares = [], []
    for start in range(0, rows, step):
        g = weight[start : start + step]
        unit = buffer[: g.shape[0]]
        torch.mul(part[start : start + step], scale, out=unit)
        dots.append(_dot(g, unit))
        if measured:
            squares.append(_dot(unit, unit))
    return [torch.stack(dots).sum(), torch.stack(squares).sum() if measured else dots[0].new_zeros(())]


def result_terms(grad: GradMatrix, result: Tensor, norm: Tensor, damping: float | None) -> Tensor:
    """[⟨∇W, V̂⟩, ‖V̂‖²] in float64 for one layer's ∇W (or this rank's rows of it) and its preconditioned (d_g, d_a)
    ``result`` V̂, given the layer's ‖∇W‖ ``norm`` (float64, over every rank's rows) and the λ its system was
    damped with: sums over rows, so ranks holding rows of one ∇W add theirs up (docs/reliability.md,
    "Fallbacks"). Where there is no length bound to check (``damping`` None or 0) ‖V̂‖² is not measured (0)
    and ⟨∇W, V̂⟩ alone carries the finiteness.

    Only V̂ is scaled, by s = :func:`~hylo.numerics.result_scale`, into U = s·V̂ written in ∇W's layout (one
    pass); then ⟨∇W, U⟩ and ‖U‖² are BLAS dots in the working dtype, divided by s and s² in float64. For ‖∇W‖ ∈
    [10⁻¹⁸, 10⁸] a V̂ within its bound has ‖U‖ ≤ (1 + slack)/‖∇W‖ and ⟨∇W, U⟩ = ⟨∇W/‖∇W‖, λV̂/‖∇W‖⟩ ≤ 1 + slack,
    as if ∇W were normalised too; outside, ‖U‖ ≤ 10¹⁸ (1 + slack) and ⟨∇W, U⟩ ≤ max(1, ‖∇W‖/10⁸), so for a
    float32 gradient neither overflows (an overflow means V̂ broke its bound: it is refused as not finite) and
    near the bound nothing underflows (docs/solvers.md, "Numerics"). A finite ‖U‖² (or, without a bound,
    ⟨∇W, U⟩) means every entry is finite. Three passes over the layer, no reshape or float64 copy, no host sync.
    """
    if result.numel() == 0:  # a rank holding no rows of this layer
        return torch.zeros(2, dtype=torch.float64, device=result.device)
    scale = result_scale(norm, damping, result.dtype)
    measured = bool(damping)
    d_w = grad.weight.shape[1]
    sums = _unit_sums(grad.weight.to(result.dtype), result[:, :d_w], scale, measured)
    if grad.bias is not None:
        bias, unit = grad.bias.to(result.dtype), result[:, d_w] * scale
        sums += [_dot(bias, unit), _dot(unit, unit) if measured else torch.zeros_like(sums[1])]
    total = torch.stack(sums).reshape(-1, 2).sum(dim=0)
    s64 = scale.to(torch.float64)
    return torch.stack([total[0] / s64, total[1] / s64**2])


def checked_results(
    grads: Sequence[GradMatrix],
    results: Sequence[Tensor],
    norms: Sequence[Tensor],
    dampings: Sequence[float | None],
) -> tuple[list[Tensor], Tensor, Tensor]:
    """The layer-by-layer check (docs/reliability.md, "Fallbacks"): each layer's :func:`result_terms`,
    :func:`~hylo.numerics.sound_results` and the raw gradient where a result is not sound; the results (before
    ``kl_clip``), 1 per layer that fell back and the terms (float64 [⟨∇W, V̂⟩, ‖V̂‖²] per layer).
    The grouped step (:mod:`hylo.pipeline.apply`) runs the same check over stacked layers."""
    terms = torch.stack([result_terms(*item) for item in zip(grads, results, norms, dampings, strict=True)])
    norm_values = torch.stack(list(norms))
    ok = sound_results(terms, norm_values, dampings, [grad.weight.dtype for grad in grads])
    written = [grad.fill_where_not(ok[i], v) for i, (grad, v) in enumerate(zip(grads, results, strict=True))]
    return written, (~ok).long(), terms
