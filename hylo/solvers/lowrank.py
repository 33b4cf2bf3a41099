"""The Sherman–Morrison–Woodbury machinery shared by SNGD, KIS and KID.

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hylo.numerics import cholesky_many, spd_inverse_many


def sample_kernel(a: Tensor, g: Tensor) -> Tensor:
    """K = (A Aᵀ) ∘ (G Gᵀ): K_ij = u_iᵀ u_j with u_i = vec(g_i a_iᵀ)."""
    return (a @ a.mT) * (g @ g.mT)


@dataclass
class LowRankUpdate:
    """Input of one layer's low-rank update: kept rows, optional interpolation weights W."""

    a: Tensor
    g: Tensor
    divisor: float
    weights: Tensor | None = None


@dataclass
class LowRankState:
    """Rows, SMW matrix M, divisor and damping of one layer (see module docstring)."""

    a: Tensor
    g: Tensor
    inner: Tensor
    divisor: float
    damping: float
    kind: str = "sngd"

    def precondition(self, grad: Tensor) -> Tensor:
        """Preconditioned (d_g, d_a) gradient in O(m·d_a·d_g)."""
        work = grad.to(self.a.dtype)
        z = ((self.g @ work) * self.a).sum(dim=1)
        c = self.inner @ z
        weighted_g = self.g.mT * (c / self.divisor)
        # (∇W − Gᵀ diag(c/D) A) / λ in one fused pass over the d_g × d_a gradient.
        inv_damping = 1.0 / self.damping
        return torch.addmm(work, weighted_g, self.a, beta=inv_damping, alpha=-inv_damping).to(grad.dtype)

    def nbytes(self) -> int:
        """Bytes held by this state: O(m·(d_a + d_g) + m²)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, Tensor]:
        """The tensors of this state by name."""
        return {"a": self.a, "g": self.g, "inner": self.inner}


def lowrank_update_many(updates: Sequence[LowRankUpdate], damping: float, kinds: Sequence[str]) -> list[LowRankState]:
    """Build M for every layer, batching equal-size solves across layers."""
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
    states = []
    for i, (u, inv) in enumerate(zip(updates, inverses, strict=True)):
        if i in lower_of:
            low = lower_of[i].to(inv.dtype)
            inv = low @ inv @ low.mT
        states.append(LowRankState(u.a, u.g, inv, float(u.divisor), damping, kinds[i]))
    return states
