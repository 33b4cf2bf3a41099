"""Per-module-type math: how a layer's inputs and output gradients become rows and factors.

Notation (docs/design.md, "Notation"): a layer has weight W of shape (d_g, d_a); with a bias, the bias
is W's last column and every activation row gets a trailing 1. An embedding is a Linear on
one-hot inputs: W is its weight transposed (see :class:`EmbeddingMath`). From a mean-reduced loss over
n rows, ``g_i = n · ∂L/∂s_i`` so that ∇W = (1/n) Σ g_i a_iᵀ. When a layer runs several times
in one step (gradient accumulation, shared weights) n is the step's total, passed in as
``scale`` by the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hylo.gradmatrix import GradMatrix
from hylo.numerics import working_dtype
from hylo.rows import DenseRows, FactoredRows, SampleRows, concat_rows

#: How a convolution's per-sample gradients become low-rank rows (docs/design.md, "Convolutions").
ConvRows = Literal["sum", "exact", "mean"]
CONV_ROWS: tuple[ConvRows, ...] = get_args(ConvRows)
#: What damping λ is measured against (docs/design.md, "K-FAC conventions"): hylo's Fisher of
#: g = n·∂L/∂s, or KAISA's factors of the raw output gradients (convolutions: both divided by L).
DampingConvention = Literal["hylo", "kaisa"]
DAMPING_CONVENTIONS: tuple[DampingConvention, ...] = get_args(DampingConvention)
#: The exponent e of a convolution's KFC factors L^e·E_p[a aᵀ] ⊗ E_p[g gᵀ], chosen by measurement
#: against the true per-sample Fisher (docs/design.md, "K-FAC conventions").
DEFAULT_KFC_EXPONENT = 1.0
#: The default cap on a convolution's unfolded patches in flight at once (docs/design.md, "Memory").
DEFAULT_MAX_UNFOLD_MB = 32.0


def _with_ones(a: Tensor) -> Tensor:
    return torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)


class LayerMath(ABC):
    """Shapes, rows, Kronecker factors and gradient access of one supported module."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        #: The layer's name in messages (the registry sets the module's name in the model).
        self.name = type(module).__name__
        weight, bias = self.weight, self.bias
        self._shapes = (tuple(weight.shape), None if bias is None else tuple(bias.shape))
        self.d_g = int(weight.shape[0])
        self.d_a = int(weight[0].numel()) + (1 if bias is not None else 0)

    @property
    def weight(self) -> Tensor:
        """The module's current weight (read on every access: replacing the Parameter is followed)."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight

    @property
    def bias(self) -> Tensor | None:
        """The module's current bias, or None (also for modules without a ``bias`` attribute)."""
        bias = getattr(self.module, "bias", None)
        return bias if isinstance(bias, Tensor) else None

    def _check_shapes(self) -> None:
        """Raise ``ValueError`` if the weight or bias no longer has its shape at registration."""
        bias = self.bias
        now = (tuple(self.weight.shape), None if bias is None else tuple(bias.shape))
        if now != self._shapes:
            raise ValueError(
                f"layer {self.name!r}: weight/bias shapes are now {now[0]}/{now[1]}, registered as "
                f"{self._shapes[0]}/{self._shapes[1]}; hylo's factor sizes are fixed at registration: "
                "create a new HyLoPreconditioner after changing a layer's shape"
            )

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of factor and kernel math for this layer (float32 at least)."""
        return working_dtype(self.weight.dtype)

    @abstractmethod
    def row_counts(self, x: Tensor, grad_out: Tensor) -> tuple[int, int]:
        """Rows of the low-rank path (samples) and of the K-FAC factors (incl. positions)."""

    #: Whether the low-rank rows are whole per-sample gradient matrices (:class:`DenseRows`).
    dense_rows: bool = False

    @abstractmethod
    def lowrank_rows(self, x: Tensor, grad_out: Tensor, scale: float) -> SampleRows:
        """Per-sample gradients of one call (output gradients scaled by ``scale``) for the SMW solvers."""

    @abstractmethod
    def row_work(self, rows: int, kfac_rows: int) -> float:
        """Multiply-adds to build the low-rank rows of ``rows`` samples (``kfac_rows`` positions)."""

    @abstractmethod
    def kfac_factors(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Unnormalised Kronecker factors Σ a aᵀ (d_a×d_a) and Σ g gᵀ (d_g×d_g), g scaled by ``scale``.

        Divide the first by the K-FAC row count and the second by the sample count (see
        :meth:`row_counts`) summed over the step's calls.
        """

    def kaisa_ratio(self, rows: int, kfac_rows: int) -> float:
        """c = hylo's Fisher over KAISA's on this layer: n², KAISA's G being of the raw ∂L/∂s = g/n."""
        return float(rows) ** 2

    def capture_call(self, x: Tensor, grad_out: Tensor, plan: Reduction | None) -> CapturedCall:
        """One call as the update needs it: reduced per ``plan`` when that takes fewer bytes than its
        input and output gradient, else kept raw (docs/design.md, "Memory").

        The rule keeps a Linear's low-rank calls raw (its rows are its input and output gradient)
        and reduces a convolution's (its rows and factors are far smaller than its feature maps),
        except where a K-FAC factor (d_a² numbers) outweighs a small batch's feature maps.
        """
        rows, kfac_rows = self.row_counts(x, grad_out)
        numbers = 0
        if plan is not None:
            numbers += rows * (self.d_a * self.d_g if self.dense_rows else self.d_a + self.d_g) if plan.lowrank else 0
            numbers += self.d_a**2 + self.d_g**2 if plan.kfac else 0
        raw_bytes = x.numel() * x.element_size() + grad_out.numel() * grad_out.element_size()
        if plan is None or numbers * self.dtype.itemsize >= raw_bytes:
            return CapturedCall(rows, kfac_rows, raw=(x, grad_out))
        return CapturedCall(
            rows,
            kfac_rows,
            lowrank=self.lowrank_rows(x, grad_out, plan.scale) if plan.lowrank else None,
            factors=self.kfac_factors(x, grad_out, plan.scale) if plan.kfac else None,
            scale=plan.scale,
        )

    @property
    def module_type(self) -> str:
        """The layer's kind in summaries: the module's class name."""
        return type(self.module).__name__

    def grad_tensor(self) -> Tensor | None:
        """The ``.grad`` whose identity and version tell that a backward reached the layer."""
        return self.weight.grad

    def _weight_grad(self) -> Tensor | None:
        """The weight's gradient (written in place), or None."""
        return self.weight.grad

    def _bias_grad(self) -> Tensor | None:
        """The bias's gradient (written in place), or None."""
        bias = self.bias
        return None if bias is None else bias.grad

    def grad_parts(self) -> GradMatrix | None:
        """∇W as views of the weight's and bias's gradients (docs/design.md, "Memory"), or None before backward."""
        self._check_shapes()
        weight_grad, bias = self._weight_grad(), self.bias
        if weight_grad is None:
            return None
        bias_grad = None
        if bias is not None:
            bias_grad = self._bias_grad()
            if bias_grad is None:
                bias_grad = torch.zeros_like(bias)
        return GradMatrix(weight_grad.reshape(self.d_g, -1), None if bias_grad is None else bias_grad.reshape(-1))

    def grad_matrix(self) -> Tensor | None:
        """∇W as one (d_g, d_a) matrix, bias last (a copy when there is a bias), or None before backward."""
        parts = self.grad_parts()
        return None if parts is None else parts.full()

    def set_grad_matrix(self, matrix: Tensor) -> None:
        """Write a (d_g, d_a) matrix back into the parameters' ``.grad`` in place."""
        self._check_shapes()
        weight_grad, bias_grad = self._weight_grad(), self._bias_grad()
        assert weight_grad is not None
        n_weight = self.d_a - (1 if self.bias is not None else 0)
        weight_grad.copy_(matrix[:, :n_weight].reshape(weight_grad.shape))
        if bias_grad is not None:
            bias_grad.copy_(matrix[:, n_weight].reshape(bias_grad.shape))


class LinearMath(LayerMath):
    """``nn.Linear`` on inputs of shape (..., d_in): every leading position is a row."""

    def _rows(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        dtype = self.dtype
        a = x.reshape(-1, x.shape[-1]).to(dtype)
        g = grad_out.reshape(-1, grad_out.shape[-1]).to(dtype)
        if self.bias is not None:
            a = _with_ones(a)
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


class Conv2dMath(LayerMath):
    """``nn.Conv2d`` with groups == 1 (stride, dilation, any padding and padding mode).

    K-FAC uses the KFC factors (docs/design.md, "K-FAC conventions"): A = mean over samples and
    output positions of the unfolded patches' outer product; G = L^e × the mean over samples and
    positions of g gᵀ (g = n·∂L/∂s per position, L output positions, e = ``kfc_exponent``), so
    the Fisher block is approximated by L^e·E_p[a aᵀ] ⊗ E_p[g gᵀ]. e = 1 is Grosse & Martens'
    KFC (derivatives uncorrelated across positions), e = 2 fully correlated derivatives.

    The low-rank rows approximate the true per-sample gradient U_i = Σ_p g_ip a_ipᵀ over the
    L output positions p (docs/design.md, "Convolutions"), by ``rows``:

    - ``"sum"``: U_i ≈ (Σ_p g_ip)(mean_p a_ip)ᵀ — rank one, the right scale (the default);
    - ``"exact"``: U_i itself (:class:`DenseRows`; n·d_a·d_g numbers, one batched matmul);
    - ``"mean"``: HyLo's surrogate (mean_p g_ip)(mean_p a_ip)ᵀ, L times too small.

    A 1×1 kernel on a 1×1 image reduces to Linear in every mode and at every exponent.
    """

    def __init__(
        self,
        module: nn.Conv2d,
        rows: ConvRows = "sum",
        kfc_exponent: float = DEFAULT_KFC_EXPONENT,
        max_unfold_mb: float = DEFAULT_MAX_UNFOLD_MB,
    ) -> None:
        super().__init__(module)
        self.conv = module
        self.rows = rows
        self.dense_rows = rows == "exact"
        self.kfc_exponent = kfc_exponent
        self.max_unfold_mb = max_unfold_mb

    def _padded(self, x: Tensor) -> Tensor:
        conv = self.conv
        if isinstance(conv.padding, str):
            if conv.padding == "valid":
                pads = [(0, 0), (0, 0)]
            else:  # "same": PyTorch puts the extra element on the right/bottom
                pads = []
                for k, d in zip(conv.kernel_size, conv.dilation, strict=True):
                    total = d * (k - 1)
                    pads.append((total // 2, total - total // 2))
        else:
            pads = [(p, p) for p in conv.padding]
        flat = [pads[1][0], pads[1][1], pads[0][0], pads[0][1]]
        if not any(flat):
            return x
        if conv.padding_mode == "zeros":
            return F.pad(x, flat)
        return F.pad(x, flat, mode=conv.padding_mode)

    @staticmethod
    def _batched(x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        """Unbatched (C, H, W) calls become a batch of one."""
        if x.dim() == 3:
            return x.unsqueeze(0), grad_out.unsqueeze(0)
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
        (kh, _), (sh, _), (dh, _) = self.conv.kernel_size, self.conv.stride, self.conv.dilation
        n, (ho, wo) = x.shape[0], out_hw
        cap = self.max_unfold_mb * 2**20
        row_bytes = wo * self.d_a * self.dtype.itemsize
        out_rows = max(1, min(ho, int(cap // row_bytes)))
        samples = max(1, min(n, int(cap // (row_bytes * ho)))) if out_rows == ho else 1
        for s0 in range(0, n, samples):
            padded = self._padded(x[s0 : s0 + samples].to(self.dtype))
            for r0 in range(0, ho, out_rows):
                r1 = min(ho, r0 + out_rows)
                block = padded[:, :, r0 * sh : (r1 - 1) * sh + dh * (kh - 1) + 1]
                yield slice(s0, s0 + samples), slice(r0, r1), block

    def _unfold(self, block: Tensor) -> Tensor:
        """A block's patches (ns, L_block, C·kh·kw), without the bias column."""
        conv = self.conv
        return F.unfold(block, conv.kernel_size, dilation=conv.dilation, stride=conv.stride).transpose(1, 2)

    def _patch_sum(self, block: Tensor, out_hw: tuple[int, int]) -> Tensor:
        """Sum over a block's output positions of each patch entry (ns, C·kh·kw), without unfolding."""
        (kh, kw), (sh, sw), (dh, dw) = self.conv.kernel_size, self.conv.stride, self.conv.dilation
        ho, wo = out_hw
        sums = [
            block[:, :, i * dh : i * dh + sh * (ho - 1) + 1 : sh, j * dw : j * dw + sw * (wo - 1) + 1 : sw].sum(
                dim=(2, 3)
            )
            for i in range(kh)
            for j in range(kw)
        ]
        return torch.stack(sums, dim=-1).reshape(block.shape[0], -1)

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
        a = torch.zeros(n, columns, dtype=dtype, device=x.device)
        for samples, out_rows, block in self._blocks(x, (ho, wo)):
            a[samples] += self._patch_sum(block, (out_rows.stop - out_rows.start, wo))
        a /= ho * wo
        if self.bias is not None:
            a = _with_ones(a)
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
            factor_a[:columns, :columns].addmm_(patches.mT, patches)
            g = grad_out[samples, :, out_rows].to(dtype).transpose(0, 1).reshape(self.d_g, -1) * scale
            factor_g.addmm_(g, g.mT)
            if self.bias is not None:
                sums = patches.sum(dim=0)
                factor_a[:columns, columns] += sums
                factor_a[columns, :columns] += sums
                factor_a[columns, columns] += patches.shape[0]
        if self.kfc_exponent != 1.0:
            factor_g *= float(ho * wo) ** (self.kfc_exponent - 1.0)
        return factor_a, factor_g

    def kaisa_ratio(self, rows: int, kfac_rows: int) -> float:
        """c = n²·L^(4+e): KAISA divides patches and raw output gradients by L before its position means."""
        positions = kfac_rows / rows
        return float(rows) ** 2 * positions ** (4.0 + self.kfc_exponent)


@dataclass(frozen=True)
class OneHotRows(FactoredRows):
    """Factored rows whose a_i are one-hot (zero for padding), with their token indices kept.

    The same rows as :class:`FactoredRows` (``fields``, the projection and the apply use ``a``),
    but the kernel's activation part a_iᵀ a_j is δ(t_i = t_j) from the indices, O(m²) instead
    of O(m²·V), and the row norms skip the one-hot matrix. Selection, rescaling and dtype
    changes keep the indices, so KID's local kernel and KIS's norms (docs/design.md, "KID",
    "KIS") run on them; after the all-gather the rows are plain :class:`FactoredRows`.
    """

    #: (m,) token of each row, −1 for a zero row (a padding token).
    tokens: Tensor

    def _present(self) -> Tensor:
        return self.tokens >= 0

    def kernel(self) -> Tensor:
        """δ(t_i = t_j) (G Gᵀ), zero on padding rows: the same numbers as (A Aᵀ) ∘ (G Gᵀ)."""
        return self.kernel_columns(torch.arange(self.count, device=self.tokens.device))

    def kernel_columns(self, index: Tensor) -> Tensor:
        """Columns ``index`` of the kernel: δ(t_i = t_j) (G G_Jᵀ), zero on padding rows."""
        chosen = self.tokens.index_select(0, index)
        same = (self.tokens.unsqueeze(1) == chosen.unsqueeze(0)) & self._present().unsqueeze(1)
        return same.to(self.g.dtype) * (self.g @ self.g.index_select(0, index).mT)

    def sq_norms(self) -> Tensor:
        """‖g_i‖², zero on padding rows."""
        return self.g.square().sum(dim=1) * self._present().to(self.g.dtype)

    def select(self, index: Tensor) -> OneHotRows:
        """The rows at ``index``."""
        return OneHotRows(
            self.a.index_select(0, index), self.g.index_select(0, index), self.tokens.index_select(0, index)
        )

    def scaled(self, factors: Tensor) -> OneHotRows:
        """g_i scaled (a_i kept), so U_i scales by ``factors_i``."""
        return OneHotRows(self.a, self.g * factors.to(self.g.dtype).unsqueeze(1), self.tokens)

    def to(self, dtype: torch.dtype) -> OneHotRows:
        """The rows in ``dtype`` (the indices unchanged)."""
        return OneHotRows(self.a.to(dtype), self.g.to(dtype), self.tokens)


class EmbeddingMath(LayerMath):
    """``nn.Embedding`` as a Linear on one-hot inputs (docs/design.md, "Embeddings").

    s_i = Eᵀ onehot(t_i) for the token t_i at every position of the index tensor (any shape:
    (B, T), (T,), ...), so hylo's matrix is W = ``weight``ᵀ of shape (d_g, d_a) =
    (``embedding_dim``, ``num_embeddings``), a_i = onehot(t_i) and g_i = n·∂L/∂s_i over the
    n token rows of the step, exactly as for a Linear applied over leading dimensions.

    - K-FAC: A = diag(token counts)/n, built with ``bincount`` in O(n) (no one-hot product);
      it is held as a dense V×V matrix because the K-FAC family stores and decomposes dense
      factors: V² numbers per factor and an O(V³) eigendecomposition, affordable for
      vocabularies of a few thousand, not for a 50k one (the cost model charges d_a³ = V³, so
      the hybrid policy keeps large vocabularies on the low-rank path).
    - Low-rank: one factored row per token with a_i the one-hot row (:class:`OneHotRows`), so
      the kernel's activation part a_iᵀ a_j is δ(t_i = t_j). The rows are built with one
      ``scatter`` into an n×V zero matrix: n·V numbers (8 MB for 2,048 tokens and V = 1,024 in
      float32; :meth:`row_work` charges them). The local kernel (KID) and row norms (KIS) use
      the indices: O(n·r·d_g) and O(n·d_g). After the all-gather the rows are plain factored
      rows, so the gathered kernel costs O(m²(V + d_g)) and the projection and apply
      O(m·V·d_g) a step, as for a Linear with d_a = V — fine for character/byte vocabularies;
      for V in the tens of thousands the n×V rows themselves are the limit.
    - ``padding_idx``: torch gives the padding row a zero gradient, so padding tokens are rows
      with a_i = 0 (they count in n, like any row of a Linear whose input is zero, but add
      nothing to A, to the kernel or to the preconditioned gradient, whose padding column
      stays exactly 0). Their output gradients enter G, as a Linear's would.

    ``sparse=True`` and ``scale_grad_by_freq=True`` are refused at registration
    (:func:`unsupported_reason`); ``max_norm`` is fine (it renormalises the weight in place,
    outside autograd). The indices are integers, so the working dtype is the weight's
    (float32 at least).
    """

    def __init__(self, module: nn.Embedding) -> None:
        super().__init__(module)
        self.embedding = module
        self.d_g = int(module.embedding_dim)
        self.d_a = int(module.num_embeddings)

    def _tokens(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Flat token indices and, with ``padding_idx``, which of them are not padding."""
        tokens = x.reshape(-1).to(torch.long)
        pad = self.embedding.padding_idx
        return tokens, None if pad is None else tokens != pad

    def row_counts(self, x: Tensor, grad_out: Tensor) -> tuple[int, int]:
        """Every token (every position of the index tensor, padding included) is a row for both paths."""
        rows = x.numel()
        return rows, rows

    def _g(self, grad_out: Tensor, scale: float) -> Tensor:
        return grad_out.reshape(-1, self.d_g).to(self.dtype) * scale

    def lowrank_rows(self, x: Tensor, grad_out: Tensor, scale: float) -> OneHotRows:
        """a_i = onehot(t_i) (zero for padding tokens), g_i = scale·∂L/∂s_i: an n×V one-hot matrix."""
        tokens, keep = self._tokens(x)
        dtype = self.dtype
        a = torch.zeros(tokens.shape[0], self.d_a, dtype=dtype, device=tokens.device)
        ones = a.new_ones(tokens.shape[0], 1) if keep is None else keep.to(dtype).unsqueeze(1)
        a.scatter_(1, tokens.unsqueeze(1), ones)
        marked = tokens if keep is None else torch.where(keep, tokens, -1)
        return OneHotRows(a, self._g(grad_out, scale), marked)

    def row_work(self, rows: int, kfac_rows: int) -> float:
        """The n×V one-hot matrix written (n·d_a numbers)."""
        return float(rows) * self.d_a

    def kfac_factors(self, x: Tensor, grad_out: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """Σ a aᵀ = diag(counts of each token, padding excluded) by ``bincount``; Σ g gᵀ over every token."""
        tokens, keep = self._tokens(x)
        dtype = self.dtype
        if keep is None:
            counts = torch.bincount(tokens, minlength=self.d_a).to(dtype)
        else:
            counts = torch.bincount(tokens, weights=keep.to(dtype), minlength=self.d_a).to(dtype)
        g = self._g(grad_out, scale)
        return torch.diag(counts), g.mT @ g

    def _weight_grad(self) -> Tensor | None:
        """The weight's (V, D) gradient, written in place; ``ValueError`` if it is sparse."""
        grad = self.weight.grad
        if grad is not None and grad.layout != torch.strided:
            raise ValueError(
                f"layer {self.name!r}: the embedding's gradient is sparse ({grad.layout}); hylo preconditions "
                "dense gradients only: keep sparse=False on a registered nn.Embedding"
            )
        return grad

    def grad_parts(self) -> GradMatrix | None:
        """∇W = ``weight.grad``ᵀ, (d_g, d_a) = (embedding_dim, num_embeddings), a view; None before backward."""
        self._check_shapes()
        grad = self._weight_grad()
        return None if grad is None else GradMatrix(grad.mT)

    def set_grad_matrix(self, matrix: Tensor) -> None:
        """Write a (d_g, d_a) matrix transposed into ``weight.grad`` in place (its dtype kept)."""
        self._check_shapes()
        grad = self._weight_grad()
        assert grad is not None
        grad.copy_(matrix.mT)


def supported_math(
    module: nn.Module,
    conv_rows: ConvRows = "sum",
    kfc_exponent: float = DEFAULT_KFC_EXPONENT,
    max_unfold_mb: float = DEFAULT_MAX_UNFOLD_MB,
) -> LayerMath | None:
    """The math helper for ``module`` (convolutions with ``conv_rows``, ``kfc_exponent`` and
    ``max_unfold_mb``), or None if hylo cannot precondition it."""
    if isinstance(module, nn.Linear):
        return LinearMath(module)
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        return Conv2dMath(module, conv_rows, kfc_exponent, max_unfold_mb)
    if isinstance(module, nn.Embedding) and not module.sparse and not module.scale_grad_by_freq:
        return EmbeddingMath(module)
    return None


def unsupported_reason(module: nn.Module) -> str:
    """Why a module with parameters is left unregistered (for the summary and warning)."""
    kind = type(module).__name__
    if isinstance(module, nn.Conv2d) and module.groups != 1:
        return f"grouped/depthwise Conv2d (groups={module.groups}) is not supported"
    if isinstance(module, nn.Embedding) and module.sparse:
        return (
            f"{kind}(sparse=True) produces sparse gradients and hylo preconditions dense ones: it stays with the "
            "optimizer; set sparse=False to precondition it"
        )
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return (
            f"{kind}(scale_grad_by_freq=True) divides each token's gradient by its count in the batch, so the "
            "per-token gradients are not the rows hylo's curvature is built from: it stays with the optimizer"
        )
    if isinstance(module, nn.EmbeddingBag):
        return (
            f"{kind} pools the tokens of each bag ({module.mode}), which hylo does not model: it stays with the "
            "optimizer; nn.Embedding is supported"
        )
    return f"{kind} is not a supported layer type (Linear, Conv2d, Embedding)"


@dataclass(frozen=True)
class Reduction:
    """What a layer's gradient hook reduces a call to at this step (docs/design.md, "Memory").

    ``lowrank``: the low-rank rows; ``kfac``: the K-FAC factor sums; output gradients are
    multiplied by ``scale`` (1 over the loss scale) in the hook and by the step's sample
    count (and KAISA's ratio) at the update.
    """

    lowrank: bool
    kfac: bool
    scale: float = 1.0


@dataclass(frozen=True)
class CapturedCall:
    """One forward call of a layer as an update uses it: its row counts and either its input and
    output gradient (``raw``) or what its gradient hook reduced them to.

    ``lowrank`` are the call's low-rank rows and ``factors`` its unnormalised K-FAC factors
    (Σ a aᵀ, Σ g gᵀ), both with output gradients multiplied by ``scale``.
    """

    rows: int
    kfac_rows: int
    raw: tuple[Tensor, Tensor] | None = None
    lowrank: SampleRows | None = None
    factors: tuple[Tensor, Tensor] | None = None
    scale: float = 1.0

    @classmethod
    def of(cls, math: LayerMath, call: Call) -> CapturedCall:
        """``call`` itself, or an (input, output gradient) pair kept raw."""
        if isinstance(call, CapturedCall):
            return call
        x, grad_out = call
        return cls(*math.row_counts(x, grad_out), raw=(x, grad_out))

    def tensors(self) -> list[Tensor]:
        """Every tensor the call holds."""
        held = list(self.raw or ()) + list(self.factors or ())
        if self.lowrank is not None:
            held += list(self.lowrank.fields().values())
        return held


#: A captured call: reduced in its hook, or the (input, output gradient) pair.
Call = CapturedCall | tuple[Tensor, Tensor]


@dataclass(frozen=True)
class LayerShape:
    """What the cost model needs of a layer at an update: its dimensions, rows and world size.

    ``rows`` are the local samples n, ``kfac_rows`` the K-FAC rows n_k (samples × output
    positions for a convolution), ``kept_local`` the rows r a rank keeps on the KID/KIS path,
    ``dense_rows`` whether the low-rank rows are whole per-sample gradients, ``row_work`` the
    multiply-adds of building them and ``itemsize`` the bytes per number sent.
    """

    d_a: int
    d_g: int
    rows: int = 0
    kfac_rows: int = 0
    kept_local: int = 0
    world_size: int = 1
    dense_rows: bool = False
    row_work: float = 0.0
    itemsize: int = 4

    @classmethod
    def of(cls, math: LayerMath, rows: int, kfac_rows: int, kept: int, world_size: int) -> LayerShape:
        """The shape of ``math``'s layer with these row counts, its rows gathered from ``world_size`` ranks."""
        return cls(
            math.d_a,
            math.d_g,
            rows,
            kfac_rows,
            kept,
            world_size,
            math.dense_rows,
            math.row_work(rows, kfac_rows),
            math.dtype.itemsize,
        )

    @property
    def kept(self) -> int:
        """Rows m = P·r of the gathered KID/KIS solve."""
        return self.world_size * self.kept_local

    @property
    def row_width(self) -> int:
        """Numbers per low-rank row: d_a + d_g factored, d_a·d_g dense."""
        return self.d_a * self.d_g if self.dense_rows else self.d_a + self.d_g

    @property
    def step_work(self) -> float:
        """Multiply-adds of the layer's own forward and backward in one step, 3·n_k·d_a·d_g."""
        return 3.0 * self.kfac_rows * self.d_a * self.d_g


@dataclass(frozen=True)
class LayerBatch:
    """One layer's captured calls at an update step, with its row counts computed once.

    The same record feeds the hybrid policy (its shape and costs) and the update stage (its
    rows and factors). ``rows`` are the step's samples n over all calls, ``kfac_rows`` the
    K-FAC rows n_k (samples × output positions for a convolution) and ``kept`` the rows r a
    rank keeps on the KID/KIS path.
    """

    math: LayerMath
    calls: tuple[CapturedCall, ...]
    rows: int
    kfac_rows: int
    kept: int
    #: The loss scale of the step's backward passes (a GradScaler's): output gradients are divided by it.
    grad_scale: float = 1.0
    #: ``"kaisa"``: the Fisher is divided by :meth:`LayerMath.kaisa_ratio` (docs/design.md, "K-FAC conventions").
    convention: DampingConvention = "hylo"

    @classmethod
    def collect(
        cls,
        math: LayerMath,
        calls: Sequence[Call],
        rows_kept: Callable[[int], int],
        grad_scale: float = 1.0,
        convention: DampingConvention = "hylo",
    ) -> LayerBatch:
        """Count the rows of this step's calls, reduced or (input, output gradient) pairs (none: a rank without rows)."""
        captured = tuple(CapturedCall.of(math, call) for call in calls)
        rows = sum(c.rows for c in captured)
        kept = rows_kept(rows) if rows else 0
        return cls(math, captured, rows, sum(c.kfac_rows for c in captured), kept, grad_scale, convention)

    def shape(self, world_size: int) -> LayerShape:
        """The layer's shape for the cost model, its rows gathered from ``world_size`` ranks."""
        return LayerShape.of(self.math, self.rows, self.kfac_rows, self.kept, world_size)

    @property
    def has_factors(self) -> bool:
        """Whether the calls can give K-FAC factors (kept raw, or reduced to factors)."""
        return all(c.raw is not None or c.factors is not None for c in self.calls)

    @property
    def has_rows(self) -> bool:
        """Whether the calls can give low-rank rows (kept raw, or reduced to rows)."""
        return all(c.raw is not None or c.lowrank is not None for c in self.calls)

    @property
    def _g_scale(self) -> float:
        """What output gradients are multiplied by: n over the loss scale (docs/design.md, "Notation");
        under KAISA's convention also 1/√c, which divides every solver's Fisher by c = ``kaisa_ratio``."""
        scale = float(self.rows) / self.grad_scale
        if self.convention == "kaisa":
            scale /= self.math.kaisa_ratio(self.rows, self.kfac_rows) ** 0.5
        return scale

    def _missing(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"layer {self.math.name!r}: this step's calls were reduced in the backward without their {what}; "
            "the update must use the path they were reduced for"
        )

    def kfac_factors(self) -> tuple[Tensor, Tensor]:
        """Batch factors A (mean over the K-FAC rows) and G (over the samples) of all calls; zeros without rows."""
        math = self.math
        if not self.calls or not self.rows:
            device = math.weight.device
            return (
                torch.zeros(math.d_a, math.d_a, dtype=math.dtype, device=device),
                torch.zeros(math.d_g, math.d_g, dtype=math.dtype, device=device),
            )
        scale = self._g_scale
        sums = []
        for call in self.calls:
            if call.factors is not None:  # reduced with g·call.scale: rescale G to g·scale
                sums.append((call.factors[0], call.factors[1] * (scale / call.scale) ** 2))
            elif call.raw is not None:
                sums.append(math.kfac_factors(*call.raw, scale))
            else:
                raise self._missing("K-FAC factors")
        a = torch.stack([s[0] for s in sums]).sum(0) / self.kfac_rows
        g = torch.stack([s[1] for s in sums]).sum(0) / self.rows
        return a, g

    def lowrank_rows(self) -> SampleRows:
        """Per-sample gradients of all calls, output gradients scaled by the step's sample count (none: 0 rows)."""
        math = self.math
        if not self.calls or not self.rows:
            device = math.weight.device
            if math.dense_rows:
                return DenseRows(torch.zeros(0, math.d_g, math.d_a, dtype=math.dtype, device=device))
            return FactoredRows(
                torch.zeros(0, math.d_a, dtype=math.dtype, device=device),
                torch.zeros(0, math.d_g, dtype=math.dtype, device=device),
            )
        scale = self._g_scale
        parts = []
        for call in self.calls:
            if call.lowrank is not None:  # reduced with g·call.scale: rescale to g·scale
                factor = scale / call.scale
                parts.append(call.lowrank.scaled(torch.full((call.lowrank.count,), factor, device=math.weight.device)))
            elif call.raw is not None:
                parts.append(math.lowrank_rows(*call.raw, scale))
            else:
                raise self._missing("low-rank rows")
        return concat_rows(parts)
