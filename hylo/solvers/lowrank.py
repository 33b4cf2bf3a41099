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
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from hylo.distributed.payload import Payload
from hylo.layers.batch import LayerBatch, LayerShape
from hylo.layers.rows import SampleRows, rows_from_fields
from hylo.layers.statistics import ROWS
from hylo.solvers.base import (
    Contribution,
    CostEstimate,
    Exchange,
    SolverFamily,
    UpdateContext,
    UpdateJob,
)
from hylo.solvers.reduce import kid_skeleton, kis_select, priority_sample
from hylo.solvers.smw import LowRankState, LowRankUpdate, smw_inners


def rows_for_ratio(ratio: float, rows: int) -> int:
    """r = max(1, ⌊ρ·n⌋), at most n: the rows a rank keeps out of n at rank ratio ρ."""
    return min(rows, max(1, math.floor(ratio * rows)))


#: Spacing of the per-layer seeds derived from an update's seed (a prime, so layers never collide).
_SEED_STRIDE = 7919


class RowReduction(ABC):
    """How one low-rank variant reduces a rank's rows and turns the gathered rows into a solve (public:
    subclass it and register it with :func:`hylo.register_variant`, docs/extending.md).

    On every rank, :meth:`reduce` keeps r of the rank's n per-sample gradients (r from
    ``rank_ratio``/``rank``, or n when :attr:`keeps_all`), optionally with interpolation weights
    W_p; after the all-gather, :meth:`update` turns every rank's kept rows into the SMW solve's
    input. The solve and the preconditioned gradient are the family's (docs/solvers.md, "SNGD").
    """

    #: Whether the variant keeps every row (``r = n``) instead of the configured rank.
    keeps_all: ClassVar[bool] = False

    @abstractmethod
    def reduce(self, rows: SampleRows, r: int, seed: int, context: UpdateContext) -> tuple[SampleRows, Tensor | None]:
        """The r kept rows and the local interpolation weights W_p (or None)."""

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

    def reduce(self, rows: SampleRows, r: int, seed: int, context: UpdateContext) -> tuple[SampleRows, Tensor | None]:
        """The sampled rows (all rows when r = n), rescaled in the unbiased form."""
        if r >= rows.count:
            return rows, None
        generator = torch.Generator().manual_seed(seed)
        if context.kis_estimator == "hylo":
            return rows.select(kis_select(rows.sq_norms(), r, generator)), None
        keep, factors = priority_sample(rows.sq_norms(), r, generator)
        return rows.select(keep).scaled(factors.sqrt()), None

    def update(
        self, rows: SampleRows, counts: list[list[float]], weights: Tensor | None, context: UpdateContext
    ) -> LowRankUpdate:
        """The gathered samples with divisor B (``"hylo"``: m)."""
        divisor = rows.count if context.kis_estimator == "hylo" else _total_rows(counts)
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

    def reduce(self, rows: SampleRows, r: int, seed: int, context: UpdateContext) -> tuple[SampleRows, Tensor | None]:
        """Skeleton rows and W_p (W_p = I when r = n); r columns of the local kernel, in float64."""
        n = rows.count
        if r < n:
            keep, w_local = kid_skeleton(rows, r)
            return rows.select(keep), w_local.to(rows.dtype)
        return rows, torch.eye(n, dtype=rows.dtype, device=rows.device)

    def update(
        self, rows: SampleRows, counts: list[list[float]], weights: Tensor | None, context: UpdateContext
    ) -> LowRankUpdate:
        """The gathered skeletons with divisor B and W = blockdiag(W_p)."""
        assert weights is not None, "KID rows travel with their interpolation weights"
        sizes = [int(r) for _, r in counts]
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
            seed = (context.seed + _SEED_STRIDE * index + context.rank) % 2**63
            kept, weights = variant.reduce(rows, r, seed, context)
            fields = kept.fields()
            if weights is not None:
                fields["weights"] = weights.reshape(-1, 1)
            fields["counts"] = torch.tensor([[float(n), float(r)]], dtype=kept.dtype, device=kept.device)
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
            prepared.append(self.variant(job.solver).update(rows, layer_counts, fields.get("weights"), context))
        return prepared

    def rows_kept(self, batch: LayerBatch, solver: str) -> int:
        """n for ``sngd``, the configured r for ``kid``/``kis``."""
        return batch.rows if self.variant(solver).keeps_all else batch.kept

    def cost(self, shape: LayerShape, solver: str) -> CostEstimate:
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
