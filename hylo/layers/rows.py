"""Per-sample gradients of one layer, the rows every low-rank solver works on (docs/solvers.md, "SNGD").

A layer's per-sample gradient U_i (d_g × d_a) is held either

- **factored**, U_i = g_i a_iᵀ (:class:`FactoredRows`): a Linear layer's rows, and the
  per-sample surrogates of a convolution. Sample kernel K = (A Aᵀ) ∘ (G Gᵀ) in
  O(m²(d_a + d_g)); or
- **dense**, U_i as a full matrix (:class:`DenseRows`): a convolution's exact per-sample
  gradients Σ_p g_ip a_ipᵀ. Kernel K = U Uᵀ in O(m² d_a d_g), m·d_a·d_g numbers held.

Both give the solvers the same operations: the kernel K_ij = ⟨U_i, U_j⟩, its diagonal,
selecting and rescaling rows, and their fields; the apply — projecting a gradient onto the rows
(z_i = ⟨U_i, ∇W⟩) and adding Σ_i c_i U_i back — is the low-rank group kernels' (:mod:`hylo.solvers.smw`).
No d × d matrix (d = d_a·d_g) is ever formed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def sample_kernel(a: Tensor, g: Tensor) -> Tensor:
    """K = (A Aᵀ) ∘ (G Gᵀ): K_ij = u_iᵀ u_j with u_i = vec(g_i a_iᵀ)."""
    return (a @ a.mT) * (g @ g.mT)


class SampleRows(ABC):
    """m per-sample gradients of a (d_g, d_a) layer, in one of two storage forms."""

    @property
    @abstractmethod
    def count(self) -> int:
        """Number of rows m."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """Dtype of the stored rows."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device of the stored rows."""

    @property
    @abstractmethod
    def row_width(self) -> int:
        """Numbers per row: d_a + d_g factored, d_a·d_g dense (the kernel costs m² times this)."""

    @abstractmethod
    def kernel(self) -> Tensor:
        """K_ij = ⟨U_i, U_j⟩ (m × m)."""

    @abstractmethod
    def kernel_columns(self, index: Tensor) -> Tensor:
        """Columns ``index`` of the kernel (m × |index|), without forming the kernel."""

    @abstractmethod
    def sq_norms(self) -> Tensor:
        """‖U_i‖²_F, the kernel's diagonal, without forming the kernel."""

    @abstractmethod
    def select(self, index: Tensor) -> SampleRows:
        """The rows at ``index``."""

    @abstractmethod
    def scaled(self, factors: Tensor) -> SampleRows:
        """Rows U_i · factors_i."""

    @abstractmethod
    def to(self, dtype: torch.dtype) -> SampleRows:
        """The rows in ``dtype``."""

    @abstractmethod
    def fields(self) -> dict[str, Tensor]:
        """The rows as 2-D tensors with one row per sample (what the all-gather concatenates)."""


@dataclass(frozen=True)
class FactoredRows(SampleRows):
    """U_i = g_i a_iᵀ: a (m × d_a), g (m × d_g)."""

    a: Tensor
    g: Tensor

    @property
    def count(self) -> int:
        """Number of rows m."""
        return int(self.a.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the stored rows."""
        return self.a.dtype

    @property
    def device(self) -> torch.device:
        """Device of the stored rows."""
        return self.a.device

    @property
    def row_width(self) -> int:
        """d_a + d_g."""
        return int(self.a.shape[1] + self.g.shape[1])

    def kernel(self) -> Tensor:
        """(A Aᵀ) ∘ (G Gᵀ)."""
        return sample_kernel(self.a, self.g)

    def kernel_columns(self, index: Tensor) -> Tensor:
        """Columns ``index`` of the kernel, (A A_Jᵀ) ∘ (G G_Jᵀ): n·|J|·(d_a + d_g), no n×n matrix."""
        return (self.a @ self.a.index_select(0, index).mT) * (self.g @ self.g.index_select(0, index).mT)

    def sq_norms(self) -> Tensor:
        """‖a_i‖² ‖g_i‖²."""
        return self.a.square().sum(dim=1) * self.g.square().sum(dim=1)

    def select(self, index: Tensor) -> FactoredRows:
        """The rows at ``index``."""
        return FactoredRows(self.a.index_select(0, index), self.g.index_select(0, index))

    def scaled(self, factors: Tensor) -> FactoredRows:
        """g_i scaled (a_i kept), so U_i scales by ``factors_i``."""
        return FactoredRows(self.a, self.g * factors.to(self.g.dtype).unsqueeze(1))

    def to(self, dtype: torch.dtype) -> FactoredRows:
        """The rows in ``dtype``."""
        return FactoredRows(self.a.to(dtype), self.g.to(dtype))

    def fields(self) -> dict[str, Tensor]:
        """``a`` and ``g``."""
        return {"a": self.a, "g": self.g}


@dataclass(frozen=True)
class DenseRows(SampleRows):
    """U_i held whole: u (m × d_g × d_a)."""

    u: Tensor

    @property
    def count(self) -> int:
        """Number of rows m."""
        return int(self.u.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the stored rows."""
        return self.u.dtype

    @property
    def device(self) -> torch.device:
        """Device of the stored rows."""
        return self.u.device

    @property
    def row_width(self) -> int:
        """d_a·d_g."""
        return int(self.u.shape[1] * self.u.shape[2])

    def _flat(self) -> Tensor:
        return self.u.reshape(self.u.shape[0], -1)

    def kernel(self) -> Tensor:
        """U Uᵀ over the flattened gradients."""
        flat = self._flat()
        return flat @ flat.mT

    def kernel_columns(self, index: Tensor) -> Tensor:
        """Columns ``index`` of the kernel, U U_Jᵀ."""
        flat = self._flat()
        return flat @ flat.index_select(0, index).mT

    def sq_norms(self) -> Tensor:
        """‖U_i‖²_F."""
        return self._flat().square().sum(dim=1)

    def select(self, index: Tensor) -> DenseRows:
        """The rows at ``index``."""
        return DenseRows(self.u.index_select(0, index))

    def scaled(self, factors: Tensor) -> DenseRows:
        """U_i · factors_i."""
        return DenseRows(self.u * factors.to(self.u.dtype).reshape(-1, 1, 1))

    def to(self, dtype: torch.dtype) -> DenseRows:
        """The rows in ``dtype``."""
        return DenseRows(self.u.to(dtype))

    def fields(self) -> dict[str, Tensor]:
        """``u`` flattened to one row per sample."""
        return {"u": self._flat()}


def rows_from_fields(fields: Mapping[str, Tensor], d_g: int, d_a: int) -> SampleRows:
    """Rows from :meth:`SampleRows.fields` (possibly gathered from several ranks) of a (d_g, d_a) layer."""
    if "tokens" in fields:
        return OneHotRows(fields["tokens"].squeeze(1).to(torch.long), fields["g"], d_a)
    if "u" in fields:
        flat = fields["u"]
        return DenseRows(flat.reshape(flat.shape[0], d_g, d_a))
    return FactoredRows(fields["a"], fields["g"])


def concat_rows(parts: Sequence[SampleRows]) -> SampleRows:
    """The rows of several calls of one layer, in order (all parts of one form)."""
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(part, OneHotRows) for part in parts):
        hot = [part for part in parts if isinstance(part, OneHotRows)]
        return OneHotRows(torch.cat([p.tokens for p in hot]), torch.cat([p.g for p in hot]), hot[0].vocab)
    factored = [part for part in parts if isinstance(part, FactoredRows)]
    if len(factored) == len(parts):
        return FactoredRows(torch.cat([part.a for part in factored]), torch.cat([part.g for part in factored]))
    dense = [part for part in parts if isinstance(part, DenseRows)]
    if len(dense) == len(parts):
        return DenseRows(torch.cat([part.u for part in dense]))
    raise TypeError("the calls of one layer produced rows of different forms")


#: Largest vocabulary whose token indices travel exactly in a float32 field (2²⁴); above it, float64.
EXACT_FLOAT32_INTEGERS = 2**24


@dataclass(frozen=True)
class OneHotRows(SampleRows):
    """Factored rows U_i = g_i a_iᵀ whose a_i are one-hot (zero for padding), held as their token indices.

    No n×V one-hot matrix is ever formed (docs/solvers.md, "Embeddings"): the kernel's activation
    part a_iᵀ a_j is δ(t_i = t_j), O(m²) instead of O(m²·V); the row norms skip it; the projection
    g_iᵀ ∇W a_i reads column t_i of ∇W (O(m·d_g)) and Σ c_i U_i adds c_i g_i into column t_i
    (O(m·d_g), plus the d_g×V result). The rows travel and are saved as ``tokens`` (one number per
    row, in the rows' dtype while V ≤ 2²⁴, else float64) and ``g``.
    """

    #: (m,) token of each row, −1 for a zero row (a padding token).
    tokens: Tensor
    g: Tensor
    #: The vocabulary V (d_a).
    vocab: int

    @property
    def count(self) -> int:
        """Number of rows m."""
        return int(self.g.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the stored rows."""
        return self.g.dtype

    @property
    def device(self) -> torch.device:
        """Device of the stored rows."""
        return self.g.device

    @property
    def row_width(self) -> int:
        """1 + d_g: a token and g_i."""
        return 1 + int(self.g.shape[1])

    @property
    def a(self) -> Tensor:
        """The one-hot rows as an m×V matrix (zero for padding): built on request, for checks only."""
        a = torch.zeros(self.count, self.vocab, dtype=self.dtype, device=self.device)
        return a.index_put_((torch.nonzero(self._present()).squeeze(1), self.tokens[self._present()]), a.new_ones(()))

    def _present(self) -> Tensor:
        return self.tokens >= 0

    def _columns(self) -> Tensor:
        """Each row's column of ∇W, padding rows pointed at column 0 (their weight is zeroed)."""
        return self.tokens.clamp_min(0)

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
        return OneHotRows(self.tokens.index_select(0, index), self.g.index_select(0, index), self.vocab)

    def scaled(self, factors: Tensor) -> OneHotRows:
        """g_i scaled, so U_i scales by ``factors_i``."""
        return OneHotRows(self.tokens, self.g * factors.to(self.g.dtype).unsqueeze(1), self.vocab)

    def to(self, dtype: torch.dtype) -> OneHotRows:
        """The rows in ``dtype`` (the indices unchanged)."""
        return OneHotRows(self.tokens, self.g.to(dtype), self.vocab)

    def fields(self) -> dict[str, Tensor]:
        """``tokens`` (a column, exact in the rows' dtype up to V = 2²⁴, else float64) and ``g``."""
        dtype = self.g.dtype if self.vocab <= EXACT_FLOAT32_INTEGERS else torch.float64
        return {"tokens": self.tokens.to(dtype).unsqueeze(1), "g": self.g}
