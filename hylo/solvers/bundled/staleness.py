"""How stale a held eigenbasis is, and which bases an update refreshes (docs/solvers.md, "Adaptive refresh").

A basis Q (orthonormal columns) held since an earlier update diagonalises the new running factor F exactly when
Qᵀ F Q is diagonal. Its staleness is the relative off-diagonal mass of that matrix,

    s = ‖offdiag(Qᵀ F Q)‖_F / ‖Qᵀ F Q‖_F = ‖F Q − Q diag(e)‖_F / ‖F‖_F,   e = diag(Qᵀ F Q) (the Rayleigh quotients),

(the two are equal for an orthonormal Q), computed from the product F Q — the one the warm-started refresh
computes anyway — and elementwise work, for every matrix of a shape group in one batched product. A side held as
diagonal blocks (docs/solvers.md, "Blocked factors") is measured block by block, each block batched with every
other block of its size (the grouping of the blocked solve), and its staleness is the blocks' aggregate against
the blocked factor's own norm: s² = Σ_b ‖F_b Q_b − Q_b diag(e_b)‖² / Σ_b ‖F_b‖². An update refreshes a side whose
s is not below the tolerance, or whose basis has been held ``max_interval − 1`` updates already; the other sides
keep their basis (all its blocks) and take the Rayleigh quotients as eigenvalues.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hylo.rules import is_index
from hylo.solvers.blockdiag import blocks
from hylo.solvers.bundled.adam_rule import SIDES, previous_basis, side_factor, side_layout

if TYPE_CHECKING:
    from hylo.solvers.bundled.kfac_adam import KFACAdamInputs


@dataclass(frozen=True)
class Measured:
    """A held basis (or block) measured against a new factor: its staleness s (0-dim), the Rayleigh quotients e
    (d), the product F_sym Q (d × d, F_sym = (F + Fᵀ)/2) that the warm-started refresh reuses, and the two norms
    of s = ``residual`` / ``scale`` (0-dim: ‖F_sym Q − Q diag(e)‖_F and ‖F_sym‖_F), which a blocked side sums."""

    staleness: Tensor
    quotients: Tensor
    product: Tensor
    residual: Tensor
    scale: Tensor


def measured_many(factors: Sequence[Tensor], bases: Sequence[Tensor]) -> list[Measured]:
    """Each basis Q measured against its factor F (see the module docstring), batched by shape: one ``bmm`` and a
    few elementwise operations per group, no host read. A zero factor has staleness 0 (every basis diagonalises
    it); a non-finite one NaN."""
    return _measured(factors, bases)[0]


def _measured(factors: Sequence[Tensor], bases: Sequence[Tensor]) -> tuple[list[Measured], list[Tensor], list[int]]:
    """:func:`measured_many`, and each group's (residuals, scales) stacked (2, members) with the indices of its
    members in group order."""
    groups: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = defaultdict(list)
    for i, factor in enumerate(factors):
        groups[(factor.shape, factor.dtype, factor.device)].append(i)
    out: list[Measured | None] = [None] * len(factors)
    vectors: list[Tensor] = []
    for members in groups.values():
        stack = torch.stack([factors[i] for i in members])
        sym = (stack + stack.mT).mul_(0.5)
        basis = torch.stack([bases[i] for i in members]).to(sym.dtype)
        product = torch.bmm(sym, basis)
        quotients = (basis * product).sum(dim=-2)
        residual = torch.linalg.matrix_norm(product - basis * quotients.unsqueeze(-2))
        scale = torch.linalg.matrix_norm(sym)
        staleness = torch.where(scale == 0, 0.0, residual / scale)
        vectors.append(torch.stack([residual, scale]))
        for j, i in enumerate(members):
            out[i] = Measured(staleness[j], quotients[j], product[j], residual[j], scale[j])
    return [m for m in out if m is not None], vectors, [i for members in groups.values() for i in members]


def refreshed(staleness: Sequence[float], held: Sequence[int], tolerance: float, max_interval: int) -> list[bool]:
    """Which sides an update refreshes: those whose staleness is not below ``tolerance`` (NaN included: a
    non-finite factor takes the refresh's own check and fallback), and those held ``max_interval − 1`` updates
    already (a basis is never older than ``max_interval`` updates). Tolerance 0 refreshes every side."""
    return [not (s < tolerance) or h + 1 >= max_interval for s, h in zip(staleness, held, strict=True)]


def aggregated(residuals: Sequence[float], scales: Sequence[float]) -> float:
    """A side's staleness from its units' (one dense matrix, or its diagonal blocks) residual and factor norms:
    √(Σ residual²) / √(Σ scale²); 0 for a zero factor, NaN for a non-finite one."""
    residual, scale = math.hypot(*residuals), math.hypot(*scales)
    if not (math.isfinite(residual) and math.isfinite(scale)):
        return math.nan
    value = 0.0 if scale == 0 else residual / scale
    return value if math.isfinite(value) else math.nan


def decided(
    sides: Sequence[tuple[Sequence[Tensor], Sequence[Tensor]]], held: Sequence[int], tolerance: float, max_interval: int
) -> tuple[list[bool], list[float], list[list[Measured]]]:
    """Each side's (factor units, held basis units) — one dense matrix, or a blocked side's diagonal blocks —
    measured (:func:`measured_many`, all units of all sides batched by shape) and decided (:func:`refreshed`) on its
    aggregate (:func:`aggregated`): whether it refreshes, its staleness and its units' measures. One host read."""
    owner = [k for k, (units, _) in enumerate(sides) for _ in units]
    measures, vectors, order = _measured([u for units, _ in sides for u in units], [q for _, qs in sides for q in qs])
    norms: list[list[tuple[float, float]]] = [[] for _ in sides]
    if vectors:
        device = vectors[0].device
        read = torch.cat([v.to(device, torch.float64) for v in vectors], dim=1).tolist()  # the host read
        by_unit = dict(zip(order, zip(read[0], read[1], strict=True), strict=True))
        for i, k in enumerate(owner):
            norms[k].append(by_unit[i])
    values = [aggregated([r for r, _ in pairs], [c for _, c in pairs]) for pairs in norms]
    grouped: list[list[Measured]] = [[] for _ in sides]
    for i, k in enumerate(owner):
        grouped[k].append(measures[i])
    return refreshed(values, held, tolerance, max_interval), values, grouped


#: The decisions.csv columns of a layer's adaptive refresh, per side a (A's basis) and g (G's): whether the update
#: refreshed the basis, its staleness (empty where not measured) and the updates it has now been kept.
NOTE_COLUMNS = ("refreshed_a", "refreshed_g", "staleness_a", "staleness_g", "held_a", "held_g")


def notes(prepared: KFACAdamInputs) -> dict[str, object] | None:
    """A layer's :data:`NOTE_COLUMNS` values, at an update that measured a held basis (else None)."""
    if prepared.staleness == (None, None):
        return None
    return dict(zip(NOTE_COLUMNS, (*prepared.refresh, *prepared.staleness, *held_after(prepared)), strict=True))


def _units(prepared: KFACAdamInputs, side: str) -> tuple[list[Tensor], list[Tensor]]:
    """A side's running factor and held basis as measured: whole, or block by block where the side is blocked."""
    layout = side_layout(prepared.layouts, side)
    return blocks(side_factor(prepared, side), layout), blocks(previous_basis(prepared, side), layout)


def with_decisions(inputs: list[KFACAdamInputs]) -> list[KFACAdamInputs]:
    """kfac_adam's prepared ``inputs`` with the adaptive refresh decided: under ``refresh_tolerance`` every side an
    update would refresh (eigendecomposed or warm-started, of a layer that holds a state) measured and decided by
    :func:`decided`, on every rank alike (the same all-reduced factors and held states)."""
    sides = [(i, side) for i, p in enumerate(inputs) for side in SIDES if _measures(p, side)]
    if not sides:
        return inputs
    options = inputs[0].options
    assert options.refresh_tolerance is not None
    held = []
    for i, side in sides:
        previous = inputs[i].previous
        assert previous is not None
        held.append(previous.held[SIDES[side]])
    flags, values, measures = decided(
        [_units(inputs[i], side) for i, side in sides],
        held,
        options.refresh_tolerance,
        options.max_refresh_interval,
    )
    out = list(inputs)
    for (i, side), flag, value, measure in zip(sides, flags, values, measures, strict=True):
        p, k = out[i], SIDES[side]
        refresh, staleness, measured = list(p.refresh), list(p.staleness), list(p.measures)
        refresh[k], staleness[k], measured[k] = flag, value, tuple(measure)
        out[i] = dataclasses.replace(
            p,
            refresh=(refresh[0], refresh[1]),
            staleness=(staleness[0], staleness[1]),
            measures=(measured[0], measured[1]),
        )
    return out


def _measures(prepared: KFACAdamInputs, side: str) -> bool:
    """Whether an update measures side ``side`` of a layer: under ``refresh_tolerance``, a layer that holds a
    state, in the K-FAC basis, and not the identity basis of a diagonal A."""
    options = prepared.options
    return (
        options.refresh_tolerance is not None
        and prepared.previous is not None
        and options.adam_basis == "kfac"
        and not (side == "a" and prepared.diagonal_a)
    )


def kept_side(prepared: KFACAdamInputs, side: str) -> tuple[Tensor, Tensor]:
    """A kept side's (eigenvalues, basis): the held basis itself (every block of a blocked side) and the new
    factor's Rayleigh quotients in it (the blocks' joined in block order), clamped at zero."""
    measures = prepared.measures[SIDES[side]]
    assert measures is not None
    quotients = measures[0].quotients if len(measures) == 1 else torch.cat([m.quotients for m in measures])
    return quotients.clamp_min(0.0), previous_basis(prepared, side)


def measured_products(sides: Sequence[tuple[KFACAdamInputs, str]]) -> list[Tensor] | None:
    """Every unit's F·Q of ``sides``' measures, in order, for the warm-started refresh to reuse; None unless every
    one of them was measured."""
    measures = [prepared.measures[SIDES[side]] for prepared, side in sides]
    return [m.product for ms in measures if ms is not None for m in ms] if None not in measures else None


def held_after(prepared: KFACAdamInputs) -> tuple[int, int]:
    """The updates each side's basis has been kept after this update: 0 where it refreshes, one more than before
    where it is kept."""
    before = (0, 0) if prepared.previous is None else prepared.previous.held
    return (0 if prepared.refresh[0] else before[0] + 1, 0 if prepared.refresh[1] else before[1] + 1)


def held_of(entry: Mapping[str, Any]) -> tuple[int, int]:
    """A saved state's ``held`` (absent before the adaptive refresh: none kept), else ``ValueError`` naming it."""
    held = entry.get("held", [0, 0])
    if not isinstance(held, list | tuple) or len(held) != 2 or not all(is_index(h) for h in held):
        raise ValueError(f"held must be two ints >= 0, got {held!r}")
    return held[0], held[1]
