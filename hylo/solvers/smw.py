"""The Sherman–Morrison–Woodbury machinery shared by the low-rank solvers (docs/design.md, "SNGD").

A low-rank state keeps m rows (a_k, g_k), an m×m matrix M, a divisor D and the damping λ.
With z_k = g_kᵀ ∇W a_k and c = M z, the preconditioned gradient is
V̂ = (∇W − (1/D) Σ_k c_k g_k a_kᵀ) / λ. No d×d matrix is ever formed:
building costs O(m²(d_a + d_g) + m³) and applying O(m·d_a·d_g).

- SNGD: all rows of the batch, D = B, M = (λI + K/B)⁻¹, exactly (F + λI)⁻¹ vec ∇W.
- KIS: sampled rows, D = m, M = (λI + K/m)⁻¹.
- KID: skeleton rows with interpolation weights W (SPD), D = B, M = (λW⁻¹ + K/B)⁻¹,
  computed as L (λI + Lᵀ K L / B)⁻¹ Lᵀ with W = L Lᵀ, never inverting W.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hylo.numerics import cholesky_many, spd_inverse_many
from hylo.solvers.base import LayerState, check_shapes


def sample_kernel(a: Tensor, g: Tensor) -> Tensor:
    """K = (A Aᵀ) ∘ (G Gᵀ): K_ij = u_iᵀ u_j with u_i = vec(g_i a_iᵀ)."""
    return (a @ a.mT) * (g @ g.mT)


@dataclass
class LowRankUpdate:
    """Input of one layer's low-rank solve: the gathered rows, the divisor, KID's weights W."""

    a: Tensor
    g: Tensor
    divisor: float
    weights: Tensor | None = None


@dataclass
class LowRankState(LayerState):
    """Rows, SMW matrix M, divisor and damping of one layer (see module docstring)."""

    family: ClassVar[str] = "lowrank"

    a: Tensor
    g: Tensor
    inner: Tensor
    divisor: float
    damping: float

    def precondition(self, grad: Tensor) -> Tensor:
        """Preconditioned (d_g, d_a) gradient in O(m·d_a·d_g)."""
        work = grad.to(self.a.dtype)
        z = ((self.g @ work) * self.a).sum(dim=1)
        c = self.inner @ z
        weighted_g = self.g.mT * (c / self.divisor)
        # (∇W − Gᵀ diag(c/D) A) / λ in one fused pass over the d_g × d_a gradient.
        inv_damping = 1.0 / self.damping
        return torch.addmm(work, weighted_g, self.a, beta=inv_damping, alpha=-inv_damping).to(grad.dtype)

    def tensors(self) -> dict[str, Tensor]:
        """Rows and the inner matrix: O(m·(d_a + d_g) + m²)."""
        return {"a": self.a, "g": self.g, "inner": self.inner}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``state_dict``, with the divisor."""
        return {**super().to_dict(), "divisor": self.divisor}

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], d_a: int, d_g: int, device: torch.device) -> LowRankState:
        """A state saved by ``to_dict``; ``ValueError`` if it does not fit a (d_g, d_a) layer."""
        t = {k: v.to(device) for k, v in entry["tensors"].items()}
        if "a" not in t:
            raise ValueError("state_dict entry lacks tensor 'a'")
        rows = t["a"].shape[0] if t["a"].dim() else 0
        check_shapes(t, {"a": (rows, d_a), "g": (rows, d_g), "inner": (rows, rows)})
        if "divisor" not in entry:
            raise ValueError("state_dict entry lacks the low-rank divisor")
        return cls(t["a"], t["g"], t["inner"], float(entry["divisor"]), float(entry["damping"]))


def smw_inners(updates: Sequence[LowRankUpdate], damping: float) -> list[Tensor]:
    """The inner matrix M of every layer, batching equal-size solves across layers."""
    kernels = [sample_kernel(u.a, u.g) / u.divisor for u in updates]
    weighted = {i: u.weights for i, u in enumerate(updates) if u.weights is not None}
    lowers = cholesky_many(list(weighted.values()))
    lower_of = dict(zip(weighted, lowers, strict=True))
    inners = []
    for i, k in enumerate(kernels):
        if i in lower_of:
            low = lower_of[i].to(k.dtype)
            k = low.mT @ k @ low
        inners.append(k + damping * torch.eye(k.shape[0], dtype=k.dtype, device=k.device))
    inverses = spd_inverse_many(inners)
    for i, low in lower_of.items():
        low = low.to(inverses[i].dtype)
        inverses[i] = low @ inverses[i] @ low.mT
    return inverses
