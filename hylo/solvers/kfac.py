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
from hylo.layers.blocks import BlockLayout, side_numbers
from hylo.layers.conv import DEFAULT_KFC_EXPONENT
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.math import FACTOR_DTYPE_DOC, FACTOR_DTYPE_RULE
from hylo.layers.sampling import FACTOR_SAMPLE_DOC, FACTOR_SAMPLE_RULE, FACTOR_SAMPLER_DOC, FACTOR_SAMPLER_RULE
from hylo.layers.statistics import FACTORS
from hylo.numerics import eigh_many, spd_inverse_many
from hylo.payload import Payload
from hylo.rules import COUNT, DECAY, Hyper, IntHyper, Rule, Section, is_real, option
from hylo.solvers.base import (
    Contribution,
    CostEstimate,
    FamilyOptions,
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
from hylo.solvers.blockdiag import (
    blocks,
    joined,
    shifted,
)
from hylo.solvers.kernel import Exchange, GroupKernel, applied_alone
from hylo.solvers.kfac_blocks import (
    block_width,
    cubes,
    decomposed,
    factor_layouts,
    factors_of,
    held_shapes,
    inverse_layouts,
    side_width,
    square_shape,
    state_layouts,
)
from hylo.solvers.kfac_inverse import KFACInverseState, inverse_kernel, split_damping
from hylo.solvers.kfac_kernels import EigenKernel

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
    factor_dtype: str | None = option(None, doc=FACTOR_DTYPE_DOC, rule=FACTOR_DTYPE_RULE, fixed=True)
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

    factor_block: int | None = option(
        None,
        doc="the largest block of a K-FAC factor (every family that keeps K-FAC factors): a side wider than it is held as k = ⌈d/b⌉ "
        "diagonal blocks of balanced sizes, each with its own eigenbasis (or inverse), so that its statistics cost "
        "n·Σ sᵢ² instead of n·d², its decompositions Σ sᵢ³ instead of d³ and its products d·s instead of d² per "
        'row (docs/solvers.md, "Blocked factors"); None (or b ≥ d): whole factors',
        rule=COUNT,
        fixed=True,
    )
    split_gate_up: bool = option(
        True,
        doc="a fused expert's gate_up G as its gate and up halves (each at most factor_block), as K-FAC holds an "
        "unfused expert's two projections; a half's basis costs an eighth of the whole's (docs/moe.md, \"Gate and up\")",
        rule=Rule(lambda x: isinstance(x, bool), "a bool"),
        fixed=True,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("kfc_exponent", float(self.kfc_exponent))


def eigen_shapes(d_a: int, d_g: int, block: int | None = None) -> dict[str, tuple[int, ...]]:
    """The shapes of a (d_g, d_a) layer's running factors and their eigendecompositions, by field name (what
    :class:`KFACState` holds, and the K-FAC part of a state that builds on it), a side wider than ``block`` packed."""
    return {
        "factor_a": square_shape(d_a, block),
        "factor_g": square_shape(d_g, block),
        "evals_a": (d_a,),
        "evecs_a": square_shape(d_a, block),
        "evals_g": (d_g,),
        "evecs_g": square_shape(d_g, block),
    }


def kfac_state_bytes(d_a: int, d_g: int, itemsize: int, block: int | None = None) -> int:
    """Bytes of one layer's K-FAC state as :class:`KFACState` holds it: the running A (d_a×d_a, dense also for an
    embedding's diagonal one; Σ sᵢ² blocked) and G, their eigenvectors (the same sizes) and eigenvalues (d_a + d_g),
    in the working dtype."""
    return (2 * (side_numbers(d_a, block) + side_numbers(d_g, block)) + d_a + d_g) * itemsize


def solve_work(d_a: int, d_g: int, method: str, blocks: tuple[int | None, int | None] = (None, None)) -> float:
    """Multiply-adds of solving a layer's two factors by ``kfac_method``, block by block (A's, G's ``blocks``):
    eigendecompositions, or damped inverses by Cholesky."""
    return (INVERSE_COST if method == "inverse" else EIGH_COST) * (cubes(d_a, blocks[0]) + cubes(d_g, blocks[1]))


@dataclass
class KFACState(LayerState):
    """Running Kronecker factors of one layer and their eigendecompositions.

    Its apply (:class:`~hylo.solvers.kfac_kernels.EigenKernel`) computes V̂ = Q_g [(Q_gᵀ ∇W Q_a) / (e_g e_aᵀ + λ)] Q_aᵀ,
    which is exactly (A ⊗ G + λI)⁻¹ vec ∇W for the stored A, G and the damping λ of the last update.
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
        """Preconditioned (d_g, d_a) gradient: the eigen kernel on a group of one."""
        return applied_alone(eigen_kernel([self]), self, grad, self.evecs_a.dtype)[0]

    @property
    def blocked(self) -> bool:
        """Whether a side holds packed blocks (docs/solvers.md, "Blocked factors")."""
        return self.evecs_a.dim() == 1 or self.evecs_g.dim() == 1

    def layouts(self) -> tuple[BlockLayout | None, BlockLayout | None]:
        """(G's, A's) block layouts (None: a dense side)."""
        return state_layouts(self.evecs_g, self.evecs_a, self.evals_g.shape[0], self.evals_a.shape[0])

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
        tensors = entry.get("tensors")
        shapes = held_shapes(tensors, d_a, d_g, eigen_shapes(d_a, d_g))
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
        """The running factors A (d_a × d_a) and G (d_g × d_g; packed blocks where blocked) in ``dtype``, else
        ``ValueError``."""
        shapes = held_shapes(carried, d_a, d_g, {"factor_a": (d_a, d_a), "factor_g": (d_g, d_g)})
        return checked_tensors(carried, shapes, dict.fromkeys(shapes, dtype), device)


def eigen_kernel(states: Sequence[KFACState]) -> EigenKernel:
    """The eigen method's kernel of ``states``: Q_a, Q_g and the divisors e_g e_aᵀ + λ stacked."""
    divisors = [torch.outer(s.evals_g, s.evals_a).add_(s.damping) for s in states]
    return EigenKernel([s.evecs_a for s in states], [s.evecs_g for s in states], divisors)


@dataclass
class KFACFactors:
    """A layer's running factors after this update's blend, and how the owner solves them (``method``); ``layouts``:
    A's and G's blocks (None: a dense side)."""

    factor_a: Tensor
    factor_g: Tensor
    method: str = "eigen"
    layouts: tuple[BlockLayout | None, BlockLayout | None] = (None, None)

    def widths(self) -> tuple[int, int]:
        """(d_a, d_g)."""
        return side_width(self.factor_a, self.layouts[0]), side_width(self.factor_g, self.layouts[1])


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


def eigen_template(factor_a: Tensor, factor_g: Tensor, widths: tuple[int, int] | None = None) -> dict[str, Tensor]:
    """Buffers for another rank's eigendecompositions of ``factor_a`` and ``factor_g`` (of ``widths`` (d_a, d_g)
    where a side is packed)."""
    d_a, d_g = widths or (factor_a.shape[0], factor_g.shape[0])
    return {
        "evals_a": factor_a.new_empty(d_a),
        "evecs_a": torch.empty_like(factor_a),
        "evals_g": factor_g.new_empty(d_g),
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
        options = context.options(KFACConfig)
        return [
            KFACFactors(factor_a, factor_g, options.kfac_method, factor_layouts(job))
            for job, (factor_a, factor_g) in zip(jobs, factors, strict=True)
        ]

    def cost(self, shape: LayerShape, solver: str, options: FamilyOptions) -> CostEstimate:
        """Factors n_k(d_a² + d_g²); by ``kfac_method``, eigendecompositions 4(d_a³ + d_g³) and rotations
        2 d_a d_g (d_a + d_g) a step, or damped inverses (d_a³ + d_g³) and two products d_a d_g (d_a + d_g).

        With P > 1 a rank sends and receives about 3(d_a² + d_g²) numbers per update: the
        all-reduce of A and G (twice their size) and the broadcast of the eigenvectors (or inverses).
        """
        d_a, d_g = shape.d_a, shape.d_g
        method, (block_a, block_g) = options(KFACConfig).kfac_method, shape.blocks
        squares = float(side_numbers(d_a, block_a) + side_numbers(d_g, block_g))
        exchanged = 3.0 * squares if shape.world_size > 1 else 0.0
        return CostEstimate(
            build=shape.kfac_rows * squares,
            solve=solve_work(d_a, d_g, method, shape.blocks),
            apply=(1.0 if method == "inverse" else 2.0)
            * d_a
            * d_g
            * (block_width(d_a, block_a) + block_width(d_g, block_g)),
            bytes=exchanged * shape.itemsize,
        )

    def solve_cost(self, prepared: KFACFactors) -> float:
        """The eigendecompositions' (or inverses') cost (block by block)."""
        layout_a, layout_g = prepared.layouts
        d_a, d_g = prepared.widths()
        work = cubes(d_a, layout_a.largest if layout_a else None) + cubes(d_g, layout_g.largest if layout_g else None)
        return (INVERSE_COST if prepared.method == "inverse" else EIGH_COST) * work

    def solve(self, prepared: Sequence[KFACFactors], context: UpdateContext) -> list[dict[str, Tensor]]:
        """Eigendecompositions of every A and G batched by shape (or, for the layers of the inverse method, their
        damped inverses, batched by shape); each layer's solution in its order."""
        out: list[dict[str, Tensor]] = [{} for _ in prepared]
        eigen = [i for i, f in enumerate(prepared) if f.method == "eigen"]
        sides = [
            (i, f, layout)
            for i in eigen
            for f, layout in zip(factors_of(prepared[i]), prepared[i].layouts, strict=True)
        ]
        units = [blocks(f, layout) for _, f, layout in sides]  # a blocked side's blocks, each decomposed alone
        results = iter(eigh_many([u for side in units for u in side]))
        solved = [
            decomposed(side, layout, [next(results) for _ in side])
            for side, (_, _, layout) in zip(units, sides, strict=True)
        ]
        for i, (ea, qa), (eg, qg) in zip(eigen, solved[0::2], solved[1::2], strict=True):
            out[i] = {"evals_a": ea, "evecs_a": qa, "evals_g": eg, "evecs_g": qg}
        inverse = [i for i, f in enumerate(prepared) if f.method == "inverse"]
        parts: list[list[Tensor]] = []
        for i in inverse:
            p = prepared[i]
            delta_a, delta_g = split_damping(p.factor_a, p.factor_g, context.damping, p.layouts)
            parts += [
                blocks(shifted(p.factor_a, p.layouts[0], delta_a), p.layouts[0]),
                blocks(shifted(p.factor_g, p.layouts[1], delta_g), p.layouts[1]),
            ]
        flat = iter(spd_inverse_many([u for side in parts for u in side]))
        inverses = [
            joined([next(flat) for _ in side], layout)
            for side, layout in zip(parts, inverse_layouts(prepared, inverse), strict=True)
        ]
        for i, inv_a, inv_g in zip(inverse, inverses[0::2], inverses[1::2], strict=True):
            out[i] = {"inverse_a": inv_a, "inverse_g": inv_g}
        return out

    def solution_template(self, prepared: KFACFactors) -> dict[str, Tensor]:
        """Buffers for another rank's eigendecompositions (or inverses)."""
        fa, fg = prepared.factor_a, prepared.factor_g
        if prepared.method == "inverse":
            return {"inverse_a": torch.empty_like(fa), "inverse_g": torch.empty_like(fg)}
        return eigen_template(fa, fg, prepared.widths())

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

    def state_bytes(self, d_a: int, d_g: int, itemsize: int, block: int | None = None) -> int | None:
        """:func:`kfac_state_bytes` (the eigen method's, the larger), a side wider than ``block`` in blocks."""
        return kfac_state_bytes(d_a, d_g, itemsize, block)

    def group_kernel(self, states: Sequence[LayerState], dtype: torch.dtype) -> GroupKernel:
        """:class:`~hylo.solvers.kfac_kernels.EigenKernel` or :class:`~hylo.solvers.kfac_kernels.InverseKernel`
        (the group key is the state's type), in the states' dtype (``dtype``, the layers' working dtype)."""
        inverse = [state for state in states if isinstance(state, KFACInverseState)]
        if len(inverse) == len(states):
            return inverse_kernel(inverse)
        return eigen_kernel([state for state in states if isinstance(state, KFACState)])

    refreshes = True

    def refresh(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[HeldState]:
        """The running factors blended with this step's batch factors; the eigendecompositions kept (KAISA's
        ``factor_update_freq``): they are redone from the running factors at the next update."""
        factors = running_factors(jobs, received, context.factor_decay, self.name)
        return refreshed_states(jobs, factors, (KFACState, KFACInverseState), self.name)
