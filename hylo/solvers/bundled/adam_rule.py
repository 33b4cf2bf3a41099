"""The options and the per-step rule of Adam in the K-FAC eigenbasis (``solver="kfac_adam"``), and its moments at an update.

docs/solvers.md, "Adam in the K-FAC eigenbasis": :class:`KFACAdamConfig` is the family's config section,
:class:`AdamRule` the hyperparameters a state applies at every step, :func:`carried_moments` the moments
carried into a new basis at an update, dense or block-diagonal (docs/solvers.md, "Blocked factors").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from torch import Tensor

from hylo.numerics import POWER_COST
from hylo.rules import COUNT, Rule, Section, is_real, option
from hylo.solvers.blockdiag import column_argmax, joined, left, product, times
from hylo.solvers.kfac import EIGH_COST
from hylo.solvers.kfac_blocks import cubes

if TYPE_CHECKING:
    from hylo.solvers.bundled.kfac_adam import KFACAdamInputs, KFACAdamState

#: Where the second moment v̂ comes from (see :class:`KFACAdamConfig`).
SecondMoment = Literal["gradient", "factors"]
#: What becomes of v when the basis changes at an update (see :class:`KFACAdamConfig`).
MomentCarry = Literal["keep", "project"]
#: The basis the moments live in (see :class:`KFACAdamConfig`).
Basis = Literal["kfac", "identity"]
#: How an update refreshes the basis (see :class:`KFACAdamConfig`).
BasisRefresh = Literal["eigh", "power"]


def _betas(value: object) -> bool:
    return (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(is_real(b) for b in value)
        and 0.0 <= value[0] < 1.0
        and 0.0 <= value[1] < 1.0
    )


@dataclass(frozen=True)
class KFACAdamConfig(Section):
    """The adaptive family's options (docs/solvers.md, "Adam in the K-FAC eigenbasis"); read at each update."""

    section_name: ClassVar[str | None] = "kfac_adam"

    adam_betas: tuple[float, float] = option(
        (0.9, 0.999),
        doc="(β₁, β₂) of the moments of the rotated gradient R: β₁ 0 keeps no momentum (the step of this "
        "gradient alone); takes effect at the next update",
        rule=Rule(_betas, "a pair (β₁, β₂) of numbers in [0, 1)"),
    )
    adam_eps: float = option(
        1e-8, doc="ε of m̂ / (v̂^p + ε)", rule=Rule(lambda x: is_real(x) and 0 < x < float("inf"), "a finite number > 0")
    )
    adam_exponent: float = option(
        0.5,
        doc="p of m̂ / (v̂^p + ε): 0.5 is Adam's scaling; 1 with second_moment='factors', β₁ 0 and ε = λ is K-FAC",
        rule=Rule(lambda x: is_real(x) and 0 < x <= 1, "a number in (0, 1]"),
    )
    second_moment: SecondMoment = option(
        "gradient",
        doc="'gradient': v is the running mean of R² (Adam's, SOAP's estimate); 'factors': v̂ = e_g e_aᵀ, the "
        "products of the running factors' eigenvalues (K-FAC's own estimate; no v is kept)",
    )
    moment_carry: MomentCarry = option(
        "keep",
        doc="v when the basis changes at an update: 'keep' each entry with its eigenvector pair (SOAP's choice), "
        "'project' through the squared basis change, (P_g∘P_g)ᵀ v (P_a∘P_a) with P = Q_oldᵀ Q_new; m is always "
        "re-projected exactly",
    )
    adam_basis: Basis = option(
        "kfac",
        doc="'kfac': the running factors' eigenvectors; 'identity': no rotation (Adam on the layer's matrix, "
        "the ablation that shows what the basis buys)",
    )
    basis_refresh: BasisRefresh = option(
        "eigh",
        doc="how an update refreshes a layer's basis: 'eigh' eigendecomposes the running factors; 'power' "
        "refines the previous basis by one step of power iteration and a QR (SOAP's refresh, 0.45–0.7× an "
        "eigh's time; eigenvalues: the previous basis's Rayleigh quotients, v re-sorted with its vectors); a "
        "layer's first update, and a refresh that fails the check, eigendecompose",
    )
    refresh_tolerance: float | None = option(
        None,
        doc="None: every update refreshes every basis; a number: an update refreshes a layer's basis of A or G "
        "only where its staleness, the relative off-diagonal mass ‖offdiag(Qᵀ F Q)‖_F / ‖F‖_F of the held basis Q "
        "in the new running factor F, is at least this (0: every update, as None), else keeps it and its moments "
        "as they are (eigenvalues: its Rayleigh quotients); inf: only max_refresh_interval refreshes",
        rule=Rule(lambda x: is_real(x) and 0 <= x <= float("inf"), "a number >= 0 (inf allowed) or None"),
    )
    max_refresh_interval: int = option(
        4,
        doc="with refresh_tolerance: a basis kept max_refresh_interval − 1 updates in a row is refreshed at the "
        "next whatever its staleness, so that none is older than this many updates (1: every update)",
        rule=COUNT,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("adam_betas", (float(self.adam_betas[0]), float(self.adam_betas[1])))


@dataclass(frozen=True)
class AdamRule:
    """The per-step hyperparameters a state was assembled with (from :class:`KFACAdamConfig`)."""

    beta1: float
    beta2: float
    eps: float
    exponent: float
    second_moment: str

    @classmethod
    def of(cls, config: KFACAdamConfig) -> AdamRule:
        """The rule of ``config``."""
        beta1, beta2 = config.adam_betas
        return cls(beta1, beta2, config.adam_eps, config.adam_exponent, config.second_moment)

    @classmethod
    def saved(cls, saved: object) -> AdamRule:
        """The rule a state saved (``dataclasses.asdict``), else ``ValueError`` naming it: a mapping of exactly the
        rule's fields that :class:`KFACAdamConfig` accepts (docs/reliability.md, "Validation")."""
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(saved, Mapping) or sorted(saved) != sorted(names):
            raise ValueError(f"rule must be a mapping with exactly {names}, got {saved!r}")
        try:
            config = KFACAdamConfig(
                adam_betas=(saved["beta1"], saved["beta2"]),
                adam_eps=saved["eps"],
                adam_exponent=saved["exponent"],
                second_moment=saved["second_moment"],
            )
        except ValueError as err:
            raise ValueError(f"rule: {err}") from None
        return cls.of(config)


#: A side's index in (A's, G's) pairs.
SIDES = {"a": 0, "g": 1}


def side_layout(layouts: tuple[Any, Any], side: str) -> Any:
    """Side ``"a"``'s or ``"g"``'s layout of an (A's, G's) pair (None: dense)."""
    return layouts[SIDES[side]]


def blocked_moments(
    previous: KFACAdamState, evecs_a: Tensor, evecs_g: Tensor, carry: str, refresh: tuple[bool, bool] = (True, True)
) -> tuple[Tensor, Tensor]:
    """(m, v) of ``previous`` carried into the new bases where a side is packed: every product of
    :func:`carried_moments` block by block (P = Q_oldᵀ Q_new and P∘P are block-diagonal; ``"keep"`` pairs a column
    with the old column of its own block); a side that ``refresh`` keeps, P = I, is skipped."""
    layout_g, layout_a = previous.layouts()
    m, v, paired = previous.exp_avg, previous.exp_avg_sq, previous.exp_avg_sq
    if refresh[0]:
        p_a = product(previous.evecs_a, evecs_a, layout_a, transpose=True)
        weights_a = p_a.square()
        m, v = times(m, p_a, layout_a), times(v, weights_a, layout_a)
        paired = paired.index_select(1, column_argmax(weights_a, layout_a))
    if refresh[1]:
        p_g = product(previous.evecs_g, evecs_g, layout_g, transpose=True)
        weights_g = p_g.square()
        m, v = left(p_g, m, layout_g, transpose=True), left(weights_g, v, layout_g, transpose=True)
        paired = paired.index_select(0, column_argmax(weights_g, layout_g))
    if carry == "keep" and any(refresh):
        v = torch.maximum(paired, v)
    return m, v


def joined_side(pieces: Sequence[tuple[Tensor, Tensor]], layout: Any) -> tuple[Tensor, Tensor]:
    """A side's (eigenvalues, basis) from its units' (the dense side's own pair, a blocked side's pair as a whole,
    or its blocks' joined)."""
    if layout is None or len(pieces) == 1:
        return pieces[0]
    return torch.cat([e for e, _ in pieces]), joined([q for _, q in pieces], layout)


def carried_moments(
    previous: KFACAdamState | None,
    evecs_a: Tensor,
    evecs_g: Tensor,
    carry: str,
    widths: tuple[int, int] | None = None,
    refresh: tuple[bool, bool] = (True, True),
) -> tuple[Tensor, Tensor, int]:
    """Moments (m, v) in the new basis and the step count (docs/solvers.md, "Degenerate eigenspaces"): zeros and 0
    without a previous state; else m exactly re-projected, P_gᵀ m P_a with P = Q_oldᵀ Q_new, and v by ``carry``:
    ``"project"`` (P_g∘P_g)ᵀ v (P_a∘P_a); ``"keep"`` each entry with its eigenvector pair — new column j takes the
    entry of the old column it lies most along (argmaxᵢ P_ij²) — and never below the projection, so that a column
    the basis turned into directions of small v carries the v of what it turned from: m̂_j²/v̂_j ≤ Σᵢ m̂ᵢ²/v̂ᵢ
    (Cauchy–Schwarz) however the basis turns. A basis that only reorders its columns moves v with them exactly.
    Blocked sides (``widths``: (d_g, d_a), needed where a side is packed) do all of it block by block
    (docs/solvers.md, "Blocked factors"). A side that ``refresh`` (A's, G's) keeps has P = I: its products are
    skipped (docs/solvers.md, "Adaptive refresh")."""
    if previous is None:
        d_g, d_a = widths or (evecs_g.shape[0], evecs_a.shape[0])
        zeros = evecs_a.new_zeros(d_g, d_a)
        return zeros, zeros.clone(), 0
    if previous.layouts() != (None, None):  # block by block: P and its square are block-diagonal too
        return (*blocked_moments(previous, evecs_a, evecs_g, carry, refresh), previous.steps)
    prev = previous
    m, v = dense_carry(
        (prev.exp_avg, prev.exp_avg_sq), (prev.evecs_a, prev.evecs_g), (evecs_a, evecs_g), carry, refresh
    )
    return m, v, previous.steps


def dense_carry(
    moments: tuple[Tensor, Tensor],
    olds: tuple[Tensor, Tensor],
    news: tuple[Tensor, Tensor],
    carry: str,
    refresh: tuple[bool, bool],
) -> tuple[Tensor, Tensor]:
    """:func:`carried_moments`'s dense path on one layer's tensors, or on stacks of layers of one shape (a leading
    batch dimension): ``moments`` (m, v) (…, d_g, d_a) carried from the ``olds`` bases (Q_a, Q_g) into the ``news``,
    each product one (batched) matmul, each column's pairing one ``gather``."""
    (m, v), paired = moments, moments[1]
    if refresh[1]:
        p_g = olds[1].mT @ news[1]
        weights_g = p_g.square()
        m, v = p_g.mT @ m, weights_g.mT @ v
        paired = paired.gather(-2, weights_g.argmax(dim=-2).unsqueeze(-1).expand_as(paired))
    if refresh[0]:
        p_a = olds[0].mT @ news[0]
        weights_a = p_a.square()
        m, v = m @ p_a, v @ weights_a
        paired = paired.gather(-1, weights_a.argmax(dim=-2).unsqueeze(-2).expand_as(paired))
    if carry == "keep" and any(refresh):
        v = torch.maximum(paired, v)
    return m, v


def carried_moments_many(
    previous: Sequence[KFACAdamState | None],
    bases: Sequence[tuple[Tensor, Tensor]],
    carry: Sequence[str],
    widths: Sequence[tuple[int, int]],
    refresh: Sequence[tuple[bool, bool]],
) -> list[tuple[Tensor, Tensor, int]]:
    """:func:`carried_moments` of many layers (their previous states, new (Q_a, Q_g) ``bases``, ``carry`` rules,
    (d_g, d_a) ``widths`` and ``refresh`` flags): the dense layers whose moments, bases, rules and flags agree in
    shape, dtype and device batched (:func:`dense_carry` on their stacks); the others, and a group of one, layer by
    layer. Each layer's moments are tensors of its own."""
    out: list[tuple[Tensor, Tensor, int] | None] = [None] * len(previous)
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, (state, flags, rule) in enumerate(zip(previous, refresh, carry, strict=True)):
        if state is not None and state.layouts() == (None, None) and any(flags):
            key = (state.exp_avg.shape, state.exp_avg.dtype, state.exp_avg.device, flags, rule)
            groups.setdefault(key, []).append(i)
    for members in (members for members in groups.values() if len(members) > 1):  # a group of one: layer by layer
        states = [state for i in members if (state := previous[i]) is not None]
        news = [bases[i] for i in members]
        m, v = dense_carry(
            (torch.stack([s.exp_avg for s in states]), torch.stack([s.exp_avg_sq for s in states])),
            (torch.stack([s.evecs_a for s in states]), torch.stack([s.evecs_g for s in states])),
            (torch.stack([q_a for q_a, _ in news]), torch.stack([q_g for _, q_g in news])),
            carry[members[0]],
            refresh[members[0]],
        )
        for k, (i, state) in enumerate(zip(members, states, strict=True)):
            out[i] = (m[k].clone(), v[k].clone(), state.steps)
    return [
        done if done is not None else carried_moments(state, basis[0], basis[1], rule, width, flags)
        for done, state, basis, rule, width, flags in zip(out, previous, bases, carry, widths, refresh, strict=True)
    ]


def basis_work(d_a: int, d_g: int, refresh: str, blocks: tuple[int | None, int | None] = (None, None)) -> float:
    """Multiply-adds of a layer's basis at an update: eigendecompositions, or the warm-started refresh
    (:data:`~hylo.numerics.POWER_COST` per d³) for ``refresh="power"``; Σ sᵢ³ of a blocked side's blocks."""
    return (POWER_COST if refresh == "power" else EIGH_COST) * (cubes(d_a, blocks[0]) + cubes(d_g, blocks[1]))


def previous_basis(prepared: KFACAdamInputs, side: str) -> Tensor:
    """The previous state's basis of side ``"a"`` or ``"g"`` (a layer with a previous state)."""
    assert prepared.previous is not None
    return prepared.previous.evecs_a if side == "a" else prepared.previous.evecs_g


def side_factor(prepared: KFACAdamInputs, side: str) -> Tensor:
    """The running factor of side ``"a"`` or ``"g"``."""
    return prepared.factor_a if side == "a" else prepared.factor_g


def warm_started(prepared: KFACAdamInputs) -> bool:
    """Whether this update refines the layer's previous basis (``basis_refresh="power"``, a state held before)."""
    options = prepared.options
    return options.adam_basis == "kfac" and options.basis_refresh == "power" and prepared.previous is not None


def basis_kind(prepared: KFACAdamInputs, side: str) -> str:
    """How an update makes a side's basis: ``"identity"`` (``adam_basis="identity"``), ``"diagonal"`` (a diagonal
    A: the identity, its diagonal the eigenvalues), ``"kept"`` (the held basis, ``refresh_tolerance``), ``"power"``
    (the warm-started refresh) or ``"eigh"``."""
    if prepared.options.adam_basis == "identity":
        return "identity"
    if side == "a" and prepared.diagonal_a:
        return "diagonal"
    if not prepared.refresh[SIDES[side]]:
        return "kept"
    return "power" if warm_started(prepared) else "eigh"
