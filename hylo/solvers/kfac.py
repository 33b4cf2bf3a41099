"""The K-FAC family: (A ⊗ G + λI)⁻¹ vec ∇W through eigendecompositions of running factors, or damped inverses.

docs/solvers.md, "K-FAC". Each rank builds its batch factors A = E[a aᵀ] and G = E[g gᵀ]; the
ranks average them weighted by their sample counts; every rank blends them into the running
averages (decay β; the first update takes the batch factors as they are); the owner
eigendecomposes A and G and the state applies V̂ = Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ
(``kfac_method="eigen"``), or inverts the factors with factored damping and the state applies
V̂ = (G + δ_g I)⁻¹ ∇W (A + δ_a I)⁻¹, two products instead of four (``"inverse"``, docs/solvers.md,
"The inverse method").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hylo.layers.batch import LayerShape
from hylo.layers.conv import DEFAULT_KFC_EXPONENT
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.sampling import FACTOR_SAMPLE_DOC, FACTOR_SAMPLE_RULE, FACTOR_SAMPLER_DOC, FACTOR_SAMPLER_RULE
from hylo.layers.statistics import FACTORS
from hylo.numerics import eigh_many, spd_inverse_many
from hylo.payload import Payload
from hylo.rules import COUNT, DECAY, Hyper, IntHyper, Rule, Section, is_real, option
from hylo.solvers.base import (
    Contribution,
    CostEstimate,
    Exchange,
    FamilyOptions,
    GroupKernel,
    HeldState,
    LayerState,
    RemoteState,
    SolverFamily,
    UpdateContext,
    UpdateJob,
    carried_from,
    checked_tensors,
    positive_number,
)
from hylo.solvers.kfac_kernels import EigenKernel, InverseKernel

#: Multiply-adds of a symmetric eigendecomposition per d³ (tridiagonalisation plus QR sweeps).
EIGH_COST = 4.0
#: Multiply-adds of a Cholesky factorisation and the inverse from it per d³.
INVERSE_COST = 1.0
#: How a K-FAC layer is solved and applied (docs/solvers.md, "The inverse method").
KFAC_METHODS = ("eigen", "inverse")


@dataclass(frozen=True)
class KFACConfig(Section):
    """The K-FAC family's options (docs/solvers.md, "K-FAC", "K-FAC conventions")."""

    section_name: ClassVar[str | None] = "kfac"

    factor_decay: Hyper = option(
        0.95,
        doc="running-average decay β of the K-FAC factors (the first update takes the batch factors as they are)",
        rule=DECAY,
        schedule=True,
    )
    factor_update_freq: IntHyper | None = option(
        None,
        doc="KAISA's factor cadence: K-FAC layers also refresh their running factors every this many steps "
        "between updates (one all-reduce, no decomposition); None: only at update steps",
        rule=COUNT,
        schedule=True,
    )
    factor_sample: float = option(1.0, doc=FACTOR_SAMPLE_DOC, rule=FACTOR_SAMPLE_RULE)
    factor_sampler: str = option("strided", doc=FACTOR_SAMPLER_DOC, rule=FACTOR_SAMPLER_RULE)
    kfac_method: str = option(
        "eigen",
        doc="'eigen': (A ⊗ G + λI)⁻¹ exactly, through eigendecompositions, four products a step; 'inverse': "
        "(A + δ_a I)⁻¹ ⊗ (G + δ_g I)⁻¹ with δ_a δ_g = λ (factored damping, a little more than λ's), through "
        "Cholesky inverses about 4× cheaper at an update and two products a step; takes effect at the next update",
        rule=Rule(lambda x: x in KFAC_METHODS, f"one of {KFAC_METHODS}"),
    )
    kfc_exponent: float = option(
        DEFAULT_KFC_EXPONENT,
        doc="e ∈ [0, 4] of a convolution's K-FAC factors, F ≈ L^e·E_p[aaᵀ] ⊗ E_p[ggᵀ] over its L output "
        "positions: 1 is Grosse & Martens' KFC, 2 fully correlated positions, 0 a position per sample",
        rule=Rule(lambda x: is_real(x) and 0.0 <= x <= 4.0, "a number in [0, 4]"),
        fixed=True,
    )
    kfac_max_state_mb: float | None = option(
        2048.0,
        doc="the most MB of one layer's K-FAC state (A, G, their eigenvectors and eigenvalues: 2(d_a² + d_g²) + "
        "d_a + d_g numbers in the working dtype, held on every rank), known at construction: over it "
        "solver='kfac' (or a layer_solvers entry) refuses the layer, naming it, and hybrid never gives it K-FAC. "
        "2048 (MB of 2²⁰ bytes, an eighth of a 16 GB GPU) keeps K-FAC for layers up to 11,584 wide (a 4096×11008 "
        "MLP: 1,053 MB) and refuses vocabulary-sized ones (V = 32,000: 7,813 MB); inf or None: no limit",
        rule=Rule(lambda x: is_real(x) and x > 0, "a number > 0 (inf or None: no limit)"),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("kfc_exponent", float(self.kfc_exponent))


def eigen_shapes(d_a: int, d_g: int) -> dict[str, tuple[int, ...]]:
    """The shapes of a (d_g, d_a) layer's running factors and their eigendecompositions, by field name (what
    :class:`KFACState` holds, and the K-FAC part of a state that builds on it)."""
    return {
        "factor_a": (d_a, d_a),
        "factor_g": (d_g, d_g),
        "evals_a": (d_a,),
        "evecs_a": (d_a, d_a),
        "evals_g": (d_g,),
        "evecs_g": (d_g, d_g),
    }


def kfac_state_bytes(d_a: int, d_g: int, itemsize: int) -> int:
    """Bytes of one layer's K-FAC state as :class:`KFACState` holds it: the running A (d_a×d_a, dense also for an
    embedding's diagonal one) and G (d_g×d_g), their eigenvectors (the same sizes) and eigenvalues (d_a + d_g), in
    the working dtype."""
    return (2 * (d_a * d_a + d_g * d_g) + d_a + d_g) * itemsize


def eigh_work(d_a: int, d_g: int) -> float:
    """Multiply-adds of eigendecomposing a (d_a × d_a) and a (d_g × d_g) factor."""
    return EIGH_COST * (float(d_a) ** 3 + float(d_g) ** 3)


def solve_work(d_a: int, d_g: int, method: str) -> float:
    """Multiply-adds of solving a layer's two factors by ``kfac_method``: eigendecompositions, or damped inverses
    by Cholesky."""
    if method == "inverse":
        return INVERSE_COST * (float(d_a) ** 3 + float(d_g) ** 3)
    return eigh_work(d_a, d_g)


@dataclass
class KFACState(LayerState):
    """Running Kronecker factors of one layer and their eigendecompositions.

    ``precondition`` computes V̂ = Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ, which is exactly
    (A ⊗ G + λI)⁻¹ vec ∇W for the stored A, G and the damping λ of the last update.
    """

    family: ClassVar[str] = "kfac"

    factor_a: Tensor
    factor_g: Tensor
    evals_a: Tensor
    evecs_a: Tensor
    evals_g: Tensor
    evecs_g: Tensor
    damping: float

    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """Preconditioned (d_g, d_a) gradient (∇W Q_a taken part by part: no concatenated copy)."""
        parts = GradMatrix.of(grad)
        rotated = self.evecs_g.mT @ parts.to(self.evecs_a.dtype).times(self.evecs_a)
        rotated.div_(torch.outer(self.evals_g, self.evals_a).add_(self.damping))
        return self.evecs_g @ rotated @ self.evecs_a.mT

    def shard_partial(self, grad: GradMatrix) -> tuple[Exchange, Tensor]:
        """This rank's part of ∇W Q_a: Q_gᵀ (∇W Q_a) mixes all rows, so a rank's rows of it are gathered; from a
        rank's columns of ∇W, ∇W Q_a is a sum over ranks (d_g·d_a numbers either way)."""
        shard = grad.shard
        assert shard is not None
        work = grad.to(self.evecs_a.dtype)
        if shard.axis == 0:
            return Exchange.ROWS, work.times(self.evecs_a)
        return Exchange.SUM, work.times(self.evecs_a[shard.start : shard.stop])

    def shard_finish(self, grad: GradMatrix, received: Tensor) -> Tensor:
        """This rank's rows (or columns) of V̂ = Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ from the whole ∇W Q_a."""
        shard = grad.shard
        assert shard is not None
        rotated = self.evecs_g.mT @ received
        rotated.div_(torch.outer(self.evals_g, self.evals_a).add_(self.damping))
        if shard.axis == 0:
            return self.evecs_g[shard.start : shard.stop] @ rotated @ self.evecs_a.mT
        return self.evecs_g @ rotated @ self.evecs_a[shard.start : shard.stop].mT

    def tensors(self) -> dict[str, Tensor]:
        """Factors and eigendecompositions by name."""
        return {name: getattr(self, name) for name in eigen_shapes(0, 0)}

    def plan_parts(self) -> tuple[object, ...]:
        """The eigendecompositions and λ (a refresh, which replaces only the factors, keeps the group kernel)."""
        return (self.evals_a, self.evecs_a, self.evals_g, self.evecs_g, self.damping)

    def carried(self) -> dict[str, Tensor]:
        """The running factors, which the next update blends with its batch factors."""
        return {"factor_a": self.factor_a, "factor_g": self.factor_g}

    @classmethod
    def from_dict(
        cls, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> LayerState:
        """A state saved by ``to_dict`` (a :class:`KFACInverseState`'s when it holds ``inverse_a``); ``ValueError``
        naming the field unless every tensor has its shape and ``dtype``, the damping is a finite number > 0 and
        the eigenvalues are ≥ 0 (as ``eigh_many`` leaves them), so that every e_g e_a + λ the apply divides by is
        > 0 (docs/reliability.md, "Validation")."""
        if "divisor" in entry:
            raise ValueError("state_dict entry holds a divisor, which a K-FAC state has none of")
        damping = positive_number(entry, "damping")
        shapes = eigen_shapes(d_a, d_g)
        tensors = entry.get("tensors")
        if isinstance(tensors, Mapping) and "inverse_a" in tensors:
            return KFACInverseState.from_dict(entry, d_a, d_g, dtype, device)
        t = checked_tensors(tensors, shapes, dict.fromkeys(shapes, dtype), device)
        for key in ("evals_a", "evals_g"):
            if bool((t[key] < 0).any()):
                raise ValueError(f"{key} holds negative eigenvalues (the factors are positive semi-definite)")
        return cls(t["factor_a"], t["factor_g"], t["evals_a"], t["evecs_a"], t["evals_g"], t["evecs_g"], damping)

    @classmethod
    def carried_from_dict(
        cls, carried: object, d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, Tensor]:
        """The running factors A (d_a × d_a) and G (d_g × d_g) in ``dtype``, else ``ValueError``."""
        shapes = {"factor_a": (d_a, d_a), "factor_g": (d_g, d_g)}
        return checked_tensors(carried, shapes, dict.fromkeys(shapes, dtype), device)


@dataclass
class KFACInverseState(LayerState):
    """Running Kronecker factors of one layer and their damped inverses (``kfac_method="inverse"``).

    ``precondition`` computes V̂ = (G + δ_g I)⁻¹ ∇W (A + δ_a I)⁻¹ with δ_a δ_g = λ (:func:`split_damping`): the
    inverse of (A + δ_a I) ⊗ (G + δ_g I) = A ⊗ G + λI + δ_g A ⊗ I + δ_a I ⊗ G, a damping larger than λ's alone,
    in two products (docs/solvers.md, "The inverse method").
    """

    family: ClassVar[str] = "kfac"

    factor_a: Tensor
    factor_g: Tensor
    inverse_a: Tensor
    inverse_g: Tensor
    damping: float

    def precondition(self, grad: Tensor | GradMatrix) -> Tensor:
        """Preconditioned (d_g, d_a) gradient (∇W (A + δ_a I)⁻¹ taken part by part)."""
        parts = GradMatrix.of(grad)
        return self.inverse_g @ parts.to(self.inverse_a.dtype).times(self.inverse_a)

    def shard_partial(self, grad: GradMatrix) -> tuple[Exchange, Tensor]:
        """This rank's term of V̂ = Σ_ranks G⁻¹[:, rows] ∇W[rows] A⁻¹ (or G⁻¹ ∇W[:, cols] A⁻¹[cols]), summed over
        ranks (d_g·d_a numbers)."""
        shard = grad.shard
        assert shard is not None
        work = grad.to(self.inverse_a.dtype)
        if shard.axis == 0:
            return Exchange.SUM, self.inverse_g[:, shard.start : shard.stop] @ work.times(self.inverse_a)
        return Exchange.SUM, self.inverse_g @ work.times(self.inverse_a[shard.start : shard.stop])

    def shard_finish(self, grad: GradMatrix, received: Tensor) -> Tensor:
        """This rank's rows (or columns) of the summed V̂."""
        shard = grad.shard
        assert shard is not None
        if shard.axis == 0:
            return received[shard.start : shard.stop]
        return received[:, shard.start : shard.stop]

    def plan_parts(self) -> tuple[object, ...]:
        """The damped inverses and λ (a refresh, which replaces only the factors, keeps the group kernel)."""
        return (self.inverse_a, self.inverse_g, self.damping)

    def tensors(self) -> dict[str, Tensor]:
        """Factors and damped inverses by name."""
        return {
            "factor_a": self.factor_a,
            "factor_g": self.factor_g,
            "inverse_a": self.inverse_a,
            "inverse_g": self.inverse_g,
        }

    def carried(self) -> dict[str, Tensor]:
        """The running factors, which the next update blends with its batch factors."""
        return {"factor_a": self.factor_a, "factor_g": self.factor_g}

    @classmethod
    def from_dict(
        cls, entry: Mapping[str, Any], d_a: int, d_g: int, dtype: torch.dtype, device: torch.device
    ) -> KFACInverseState:
        """A state saved by ``to_dict``; ``ValueError`` naming the field unless every tensor has its shape and
        ``dtype`` and the damping is a finite number > 0 (docs/reliability.md, "Validation")."""
        if "divisor" in entry:
            raise ValueError("state_dict entry holds a divisor, which a K-FAC state has none of")
        damping = positive_number(entry, "damping")
        shapes = {"factor_a": (d_a, d_a), "factor_g": (d_g, d_g), "inverse_a": (d_a, d_a), "inverse_g": (d_g, d_g)}
        t = checked_tensors(entry.get("tensors"), shapes, dict.fromkeys(shapes, dtype), device)
        return cls(t["factor_a"], t["factor_g"], t["inverse_a"], t["inverse_g"], damping)


def split_damping(factor_a: Tensor, factor_g: Tensor, damping: float) -> tuple[Tensor, Tensor]:
    """Factored Tikhonov damping (δ_a, δ_g) = (π√λ, √λ/π), π = sqrt((tr A / d_a) / (tr G / d_g)) (1 where a trace
    is not finite and > 0), so δ_a δ_g = λ: the shift of each factor in proportion to its mean eigenvalue (Martens
    & Grosse's π; docs/solvers.md, "The inverse method"). 0-dim float64 tensors, no host sync."""
    mean_a = torch.diagonal(factor_a).sum(dtype=torch.float64) / factor_a.shape[0]
    mean_g = torch.diagonal(factor_g).sum(dtype=torch.float64) / factor_g.shape[0]
    ratio = mean_a / mean_g
    usable = (mean_a > 0) & (mean_g > 0) & torch.isfinite(ratio) & (ratio > 0)
    pi = torch.where(usable, ratio, torch.ones_like(ratio)).sqrt()
    root = damping**0.5
    return pi * root, root / pi


def _shifted(factor: Tensor, shift: Tensor) -> Tensor:
    """factor + shift·I (a new tensor; the running factor is kept)."""
    out = factor.clone()
    out.diagonal().add_(shift.to(factor.dtype))
    return out


@dataclass
class KFACFactors:
    """A layer's running factors after this update's blend, and how the owner solves them (``method``)."""

    factor_a: Tensor
    factor_g: Tensor
    method: str = "eigen"


def blend_factors(
    previous: tuple[Tensor, Tensor] | None, batch: tuple[Tensor, Tensor], decay: float
) -> tuple[Tensor, Tensor]:
    """Running averages A ← β A + (1 − β) A_batch (same for G), written into ``batch``'s tensors (no
    second copy of every factor at the update's peak); the first update takes the batch as it is."""
    if previous is None:
        return batch
    return (
        batch[0].mul_(1.0 - decay).add_(previous[0], alpha=decay),
        batch[1].mul_(1.0 - decay).add_(previous[1], alpha=decay),
    )


def running_factors(
    jobs: Sequence[UpdateJob], received: Payload, decay: float, family: str
) -> list[tuple[Tensor, Tensor]]:
    """Each job's rank-averaged batch factors blended into the running factors its held state of ``family``
    carries (:func:`blend_factors`)."""
    out = []
    for job in jobs:
        carried = carried_from(job.previous, family)
        previous = (carried["factor_a"], carried["factor_g"]) if carried else None
        out.append(blend_factors(previous, (received[(job.name, "factor_a")], received[(job.name, "factor_g")]), decay))
    return out


def eigen_template(factor_a: Tensor, factor_g: Tensor) -> dict[str, Tensor]:
    """Buffers for another rank's eigendecompositions of ``factor_a`` and ``factor_g``."""
    return {
        "evals_a": factor_a.new_empty(factor_a.shape[0]),
        "evecs_a": torch.empty_like(factor_a),
        "evals_g": factor_g.new_empty(factor_g.shape[0]),
        "evecs_g": torch.empty_like(factor_g),
    }


def refreshed_states(
    jobs: Sequence[UpdateJob],
    factors: Sequence[tuple[Tensor, Tensor]],
    held: tuple[type[LayerState], ...],
    family: str,
) -> list[HeldState]:
    """Each job's held state (of a type in ``held``) with its running ``factors`` replaced, its solve kept; a
    :class:`RemoteState` of ``family`` carrying them where the rank holds no such state."""
    refreshed: list[HeldState] = []
    for job, (factor_a, factor_g) in zip(jobs, factors, strict=True):
        previous = job.previous
        if isinstance(previous, held):
            refreshed.append(dataclasses.replace(previous, factor_a=factor_a, factor_g=factor_g))  # type: ignore[type-var]
        else:
            refreshed.append(RemoteState(family, {"factor_a": factor_a, "factor_g": factor_g}))
    return refreshed


class KFACFamily(SolverFamily[KFACFactors]):
    """K-FAC: batch factors averaged over ranks, blended, eigendecomposed by the owner."""

    name = "kfac"
    state_type = KFACState
    statistic = FACTORS
    section = KFACConfig

    @property
    def solvers(self) -> tuple[str, ...]:
        """``"kfac"``."""
        return ("kfac",)

    def contribute(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> Contribution:
        """Each layer's batch factors, weighted by its sample count in the mean over ranks."""
        share = Contribution(Exchange.MEAN, Payload())
        for job in jobs:
            factor_a, factor_g = job.batch.collect(FACTORS)
            context.watch.lap("capture", job.name)
            share.payload.add(job.name, {"factor_a": factor_a, "factor_g": factor_g})
            share.weights[(job.name, "factor_a")] = share.weights[(job.name, "factor_g")] = float(job.batch.rows)
        return share

    def prepare(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[KFACFactors]:
        """Blend the rank-averaged batch factors into each layer's running factors."""
        factors = running_factors(jobs, received, context.factor_decay, self.name)
        method = context.options(KFACConfig).kfac_method
        return [KFACFactors(factor_a, factor_g, method) for factor_a, factor_g in factors]

    def cost(self, shape: LayerShape, solver: str, options: FamilyOptions) -> CostEstimate:
        """Factors n_k(d_a² + d_g²); by ``kfac_method``, eigendecompositions 4(d_a³ + d_g³) and rotations
        2 d_a d_g (d_a + d_g) a step, or damped inverses (d_a³ + d_g³) and two products d_a d_g (d_a + d_g).

        With P > 1 a rank sends and receives about 3(d_a² + d_g²) numbers per update: the
        all-reduce of A and G (twice their size) and the broadcast of the eigenvectors (or inverses).
        """
        d_a, d_g = shape.d_a, shape.d_g
        method = options(KFACConfig).kfac_method
        exchanged = 3.0 * (d_a**2 + d_g**2) if shape.world_size > 1 else 0.0
        return CostEstimate(
            build=shape.kfac_rows * (d_a**2 + d_g**2),
            solve=solve_work(d_a, d_g, method),
            apply=(1.0 if method == "inverse" else 2.0) * d_a * d_g * (d_a + d_g),
            bytes=exchanged * shape.itemsize,
        )

    def solve_cost(self, prepared: KFACFactors) -> float:
        """The eigendecompositions' (or inverses') cost."""
        return solve_work(prepared.factor_a.shape[0], prepared.factor_g.shape[0], prepared.method)

    def solve(self, prepared: Sequence[KFACFactors], context: UpdateContext) -> list[dict[str, Tensor]]:
        """Eigendecompositions of every A and G batched by shape (or, for the layers of the inverse method, their
        damped inverses, batched by shape); each layer's solution in its order."""
        out: list[dict[str, Tensor]] = [{} for _ in prepared]
        eigen = [i for i, f in enumerate(prepared) if f.method == "eigen"]
        decompositions = eigh_many([m for i in eigen for m in (prepared[i].factor_a, prepared[i].factor_g)])
        for i, (ea, qa), (eg, qg) in zip(eigen, decompositions[0::2], decompositions[1::2], strict=True):
            out[i] = {"evals_a": ea, "evecs_a": qa, "evals_g": eg, "evecs_g": qg}
        inverse = [i for i, f in enumerate(prepared) if f.method == "inverse"]
        shifted = []
        for i in inverse:
            delta_a, delta_g = split_damping(prepared[i].factor_a, prepared[i].factor_g, context.damping)
            shifted += [_shifted(prepared[i].factor_a, delta_a), _shifted(prepared[i].factor_g, delta_g)]
        inverses = spd_inverse_many(shifted)
        for i, inv_a, inv_g in zip(inverse, inverses[0::2], inverses[1::2], strict=True):
            out[i] = {"inverse_a": inv_a, "inverse_g": inv_g}
        return out

    def solution_template(self, prepared: KFACFactors) -> dict[str, Tensor]:
        """Buffers for another rank's eigendecompositions (or inverses)."""
        fa, fg = prepared.factor_a, prepared.factor_g
        if prepared.method == "inverse":
            return {"inverse_a": torch.empty_like(fa), "inverse_g": torch.empty_like(fg)}
        return eigen_template(fa, fg)

    def assemble(
        self, prepared: KFACFactors, solution: Mapping[str, Tensor], context: UpdateContext
    ) -> KFACState | KFACInverseState:
        """The running factors with their eigendecompositions (or damped inverses)."""
        s = solution
        if prepared.method == "inverse":
            return KFACInverseState(
                prepared.factor_a, prepared.factor_g, s["inverse_a"], s["inverse_g"], context.damping
            )
        return KFACState(
            prepared.factor_a,
            prepared.factor_g,
            s["evals_a"],
            s["evecs_a"],
            s["evals_g"],
            s["evecs_g"],
            context.damping,
        )

    def carried(self, prepared: KFACFactors) -> dict[str, Tensor]:
        """Every rank keeps the running factors (the next update blends with them)."""
        return {"factor_a": prepared.factor_a, "factor_g": prepared.factor_g}

    def state_bytes(self, d_a: int, d_g: int, itemsize: int) -> int | None:
        """:func:`kfac_state_bytes` (the eigen method's, the larger)."""
        return kfac_state_bytes(d_a, d_g, itemsize)

    def group_kernel(self, states: Sequence[LayerState], dtype: torch.dtype) -> GroupKernel:
        """:class:`~hylo.solvers.kfac_kernels.EigenKernel` or :class:`~hylo.solvers.kfac_kernels.InverseKernel`
        (the group key is the state's type), in the states' dtype (``dtype``, the layers' working dtype)."""
        inverse = [state for state in states if isinstance(state, KFACInverseState)]
        if len(inverse) == len(states):
            return InverseKernel([s.inverse_a for s in inverse], [s.inverse_g for s in inverse])
        eigen = [state for state in states if isinstance(state, KFACState)]
        divisors = [torch.outer(s.evals_g, s.evals_a).add_(s.damping) for s in eigen]
        return EigenKernel([s.evecs_a for s in eigen], [s.evecs_g for s in eigen], divisors)

    refreshes = True

    def refresh(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[HeldState]:
        """The running factors blended with this step's batch factors; the eigendecompositions kept (KAISA's
        ``factor_update_freq``): they are redone from the running factors at the next update."""
        factors = running_factors(jobs, received, context.factor_decay, self.name)
        return refreshed_states(jobs, factors, (KFACState, KFACInverseState), self.name)
