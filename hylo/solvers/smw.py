"""The Sherman–Morrison–Woodbury machinery shared by the low-rank solvers (docs/solvers.md, "SNGD").

A low-rank state keeps m per-sample gradients U_k (:mod:`hylo.rows`, factored g_k a_kᵀ or
dense), an m×m matrix M, a divisor D and the damping λ. With z_k = ⟨U_k, ∇W⟩ and c = M z,
the preconditioned gradient is V̂ = (∇W − (1/D) Σ_k c_k U_k) / λ. No d×d matrix is ever
formed: building costs O(m²·w + m³) and applying O(m·d_a·d_g), with w = d_a + d_g for
factored rows and d_a·d_g for dense ones.

- SNGD: all rows of the batch, D = B, M = (λI + K/B)⁻¹, exactly (F + λI)⁻¹ vec ∇W.
- KIS: sampled rows rescaled by their Horvitz–Thompson weights, D = B (HyLo's unweighted
  form: D = m), M = (λI + K/D)⁻¹.
- KID: skeleton rows with interpolation weights W (SPD), D = B, M = (λW⁻¹ + K/B)⁻¹,
  computed as L (λI + Lᵀ K L / B)⁻¹ Lᵀ with W = L Lᵀ, never inverting W.

M is solved and kept in float64 and c = M z is computed in float64 whatever the rows' dtype
(docs/solvers.md, "Numerics"): M's entries reach 1/λ, and a float32 M or c has an error of
ε‖z‖/λ in the kernel's near-null directions (duplicated rows), which the subtraction
∇W − Σ c_k U_k turns into an error of ε‖F‖‖∇W‖/λ² in V̂ — uphill steps at λ ≤ 10⁻³. With
M and c in float64 the error is that of rounding ∇W itself, about ε‖∇W‖/λ. M and c are
m×m and m numbers: the cost stays O(m²·w + m³) per update and O(m·d_a·d_g) per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hylo.layers.gradmatrix import GradMatrix, GradShard
from hylo.layers.rows import (
    EXACT_FLOAT32_INTEGERS,
    DenseRows,
    FactoredRows,
    OneHotRows,
    SampleRows,
    rows_from_fields,
)
from hylo.numerics import cholesky_many, spd_inverse_many
from hylo.solvers.base import LayerState, checked_tensors, positive_number
from hylo.solvers.kernel import Exchange, GroupKernel, applied_alone, stacked


@dataclass
class LowRankUpdate:
    """Input of one layer's low-rank solve: the gathered rows, the divisor, KID's weights W."""

    rows: SampleRows
    divisor: float
    weights: Tensor | None = None
    #: Each rank's (rows n_p, rows kept r_p), in rank order (empty when built outside an update).
    counts: tuple[tuple[int, int], ...] = ()


@dataclass
class LowRankState(LayerState):
    """Rows, SMW matrix M, divisor and damping of one layer (see module docstring)."""

    family: ClassVar[str] = "lowrank"

    rows: SampleRows
    inner: Tensor
    divisor: float
    damping: float

    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """Preconditioned (d_g, d_a) gradient in O(m·d_a·d_g): its rows' kernel on a group of one."""
        return applied_alone(lowrank_kernel([self], self.rows.dtype), self, grad, self.rows.dtype)[0]

    def tensors(self) -> dict[str, Tensor]:
        """Rows and the inner matrix: O(m·w + m²) (w = d_a + d_g, or d_a·d_g for dense rows)."""
        return {**self.rows.fields(), "inner": self.inner}

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``state_dict``, with the divisor."""
        return {**super().to_dict(), "divisor": self.divisor}

    @classmethod
    def from_dict(
        cls, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> LowRankState:
        """A state saved by ``to_dict``; ``ValueError`` naming the field unless its rows (``a`` and ``g``, ``u``,
        or ``tokens`` and ``g``) and ``inner`` have their shapes and ``dtype``, the tokens are indices of the
        layer's vocabulary and the damping and divisor are finite numbers > 0 (docs/reliability.md, "Validation");
        ``inner`` in float64 (or, as older formats saved it, ``dtype``)."""
        damping, divisor = positive_number(entry, "damping"), positive_number(entry, "divisor")
        saved = entry.get("tensors")
        names = saved if isinstance(saved, Mapping) else {}
        first = next((name for name in ("u", "tokens") if name in names), "a")
        head = names.get(first)
        rows = head.shape[0] if isinstance(head, Tensor) and head.dim() else 0
        if first == "u":
            expected = {"u": (rows, d_g * d_a), "inner": (rows, rows)}
        elif first == "tokens":
            expected = {"tokens": (rows, 1), "g": (rows, d_g), "inner": (rows, rows)}
        else:
            expected = {"a": (rows, d_a), "g": (rows, d_g), "inner": (rows, rows)}
        dtypes = dict.fromkeys(expected, dtype)
        if first == "tokens":  # as OneHotRows.fields writes them
            dtypes["tokens"] = dtype if d_a <= EXACT_FLOAT32_INTEGERS else torch.float64
        # M is solved and kept in float64 (module docstring); formats 1 and 2 kept it in the rows' dtype
        inner = names.get("inner")
        if isinstance(inner, Tensor) and inner.dtype == torch.float64:
            dtypes["inner"] = torch.float64
        t = checked_tensors(saved, expected, dtypes, device)
        t["inner"] = t["inner"].to(torch.float64)
        tokens = t.get("tokens")
        if tokens is not None and not bool(((tokens == tokens.round()) & (tokens >= -1) & (tokens < d_a)).all()):
            raise ValueError(f"state_dict entry's tokens must be integers in [-1, {d_a})")
        return cls(rows_from_fields(t, d_g, d_a), t["inner"], divisor, damping)


class _SMWKernel(GroupKernel):
    """What the low-rank kernels share: every layer's M·(−1/λ)/D zero-padded to the group's most rows m (a padded
    row's coefficient is 0), the group's 1/λ (one per group: LowRankFamily.group_key), and c·(−1/λ) = M z/D·(−1/λ)
    from the projections z in float64, as a layer's own apply solves it."""

    def __init__(self, states: Sequence[LowRankState]) -> None:
        self.rows = max(state.rows.count for state in states)
        self.inner = torch.zeros(len(states), self.rows, self.rows, dtype=torch.float64, device=states[0].rows.device)
        for i, state in enumerate(states):
            n = state.rows.count
            self.inner[i, :n, :n] = state.inner * (-1.0 / state.damping / state.divisor)
        self.inverse_damping = 1.0 / states[0].damping

    def coefficients(self, projections: Tensor, dtype: torch.dtype) -> Tensor:
        """c·(−1/λ) of every layer, (k, m, 1) in ``dtype``, from its projections (k, m, 1)."""
        return torch.bmm(self.inner, projections.to(torch.float64)).to(dtype)


class FactoredKernel(_SMWKernel):
    """A group of :class:`LowRankState` on factored rows (U_i = g_i a_iᵀ): every layer's rows, zero-padded to the
    group's most rows m, and M·(−1/λ)/D stacked once; V̂ = ∇W/λ − Σ c_k U_k/(λD), c = M z, z_k = g_kᵀ ∇W a_k, in
    six batched operations for the whole group."""

    def __init__(self, states: Sequence[LowRankState], dtype: torch.dtype) -> None:
        super().__init__(states)
        rows = [state.rows for state in states]
        assert all(isinstance(r, FactoredRows) for r in rows)
        fields = [r.fields() for r in rows]
        if all(r.count == self.rows for r in rows):  # no padding: a group of one keeps its rows, no copy
            self.a, self.g = (stacked([f[key] for f in fields], dtype) for key in ("a", "g"))
        else:
            self.a, self.g = (
                self.inner.new_zeros(len(states), self.rows, fields[0][key].shape[1], dtype=dtype) for key in ("a", "g")
            )
            for i, f in enumerate(fields):
                self.a[i, : f["a"].shape[0]] = f["a"]
                self.g[i, : f["g"].shape[0]] = f["g"]

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """∇W/λ − Gᵀ diag(c) A/λ of every layer at once."""
        coefficients = self.coefficients(torch.bmm(self.g, grads).mul_(self.a).sum(dim=-1, keepdim=True), grads.dtype)
        return torch.baddbmm(grads, self.g.mT, self.a * coefficients, beta=self.inverse_damping), list(states)

    def _sides(self, shard: GradShard) -> tuple[Tensor, Tensor]:
        """g and a restricted to this rank's rows (or columns) of ∇W."""
        if shard.axis == 0:
            return self.g[:, :, shard.start : shard.stop], self.a
        return self.g, self.a[:, :, shard.start : shard.stop]

    def shard_partial(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState]
    ) -> list[tuple[Exchange, Tensor]]:
        """This rank's part of z_k = g_kᵀ ∇W a_k, a sum over ∇W's rows (or columns): m numbers per layer, summed
        over ranks."""
        g, a = self._sides(shard)
        return [(Exchange.SUM, torch.bmm(g, grads).mul_(a).sum(dim=-1, keepdim=True))]

    def shard_finish(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState], received: Sequence[Tensor]
    ) -> tuple[Tensor, list[LayerState]]:
        """This rank's rows (or columns) of ∇W/λ − Gᵀ diag(c) A/λ with c = M z from the summed z."""
        g, a = self._sides(shard)
        coefficients = self.coefficients(received[0], grads.dtype)
        return torch.baddbmm(grads, g.mT, a * coefficients, beta=self.inverse_damping), list(states)


class OneHotKernel(_SMWKernel):
    """A group of :class:`LowRankState` on one-hot rows (embeddings, docs/solvers.md, "Embeddings"): each row's
    column of ∇W, its g_i (zero for padding and for the rows added to pad the group to its most rows m) and
    M·(−1/λ)/D stacked once; V̂ = ∇W/λ − Σ c_i g_i e_{t_i}ᵀ/(λD) by one gather and one scatter-add per group."""

    def __init__(self, states: Sequence[LowRankState], dtype: torch.dtype) -> None:
        super().__init__(states)
        rows = [state.rows for state in states]
        d_g = rows[0].fields()["g"].shape[1]
        self.g = self.inner.new_zeros(len(states), self.rows, d_g, dtype=dtype)
        self.columns = self.inner.new_zeros(len(states), 1, self.rows, dtype=torch.long)
        for i, r in enumerate(rows):
            assert isinstance(r, OneHotRows)
            present = r.tokens >= 0
            self.g[i, : r.count] = r.g * present.to(r.g.dtype).unsqueeze(1)
            self.columns[i, 0, : r.count] = r.tokens.clamp_min(0)

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """∇W/λ with c_i g_i/(−λD) added into column t_i, for every layer at once."""
        index = self.columns.expand(-1, grads.shape[1], -1)
        projections = (torch.gather(grads, 2, index).mT * self.g).sum(dim=-1, keepdim=True)  # (k, m, 1)
        coefficients = self.coefficients(projections, grads.dtype)
        out = grads * self.inverse_damping
        return out.scatter_add_(2, index, (self.g * coefficients).mT), list(states)

    def _local(self, shard: GradShard, grads: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """g on this rank's rows of ∇W, each row's column among this rank's (expanded over ∇W's rows, 0 where it
        lies on another rank's columns) and, on columns, where it lies on this rank's (None: on all)."""
        if shard.axis == 0:
            return self.g[:, :, shard.start : shard.stop], self.columns.expand(-1, grads.shape[1], -1), None
        inside = (self.columns >= shard.start) & (self.columns < shard.stop)
        local = torch.where(inside, self.columns - shard.start, 0)
        return self.g, local.expand(-1, grads.shape[1], -1), inside

    def shard_partial(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState]
    ) -> list[tuple[Exchange, Tensor]]:
        """This rank's part of each row's projection g_iᵀ ∇W e_{t_i}: its rows of g_i against its rows of ∇W's
        column t_i, or on columns the whole g_i where t_i is among this rank's columns (m numbers per layer, summed
        over ranks)."""
        g, index, inside = self._local(shard, grads)
        if grads.shape[2] == 0:  # no column here: nothing to project
            return [(Exchange.SUM, g.new_zeros(g.shape[0], g.shape[1], 1))]
        picked = torch.gather(grads, 2, index)
        if inside is not None:
            picked = picked * inside
        return [(Exchange.SUM, (picked.mT * g).sum(dim=-1, keepdim=True))]

    def shard_finish(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState], received: Sequence[Tensor]
    ) -> tuple[Tensor, list[LayerState]]:
        """This rank's rows (or columns) of ∇W/λ with c_i g_i/(−λD) added into column t_i, c from the summed
        projections."""
        g, index, inside = self._local(shard, grads)
        out = grads * self.inverse_damping
        if grads.shape[2] == 0:
            return out, list(states)
        added = (g * self.coefficients(received[0], grads.dtype)).mT
        return out.scatter_add_(2, index, added if inside is None else added * inside), list(states)


class DenseKernel(_SMWKernel):
    """A group of :class:`LowRankState` on dense rows (a convolution's exact per-sample gradients): every layer's
    rows U_i flattened, zero-padded to the group's most rows m, and M·(−1/λ)/D stacked once; V̂ = ∇W/λ −
    Σ c_k U_k/(λD), c = M z, z_k = ⟨U_k, ∇W⟩, in three batched operations for the whole group."""

    def __init__(self, states: Sequence[LowRankState], dtype: torch.dtype) -> None:
        super().__init__(states)
        flat = [state.rows.fields()["u"] for state in states]
        if all(u.shape[0] == self.rows for u in flat):
            self.u = stacked(flat, dtype)
        else:
            self.u = self.inner.new_zeros(len(states), self.rows, flat[0].shape[1], dtype=dtype)
            for i, u in enumerate(flat):
                self.u[i, : u.shape[0]] = u

    def apply(self, grads: Tensor, states: Sequence[LayerState]) -> tuple[Tensor, list[LayerState]]:
        """∇W/λ − Σ c_k U_k/(λD) of every layer at once."""
        return self._combined(grads, self.u, self._projected(grads, self.u)), list(states)

    def _local(self, grads: Tensor, shard: GradShard) -> Tensor:
        """Every U_i restricted to this rank's rows (or columns) of ∇W, flattened as ``grads``."""
        k, m = self.u.shape[:2]
        whole = (grads.shape[1], -1) if shard.axis == 1 else (-1, grads.shape[2])
        u = self.u.view(k, m, *whole)
        part = u[:, :, shard.start : shard.stop] if shard.axis == 0 else u[..., shard.start : shard.stop]
        return part.flatten(2)

    @staticmethod
    def _projected(grads: Tensor, u: Tensor) -> Tensor:
        """z_k = ⟨U_k, ∇W⟩ of every layer, (k, m, 1)."""
        return torch.bmm(u, grads.flatten(1).unsqueeze(-1))

    def _combined(self, grads: Tensor, u: Tensor, projections: Tensor) -> Tensor:
        coefficients = self.coefficients(projections, grads.dtype)
        flat = grads.flatten(1).unsqueeze(-1)
        return torch.baddbmm(flat, u.mT, coefficients, beta=self.inverse_damping).view(grads.shape)

    def shard_partial(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState]
    ) -> list[tuple[Exchange, Tensor]]:
        """This rank's part of z_k = ⟨U_k, ∇W⟩, a sum over ∇W's rows (or columns): m numbers per layer, summed over
        ranks."""
        return [(Exchange.SUM, self._projected(grads, self._local(grads, shard)))]

    def shard_finish(
        self, grads: Tensor, shard: GradShard, states: Sequence[LayerState], received: Sequence[Tensor]
    ) -> tuple[Tensor, list[LayerState]]:
        """This rank's rows (or columns) of ∇W/λ − Σ c_k U_k/(λD) with c = M z from the summed z."""
        return self._combined(grads, self._local(grads, shard), received[0]), list(states)


def lowrank_kernel(states: Sequence[LowRankState], dtype: torch.dtype) -> GroupKernel:
    """The kernel of ``states``, whose rows are of one form (LowRankFamily.group_key), in ``dtype``."""
    form = type(states[0].rows)
    if form is OneHotRows:
        return OneHotKernel(states, dtype)
    if form is DenseRows:
        return DenseKernel(states, dtype)
    return FactoredKernel(states, dtype)


def smw_inners(updates: Sequence[LowRankUpdate], damping: float) -> list[Tensor]:
    """The inner matrix M of every layer in float64 (see the module docstring), batching equal-size solves
    across layers; the kernel is built in the rows' dtype (the O(m²·w) part) and solved in float64 (O(m³))."""
    kernels = [u.rows.kernel().to(torch.float64) / u.divisor for u in updates]
    weighted = {i: u.weights.to(torch.float64) for i, u in enumerate(updates) if u.weights is not None}
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
