"""The low-rank family: SNGD, KID and KIS, one SMW solve on rows gathered from every rank.

docs/solvers.md, "SNGD", "KID", "KIS". The variants differ only in how a rank reduces its n
per-sample gradients before the gather and how the gathered rows are weighted:

===========  ============================================  =================  =====================
variant      local reduction (r rows of n)                 divisor D          interpolation weights
===========  ============================================  =================  =====================
``sngd``     identity (r = n)                              B = Σ n_p          none
``kid``      skeleton: greedy pivoted Cholesky on K        B = Σ n_p          W = blockdiag(W_p)
``kis``      priority sample ∝ ‖U_i‖², rows × √(HT factor)  B = Σ n_p          none
``kis``      (``kis_estimator="hylo"``) sample ∝ ‖U_i‖²     m = Σ r_p          none
===========  ============================================  =================  =====================

A variant is a :class:`RowReduction`; the built-in ones are registered in :mod:`hylo.solvers`,
and :func:`hylo.register_variant` adds one from user code (docs/extending.md).
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor

from hylo.layers.batch import LayerBatch, LayerShape
from hylo.layers.rows import SampleRows, rows_from_fields
from hylo.layers.statistics import ROWS
from hylo.payload import Payload
from hylo.rules import COUNT, RATIO, Rule, Section, is_bool, option
from hylo.solvers.base import (
    Contribution,
    CostEstimate,
    FamilyOptions,
    LayerState,
    SolverFamily,
    UpdateContext,
    UpdateJob,
)
from hylo.solvers.kernel import Exchange, GroupKernel
from hylo.solvers.reduce import dropped_mass, kid_skeleton, kis_select, priority_sample, sketched_rank
from hylo.solvers.smw import LowRankState, LowRankUpdate, lowrank_kernel, smw_inners

#: ``rank_ratio``'s value that lets each layer's kernel spectrum choose its rank (docs/solvers.md, "Adaptive rank").
ADAPTIVE = "auto"


def rows_for_ratio(ratio: float, rows: int) -> int:
    """r = max(1, ⌊ρ·n⌋), at most n: the rows a rank keeps out of n at rank ratio ρ."""
    return min(rows, max(1, math.floor(ratio * rows)))


#: KIS's estimator (see :class:`LowRankConfig`).
KISEstimator = Literal["unbiased", "hylo"]


@dataclass(frozen=True)
class LowRankConfig(Section):
    """The low-rank solvers' options: how many rows KID and KIS keep — a fixed ρ or rank, or ``"auto"`` — and KIS's
    draws (docs/solvers.md, "Adaptive rank")."""

    section_name: ClassVar[str | None] = "lowrank"

    rank_ratio: float | Literal["auto"] = option(
        0.1,
        doc="ρ ∈ (0, 1]: KID and KIS keep r = max(1, ⌊ρ·n⌋) of a rank's n rows; 'auto': each layer keeps as "
        'many as rank_energy asks, at most the cap (docs/solvers.md, "Adaptive rank")',
        rule=Rule(lambda x: x == ADAPTIVE or RATIO.holds(x), "in (0, 1] or 'auto'"),
    )
    rank: int | None = option(
        None,
        doc="absolute rows r >= 1 kept per rank (overrides rank_ratio; under 'auto', the cap); r >= n is exact SNGD",
        rule=Rule(COUNT.holds, "an int >= 1 (rows kept per rank)"),
    )
    rank_energy: float = option(
        0.99,
        doc="under rank_ratio='auto': e ∈ (0, 1]; a rank keeps the fewest rows whose kernel leaves out at most "
        "(1 − e)·λ of the trace of its Fisher estimate (the damped kernel K/n + λI loses at most 1 − e of one "
        "damping floor); 1 keeps the cap",
        rule=RATIO,
    )
    rank_cap: float = option(
        0.25,
        doc="under rank_ratio='auto': the most rows a rank keeps, max(1, ⌊rank_cap·n⌋) of its n (rank, when "
        "given, is the cap instead)",
        rule=RATIO,
    )
    seed: int = option(
        0,
        doc="seed of the preconditioner's own generator (KIS draws, the studies' draws), an int in [0, 2⁶³)",
        rule=Rule(
            lambda x: not is_bool(x) and isinstance(x, numbers.Integral) and 0 <= int(x) < 2**63,
            "an int in [0, 2**63)",
        ),
    )
    kis_estimator: KISEstimator = option(
        "unbiased",
        doc="'unbiased': priority sampling with Horvitz–Thompson weights, divisor B (E[F̂] = F); 'hylo': "
        "HyLo's unweighted draw, divisor m",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self._set("seed", int(self.seed))

    @property
    def adaptive(self) -> bool:
        """Whether each layer's rank follows its kernel spectrum (``rank_ratio="auto"``)."""
        return self.rank_ratio == ADAPTIVE

    @property
    def energy(self) -> float | None:
        """The energy target the reductions stop at (``rank_energy``), None at a fixed rank."""
        return self.rank_energy if self.adaptive else None

    def rows_kept(self, local_rows: int) -> int:
        """Rows r each rank keeps for KID/KIS out of ``local_rows``; under ``"auto"`` the most it keeps (the cap)."""
        if self.rank is not None:
            return min(self.rank, local_rows)
        ratio = self.rank_cap if self.adaptive else self.rank_ratio
        return rows_for_ratio(float(ratio), local_rows)

    def expected_rows(self, local_rows: int, last: tuple[int, int] | None) -> int:
        """The rows r the cost model expects a rank to keep out of ``local_rows``: :meth:`rows_kept` at a fixed
        rank; under ``"auto"`` the share the layer's last low-rank update kept, ``last`` = (rows kept, rows) over
        all ranks, scaled to ``local_rows`` (the cap before any; docs/hybrid-policy.md, "Cost model")."""
        cap = self.rows_kept(local_rows)
        if not self.adaptive or last is None or last[1] <= 0:
            return cap
        return min(cap, max(1, math.ceil(last[0] * local_rows / last[1])))


#: Spacing of the per-layer seeds derived from an update's seed (a prime, so layers never collide).
_SEED_STRIDE = 7919


class RowReduction(ABC):
    """How one low-rank variant reduces a rank's rows and turns the gathered rows into a solve (public:
    subclass it and register it with :func:`hylo.register_variant`, docs/extending.md).

    On every rank, :meth:`reduce` keeps r of the rank's n per-sample gradients (r from
    ``rank_ratio``/``rank``, or n when :attr:`keeps_all`), optionally with interpolation weights
    W_p; after the all-gather, :meth:`update` turns every rank's kept rows into the SMW solve's
    input. The solve and the preconditioned gradient are the family's (docs/solvers.md, "SNGD").
    Under ``rank_ratio="auto"`` r is the cap and ``context.options(LowRankConfig).energy`` the energy target: a variant
    that :attr:`adapts_rank` keeps as few rows as the target allows (it may return fewer than r).
    """

    #: Whether the variant keeps every row (``r = n``) instead of the configured rank.
    keeps_all: ClassVar[bool] = False
    #: Whether :meth:`reduce` chooses its rank from ``context.options(LowRankConfig).energy`` under
    #: ``rank_ratio="auto"``.
    adapts_rank: ClassVar[bool] = False

    @classmethod
    def runs_adaptive(cls) -> bool:
        """Whether the variant can run under ``rank_ratio="auto"``: it chooses its rank, or keeps every row."""
        return cls.adapts_rank or cls.keeps_all

    @abstractmethod
    def reduce(self, rows: SampleRows, r: int, seed: int, context: UpdateContext) -> tuple[SampleRows, Tensor | None]:
        """The r kept rows (at most r under ``rank_ratio="auto"``) and the local interpolation weights W_p (or
        None, else one row and column per kept row)."""

    @abstractmethod
    def update(
        self, rows: SampleRows, counts: list[list[float]], weights: Tensor | None, context: UpdateContext
    ) -> LowRankUpdate:
        """The solve input from the gathered rows; ``counts`` holds each rank's [n_p, r_p]."""

    def local_work(self, shape: LayerShape) -> float:
        """Multiply-adds of the local reduction of ``shape.rows`` rows (for the cost model)."""
        return 0.0


def _total_rows(counts: list[list[float]]) -> int:
    return sum(int(n) for n, _ in counts)


class ExactRows(RowReduction):
    """SNGD: every row, divisor B."""

    keeps_all = True

    def reduce(self, rows: SampleRows, r: int, seed: int, context: UpdateContext) -> tuple[SampleRows, Tensor | None]:
        """Identity."""
        return rows, None

    def update(
        self, rows: SampleRows, counts: list[list[float]], weights: Tensor | None, context: UpdateContext
    ) -> LowRankUpdate:
        """All rows with divisor B."""
        return LowRankUpdate(rows, _total_rows(counts))


class SampledRows(RowReduction):
    """KIS: r rows per rank by importance ∝ ‖U_i‖², without replacement.

    ``kis_estimator="unbiased"`` (default): priority sampling, each kept row scaled by the
    square root of its Horvitz–Thompson factor and divisor B, so E[F̂] = F on every rank's
    stratum and hence overall. ``"hylo"``: HyLo's form, sequential sampling ∝ ‖U_i‖² and
    divisor m with no weights (biased towards the heavy rows by up to B/m).
    """

    adapts_rank = True

    def reduce(self, rows: SampleRows, r: int, seed: int, context: UpdateContext) -> tuple[SampleRows, Tensor | None]:
        """The sampled rows (all rows when r = n), rescaled in the unbiased form; under ``rank_ratio="auto"`` r
        from the spectrum of a sketch of r rows (:func:`~hylo.solvers.reduce.sketched_rank`)."""
        generator = torch.Generator().manual_seed(seed)
        if r >= rows.count:
            return rows, None
        weights = rows.sq_norms()
        options = context.options(LowRankConfig)
        if options.energy is not None:
            r = sketched_rank(rows, weights, r, dropped_mass(rows, context.damping, options.energy), generator)
        if options.kis_estimator == "hylo":
            return rows.select(kis_select(weights, r, generator)), None
        keep, factors = priority_sample(weights, r, generator)
        return rows.select(keep).scaled(factors.sqrt()), None

    def update(
        self, rows: SampleRows, counts: list[list[float]], weights: Tensor | None, context: UpdateContext
    ) -> LowRankUpdate:
        """The gathered samples with divisor B (``"hylo"``: m)."""
        divisor = rows.count if context.options(LowRankConfig).kis_estimator == "hylo" else _total_rows(counts)
        return LowRankUpdate(rows, divisor)

    def local_work(self, shape: LayerShape) -> float:
        """The n row norms."""
        return float(shape.rows) * shape.row_width


#: Multiply-adds of the cost model per multiply-add of KID's pivoted Cholesky: r sequential steps in float64 run
#: about ten times slower per multiply-add than the float32 matrix products the other terms count (docs/hybrid-policy.md,
#: "Cost model").
PIVOT_WORK_WEIGHT = 10.0


class SkeletonRows(RowReduction):
    """KID: a skeleton of r rows with interpolation weights W_p = Π Πᵀ, divisor B."""

    adapts_rank = True

    def reduce(self, rows: SampleRows, r: int, seed: int, context: UpdateContext) -> tuple[SampleRows, Tensor | None]:
        """Skeleton rows and W_p (W_p = I when r = n); r columns of the local kernel, in float64. Under
        ``rank_ratio="auto"`` the pivoted Cholesky stops once the rows left carry at most the allowed mass."""
        n = rows.count
        if r < n:
            energy = context.options(LowRankConfig).energy
            stop = None if energy is None else dropped_mass(rows, context.damping, energy)
            keep, w_local = kid_skeleton(rows, r, stop)
            return rows.select(keep), w_local.to(rows.dtype)
        return rows, torch.eye(n, dtype=rows.dtype, device=rows.device)

    def update(
        self, rows: SampleRows, counts: list[list[float]], weights: Tensor | None, context: UpdateContext
    ) -> LowRankUpdate:
        """The gathered skeletons with divisor B and W = blockdiag(W_p)."""
        assert weights is not None, "KID rows travel with their interpolation weights"
        sizes = [int(r) for _, r in counts]  # each rank's own r_p (under "auto" they differ)
        flat_blocks = torch.split(weights.flatten(), [s * s for s in sizes])
        blocks = [block.reshape(s, s) for block, s in zip(flat_blocks, sizes, strict=True)]
        return LowRankUpdate(rows, _total_rows(counts), torch.block_diag(*blocks))

    def local_work(self, shape: LayerShape) -> float:
        """r columns of the local kernel and the pivoted Cholesky (never the n×n kernel), weighted by
        :data:`PIVOT_WORK_WEIGHT`: they run in float64, r sequential steps."""
        rows, kept = float(shape.rows), float(shape.kept_local)
        return PIVOT_WORK_WEIGHT * (rows * kept * shape.row_width + rows * kept**2)


def _solve_work(m: int, row_width: int) -> float:
    """The gathered kernel m²·w and the m×m SMW inverse m³."""
    return float(m) ** 2 * row_width + float(m) ** 3


class LowRankFamily(SolverFamily[LowRankUpdate]):
    """SNGD/KID/KIS and registered variants: local reduction, one all-gather of the kept rows, an SMW
    solve on the owner."""

    name = "lowrank"
    state_type = LowRankState
    statistic = ROWS
    section = LowRankConfig

    def __init__(self) -> None:
        #: The variants by solver name, in registration order.
        self.variants: dict[str, RowReduction] = {}

    @property
    def solvers(self) -> tuple[str, ...]:
        """The registered variants' names."""
        return tuple(self.variants)

    def variant(self, solver: str) -> RowReduction:
        """The row reduction of ``solver``; ``ValueError`` once it is no longer registered."""
        try:
            return self.variants[solver]
        except KeyError:
            raise ValueError(f"low-rank variant {solver!r} is not registered (any more): register it again") from None

    def reduces_rows(self, solver: str) -> bool:
        """Every variant but those that keep all rows (SNGD)."""
        return not self.variant(solver).keeps_all

    def solves_rows(self, solver: str) -> bool:
        """Every variant."""
        return True

    def contribute(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> Contribution:
        """Per layer: the kept rows' fields, KID's flattened W_p and this rank's [n, r]."""
        payload = Payload()
        for index, job in enumerate(jobs):
            variant = self.variant(job.solver)
            rows = job.batch.collect(ROWS)
            context.watch.lap("capture", job.name)
            n, r = rows.count, self.rows_kept(job.batch, job.solver)
            if context.options(LowRankConfig).energy is not None and not variant.runs_adaptive():
                raise ValueError(
                    f"low-rank variant {job.solver!r} does not choose its rank (adapts_rank is False): "
                    "rank_ratio='auto' needs kid, kis or a variant that does"
                )
            seed = (context.seed + _SEED_STRIDE * index + context.rank) % 2**63
            kept, weights = variant.reduce(rows, r, seed, context)
            fields = kept.fields()
            if weights is not None:
                fields["weights"] = weights.reshape(-1, 1)
            counts = [float(n), float(kept.count)]
            fields["counts"] = torch.tensor([counts], dtype=kept.dtype, device=kept.device)
            payload.add(job.name, fields)
            context.watch.lap("reduce", job.name)
        return Contribution(Exchange.ROWS, payload)

    def prepare(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[LowRankUpdate]:
        """Gathered rows → SMW inputs (one host sync for every layer's row counts)."""
        if not jobs:
            return []
        counts = torch.stack([received[(job.name, "counts")] for job in jobs]).tolist()
        prepared = []
        for job, layer_counts in zip(jobs, counts, strict=True):
            fields = received.fields(job.name)
            rows = rows_from_fields(fields, job.batch.math.d_g, job.batch.math.d_a)
            update = self.variant(job.solver).update(rows, layer_counts, fields.get("weights"), context)
            update.counts = tuple((int(n), int(r)) for n, r in layer_counts)
            prepared.append(update)
        return prepared

    def rows_kept(self, batch: LayerBatch, solver: str) -> int:
        """n for ``sngd``, the configured r for ``kid``/``kis``."""
        return batch.rows if self.variant(solver).keeps_all else batch.kept

    def cost(self, shape: LayerShape, solver: str, options: FamilyOptions) -> CostEstimate:
        """Rows and local reduction; gathered kernel m²·w and SMW m³; apply 2 m d_a d_g a step.

        m = P·n for ``sngd`` and P·r for ``kid``/``kis``; w = d_a + d_g for factored rows and
        d_a·d_g for dense ones. With P > 1 every rank receives the m gathered rows and M.
        """
        variant = self.variant(solver)
        m = shape.world_size * (shape.rows if variant.keeps_all else shape.kept_local)
        exchanged = float(m) * shape.row_width + float(m) ** 2 if shape.world_size > 1 else 0.0
        return CostEstimate(
            build=shape.row_work + variant.local_work(shape),
            solve=_solve_work(m, shape.row_width),
            apply=2.0 * m * shape.d_a * shape.d_g,
            bytes=exchanged * shape.itemsize,
        )

    def rows_chosen(self, prepared: LowRankUpdate) -> tuple[tuple[int, int], ...] | None:
        """Each rank's (n_p, r_p), as gathered: the same on every rank."""
        return prepared.counts

    def solve_cost(self, prepared: LowRankUpdate) -> float:
        """The gathered kernel and the SMW solve."""
        rows = prepared.rows
        return _solve_work(rows.count, rows.row_width)

    def solve(self, prepared: Sequence[LowRankUpdate], context: UpdateContext) -> list[dict[str, Tensor]]:
        """M of every layer, equal sizes batched."""
        return [{"inner": inner} for inner in smw_inners(prepared, context.damping)]

    def solution_template(self, prepared: LowRankUpdate) -> dict[str, Tensor]:
        """A buffer for another rank's M (float64, as :func:`~hylo.solvers.smw.smw_inners` solves it)."""
        m = prepared.rows.count
        return {"inner": torch.empty(m, m, dtype=torch.float64, device=prepared.rows.device)}

    def assemble(self, prepared: LowRankUpdate, solution: Mapping[str, Tensor], context: UpdateContext) -> LowRankState:
        """Rows, M, divisor and damping."""
        return LowRankState(prepared.rows, solution["inner"], float(prepared.divisor), context.damping)

    def carried(self, prepared: LowRankUpdate) -> dict[str, Tensor]:
        """Nothing: every update starts from its own batch."""
        return {}

    def group_key(self, state: LayerState) -> Hashable:
        """The state's type, its rows' form (factored rows of any count share a group: they are padded) and λ
        (one per group: the layers of one update share it)."""
        rows = state.rows if isinstance(state, LowRankState) else None
        return type(state), type(rows), state.damping

    def group_kernel(self, states: Sequence[LayerState], dtype: torch.dtype) -> GroupKernel:
        """:class:`~hylo.solvers.smw.FactoredKernel`, :class:`~hylo.solvers.smw.OneHotKernel` (an embedding's rows)
        or :class:`~hylo.solvers.smw.DenseKernel` (a convolution's exact per-sample gradients), by the rows' form."""
        return lowrank_kernel([state for state in states if isinstance(state, LowRankState)], dtype)
