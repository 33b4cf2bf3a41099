"""``nn.Conv2d`` and ``nn.Conv1d`` with groups == 1: KFC factors and per-sample rows (docs/solvers.md, "Convolutions")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo.layers.math import LayerMath, with_ones
from hylo.layers.rows import DenseRows, FactoredRows, SampleRows

#: How a convolution's per-sample gradients become low-rank rows (docs/solvers.md, "Convolutions").
ConvRows = Literal["sum", "exact", "mean"]
CONV_ROWS: tuple[ConvRows, ...] = get_args(ConvRows)
#: The exponent e of a convolution's KFC factors L^e·E_p[a aᵀ] ⊗ E_p[g gᵀ], chosen by measurement
#: against the true per-sample Fisher (docs/solvers.md, "K-FAC conventions").
DEFAULT_KFC_EXPONENT = 1.0
#: The default cap on a convolution's unfolded patches in flight at once (docs/design.md, "Memory").
DEFAULT_MAX_UNFOLD_MB = 32.0


def plane(values: tuple[int, ...]) -> tuple[int, int]:
    """A 1-D convolution's (k,) geometry as the 2-D one of a unit-height image, (1, k); 2-D as it is."""
    return (1, values[0]) if len(values) == 1 else (values[0], values[1])


class ConvMath(LayerMath):
    """``nn.Conv2d`` and ``nn.Conv1d`` with groups == 1 (stride, dilation, any padding and padding mode).

    A Conv1d is the Conv2d of a unit-height image (kernel (1, k)): every method below works on
    2-D images, and 1-D inputs (N, C, L) are seen as (N, C, 1, L).

    K-FAC uses the KFC factors (docs/solvers.md, "K-FAC conventions"): A = mean over samples and
    output positions of the unfolded patches' outer product; G = L^e × the mean over samples and
    positions of g gᵀ (g = n·∂L/∂s per position, L output positions, e = ``kfc_exponent``), so
    the Fisher block is approximated by L^e·E_p[a aᵀ] ⊗ E_p[g gᵀ]. e = 1 is Grosse & Martens'
    KFC (derivatives uncorrelated across positions), e = 2 fully correlated derivatives.

    The low-rank rows approximate the true per-sample gradient U_i = Σ_p g_ip a_ipᵀ over the
    L output positions p (docs/solvers.md, "Convolutions"), by ``rows``:

    - ``"sum"``: U_i ≈ (Σ_p g_ip)(mean_p a_ip)ᵀ — rank one, the right scale (the default);
    - ``"exact"``: U_i itself (:class:`DenseRows`; n·d_a·d_g numbers, one batched matmul);
    - ``"mean"``: HyLo's surrogate (mean_p g_ip)(mean_p a_ip)ᵀ, L times too small.

    A 1×1 kernel on a 1×1 image reduces to Linear in every mode and at every exponent.
    Subclasses see another layer as a convolution of a prepared input (:meth:`_padded`) with
    the geometry of :attr:`kernel_size`, :attr:`stride` and :attr:`dilation`
    (:class:`~hylo.layers.conv_transpose.ConvTransposeMath`).
    """

    def __init__(
        self,
        module: nn.Conv1d | nn.Conv2d | nn.ConvTranspose1d | nn.ConvTranspose2d,
        rows: ConvRows = "sum",
        kfc_exponent: float = DEFAULT_KFC_EXPONENT,
        max_unfold_mb: float = DEFAULT_MAX_UNFOLD_MB,
    ) -> None:
        super().__init__(module)
        self.conv = module
        self.rows = rows
        self.rows_form = rows
        self.dense_rows = rows == "exact"
        self.kfc_exponent = kfc_exponent
        self.max_unfold_mb = max_unfold_mb
        #: The module's spatial dimensions (1 or 2).
        self.spatial = len(module.kernel_size)
        #: The geometry of the 2-D convolution whose patches are unfolded.
        self.kernel_size = plane(module.kernel_size)
        self.stride = plane(module.stride)
        self.dilation = plane(module.dilation)

    #: Whether the patch sums of the surrogate rows may read the unpadded input (:meth:`_position_sums`); a subclass
    #: whose :meth:`_padded` input is more than the padding (a transposed convolution's zeros) sets it False.
    sums_from_input: ClassVar[bool] = True

    def _pads(self) -> list[tuple[int, int]]:
        """The module's padding (before, after) along H and W (H: none for a 1-D convolution)."""
        conv = self.conv
        if isinstance(conv.padding, str):
            if conv.padding == "valid":
                pads = [(0, 0)] * self.spatial
            else:  # "same": PyTorch puts the extra element on the right/bottom
                pads = []
                for k, d in zip(conv.kernel_size, conv.dilation, strict=True):
                    total = d * (k - 1)
                    pads.append((total // 2, total - total // 2))
        else:
            pads = [(p, p) for p in conv.padding]
        return [(0, 0)] * (2 - self.spatial) + pads

    def _padded(self, x: Tensor, out_hw: tuple[int, int]) -> Tensor:
        """The input the convolution reads, (N, C, H, W): ``x`` with the module's padding."""
        conv = self.conv
        pads = self._pads()
        flat = [pads[1][0], pads[1][1], pads[0][0], pads[0][1]]
        if not any(flat):
            return x
        if conv.padding_mode == "zeros":
            return F.pad(x, flat)
        return F.pad(x, flat, mode=conv.padding_mode)

    def _batched(self, x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        """Input and output gradient as (N, C, H, W): an unbatched call is a batch of one, a 1-D one has H = 1."""
        if x.dim() == self.spatial + 1:
            x, grad_out = x.unsqueeze(0), grad_out.unsqueeze(0)
        if self.spatial == 1:
            x, grad_out = x.unsqueeze(2), grad_out.unsqueeze(2)
        return x, grad_out

    def row_counts(self, x: Tensor, grad_out: Tensor) -> tuple[int, int]:
        """Samples for the low-rank path; samples × output positions for K-FAC."""
        x, grad_out = self._batched(x, grad_out)
        return x.shape[0], x.shape[0] * grad_out.shape[2] * grad_out.shape[3]

    def _blocks(self, x: Tensor, out_hw: tuple[int, int]) -> Iterator[tuple[slice, slice, Tensor]]:
        """(samples, output rows, the padded input rows they read) in blocks whose patches fit ``max_unfold_mb``.

        A block's unfolded patches are ns·(r1 − r0)·W_out·d_a numbers: a block holds whole
        samples when one sample's patches fit, else one sample and as many output rows as fit
        (at least one). Each block pads only its own samples, in the working dtype.
        """
        (kh, _), (sh, _), (dh, _) = self.kernel_size, self.stride, self.dilation
        n, (ho, wo) = x.shape[0], out_hw
        cap = self.max_unfold_mb * 2**20
        row_bytes = wo * self.d_a * self.dtype.itemsize
        out_rows = max(1, min(ho, int(cap // row_bytes)))
        samples = max(1, min(n, int(cap // (row_bytes * ho)))) if out_rows == ho else 1
        for s0 in range(0, n, samples):
            padded = self._padded(x[s0 : s0 + samples].to(self.dtype), out_hw)
            for r0 in range(0, ho, out_rows):
                r1 = min(ho, r0 + out_rows)
                block = padded[:, :, r0 * sh : (r1 - 1) * sh + dh * (kh - 1) + 1]
                yield slice(s0, s0 + samples), slice(r0, r1), block

    def _unfold(self, block: Tensor) -> Tensor:
        """A block's patches (ns, L_block, C·kh·kw), without the bias column."""
        return F.unfold(block, self.kernel_size, dilation=self.dilation, stride=self.stride).transpose(1, 2)

    def _patch_sum(self, block: Tensor, out_hw: tuple[int, int]) -> Tensor:
        """Sum over a block's output positions of each patch entry (ns, C·kh·kw), without unfolding."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        ho, wo = out_hw
        sums = [
            block[:, :, i * dh : i * dh + sh * (ho - 1) + 1 : sh, j * dw : j * dw + sw * (wo - 1) + 1 : sw].sum(
                dim=(2, 3)
            )
            for i in range(kh)
            for j in range(kw)
        ]
        return torch.stack(sums, dim=-1).reshape(block.shape[0], -1)

    def _position_sums(self, x: Tensor, out_hw: tuple[int, int]) -> Tensor:
        """Sum over the output positions of each patch entry (n, C·kh·kw) under zero padding, from the unpadded input:
        each kernel offset's window clipped to the input (the padding adds zeros), summed along W for each of the kw
        column offsets, then along H for each of the kh row offsets: about one pass over the input at stride 1 (a
        window is the row's total less the few entries it leaves out), kw strided ones otherwise, against kh·kw
        strided passes over a padded copy (docs/design.md, "Memory")."""
        pads = self._pads()
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        n, c, height, width = x.shape
        rows_total = x.sum(dim=3)
        by_column = torch.stack(
            [_window_sum(x, 3, j * dw - pads[1][0], sw, out_hw[1], rows_total) for j in range(kw)], dim=-1
        )  # (n, C, H, kw)
        columns_total = by_column.sum(dim=2)
        sums = torch.stack(
            [_window_sum(by_column, 2, i * dh - pads[0][0], sh, out_hw[0], columns_total) for i in range(kh)], dim=-2
        )  # (n, C, kh, kw)
        return sums.reshape(n, c * kh * kw)

    def lowrank_rows(self, x: Tensor, grad_out: Tensor, scale: float) -> SampleRows:
        """Per-sample rows in the configured mode (see the class docstring), g scaled by ``scale``.

        Built block by block (:meth:`_blocks`): exact rows accumulate Σ_p g_ip a_ipᵀ over the
        blocks' patches; the surrogates' patch means never unfold.
        """
        x, grad_out = self._batched(x, grad_out)
        dtype, (ho, wo) = self.dtype, (grad_out.shape[2], grad_out.shape[3])
        n, columns = x.shape[0], self.d_a - (1 if self.bias is not None else 0)
        if self.rows == "exact":
            u = torch.zeros(n, self.d_g, self.d_a, dtype=dtype, device=x.device)
            for samples, out_rows, block in self._blocks(x, (ho, wo)):
                g = grad_out[samples, :, out_rows].to(dtype).flatten(2) * scale  # (ns, d_g, L_block)
                u[samples, :, :columns] += torch.bmm(g, self._unfold(block))
                if self.bias is not None:
                    u[samples, :, columns] += g.sum(dim=2)
            return DenseRows(u)
        if self.sums_from_input and self.conv.padding_mode == "zeros":
            a = self._position_sums(x.to(dtype), (ho, wo))
        else:
            a = torch.zeros(n, columns, dtype=dtype, device=x.device)
            for samples, out_rows, block in self._blocks(x, (ho, wo)):
                a[samples] += self._patch_sum(block, (out_rows.stop - out_rows.start, wo))
        a /= ho * wo
        if self.bias is not None:
            a = with_ones(a)
        reduce_positions = torch.sum if self.rows == "sum" else torch.mean
        g = reduce_positions(grad_out.to(dtype), dim=(2, 3)) * scale
        return FactoredRows(a, g)

    def row_work(self, rows: int, kfac_rows: int) -> float:
        """Exact: the per-sample products n·L·d_a·d_g; surrogates: one pass over the patches."""
        if self.rows == "exact":
            return float(kfac_rows) * self.d_a * self.d_g
        return float(kfac_rows) * (self.d_a + self.d_g)

    def kfac_factors(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Σ over samples and positions of patch outer products, and L^(e−1) × that of g gᵀ (g = scale·∂L/∂s).

        Divided by n·L and by n (:class:`LayerBatch`), they are E_p[a aᵀ] and L^e·E_p[g gᵀ]. Both
        sums run block by block (:meth:`_blocks`), so at most ``max_unfold_mb`` of patches (and
        the matching output gradients) are in flight; the bias column's entries come from the
        patch sums, never from a widened copy of the patches.
        """
        x, grad_out = self._batched(x, grad_out)
        dtype, (ho, wo) = self.dtype, (grad_out.shape[2], grad_out.shape[3])
        columns = self.d_a - (1 if self.bias is not None else 0)
        factor_a = torch.zeros(self.d_a, self.d_a, dtype=dtype, device=x.device)
        factor_g = torch.zeros(self.d_g, self.d_g, dtype=dtype, device=x.device)
        for samples, out_rows, block in self._blocks(x, (ho, wo)):
            patches = self._unfold(block).reshape(-1, columns)
            g = grad_out[samples, :, out_rows].to(dtype).transpose(0, 1).reshape(self.d_g, -1) * scale
            if self.factor_dtype is None:
                factor_a[:columns, :columns].addmm_(patches.mT, patches)
                factor_g.addmm_(g, g.mT)
            else:  # the products in factor_dtype (docs/solvers.md, "Low-precision statistics")
                factor_a[:columns, :columns] += self.gram(patches)
                factor_g += self.gram(g.mT)
            if self.bias is not None:
                sums = patches.sum(dim=0)
                factor_a[:columns, columns] += sums
                factor_a[columns, :columns] += sums
                factor_a[columns, columns] += patches.shape[0]
        if self.kfc_exponent != 1.0:
            factor_g *= float(ho * wo) ** (self.kfc_exponent - 1.0)
        return factor_a, factor_g

    def sampled_call(self, x: Tensor, grad_out: Tensor, stride: int, offset: int) -> tuple[Tensor, Tensor] | None:
        """The samples (images, with all their positions) ≡ ``offset`` (mod ``stride``) of a batched call (strided
        views); None for an unbatched call or one with fewer samples than ``stride``."""
        if x.dim() != self.spatial + 2 or x.shape[0] < stride:
            return None
        return x[offset::stride], grad_out[offset::stride]

    def exact_rows_math(self) -> ConvMath | None:
        """The same convolution with ``rows="exact"`` (None when its rows already are)."""
        if self.dense_rows:
            return None
        exact = type(self)(self.conv, "exact", self.kfc_exponent, self.max_unfold_mb)
        exact.name = self.name
        return exact

    def kaisa_ratio(self, rows: int, kfac_rows: int) -> float:
        """c = n²·L^(4+e): KAISA divides patches and raw output gradients by L before its position means."""
        positions = kfac_rows / rows
        return float(rows) ** 2 * positions ** (4.0 + self.kfc_exponent)


def _window_sum(x: Tensor, dim: int, first: int, step: int, count: int, total: Tensor) -> Tensor:
    """Σ_t x[..., first + step·t, ...] along ``dim`` over t < ``count``, the indices outside ``x`` counting as 0;
    ``total`` is x summed along ``dim``: a contiguous window (``step`` 1) covering most of the axis is ``total``
    less the few indices it leaves out."""
    size = x.shape[dim]
    t0 = max(0, -(first // step)) if first < 0 else 0
    t1 = min(count - 1, (size - 1 - first) // step)
    if t1 < t0:
        return torch.zeros_like(total)
    start, stop = first + step * t0, first + step * t1 + 1
    if step == 1 and 2 * (start + size - stop) < stop - start:
        return total - x.narrow(dim, 0, start).sum(dim=dim) - x.narrow(dim, stop, size - stop).sum(dim=dim)
    return x.narrow(dim, start, stop - start)[(slice(None),) * dim + (slice(None, None, step),)].sum(dim=dim)
