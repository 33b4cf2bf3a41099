"""The low-rank family: SNGD, KID and KIS, one SMW solve on rows gathered from every rank.

docs/design.md, "SNGD", "KID", "KIS". The variants differ only in how a rank reduces its n
rows before the gather and how the gathered rows are weighted:

===========  =========================================  ================  =====================
variant      local reduction (r rows of n)              divisor D         interpolation weights
===========  =========================================  ================  =====================
``sngd``     identity (r = n)                           B = Σ n_p         none
``kid``      skeleton: greedy pivoted Cholesky on K     B = Σ n_p         W = blockdiag(W_p)
``kis``      sample ∝ ‖a_i‖²‖g_i‖², without replacement m = Σ r_p         none
===========  =========================================  ================  =====================

A new variant is a :class:`RowReduction` here and an entry in :data:`VARIANTS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

import torch
from torch import Tensor

from hylo.layers import LayerShape
from hylo.payload import Payload
from hylo.solvers.base import (
    Contribution,
    CostEstimate,
    Exchange,
    SolverFamily,
    UpdateContext,
    UpdateJob,
)
from hylo.solvers.reduce import kid_skeleton, kis_select
from hylo.solvers.smw import LowRankState, LowRankUpdate, smw_inners

#: Spacing of the per-layer seeds derived from an update's seed (a prime, so layers never collide).
_SEED_STRIDE = 7919


class RowReduction(ABC):
    """How one low-rank variant reduces a rank's rows and turns the gathered rows into a solve."""

    #: Whether the variant keeps every row (``r = n``) instead of the configured rank.
    keeps_all: ClassVar[bool] = False

    @abstractmethod
    def reduce(self, a: Tensor, g: Tensor, r: int, seed: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """The r kept rows of (a, g) and the local interpolation weights W_p (or None)."""

    @abstractmethod
    def update(self, a: Tensor, g: Tensor, counts: list[list[float]], weights: Tensor | None) -> LowRankUpdate:
        """The solve input from the gathered rows; ``counts`` holds each rank's [n_p, r_p]."""


class ExactRows(RowReduction):
    """SNGD: every row, divisor B."""

    keeps_all = True

    def reduce(self, a: Tensor, g: Tensor, r: int, seed: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Identity."""
        return a, g, None

    def update(self, a: Tensor, g: Tensor, counts: list[list[float]], weights: Tensor | None) -> LowRankUpdate:
        """All rows with divisor B."""
        return LowRankUpdate(a, g, sum(int(n) for n, _ in counts))


class SampledRows(RowReduction):
    """KIS: r rows drawn without replacement with probability ∝ ‖a_i‖²‖g_i‖², divisor m."""

    def reduce(self, a: Tensor, g: Tensor, r: int, seed: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """The sampled rows (all rows when r = n)."""
        if r < a.shape[0]:
            keep = kis_select(a, g, r, torch.Generator().manual_seed(seed))
            a, g = a.index_select(0, keep), g.index_select(0, keep)
        return a, g, None

    def update(self, a: Tensor, g: Tensor, counts: list[list[float]], weights: Tensor | None) -> LowRankUpdate:
        """The gathered samples with divisor m."""
        return LowRankUpdate(a, g, a.shape[0])


class SkeletonRows(RowReduction):
    """KID: a skeleton of r rows with interpolation weights W_p = Π Πᵀ, divisor B."""

    def reduce(self, a: Tensor, g: Tensor, r: int, seed: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Skeleton rows and W_p (W_p = I when r = n)."""
        n = a.shape[0]
        if r < n:
            keep, w_local = kid_skeleton(a, g, r)
            return a.index_select(0, keep), g.index_select(0, keep), w_local
        return a, g, torch.eye(n, dtype=a.dtype, device=a.device)

    def update(self, a: Tensor, g: Tensor, counts: list[list[float]], weights: Tensor | None) -> LowRankUpdate:
        """The gathered skeletons with divisor B and W = blockdiag(W_p)."""
        assert weights is not None, "KID rows travel with their interpolation weights"
        sizes = [int(r) for _, r in counts]
        flat_blocks = torch.split(weights.flatten(), [s * s for s in sizes])
        blocks = [block.reshape(s, s) for block, s in zip(flat_blocks, sizes, strict=True)]
        return LowRankUpdate(a, g, sum(int(n) for n, _ in counts), torch.block_diag(*blocks))


#: The low-rank variants by solver name.
VARIANTS: dict[str, RowReduction] = {"sngd": ExactRows(), "kid": SkeletonRows(), "kis": SampledRows()}


class LowRankFamily(SolverFamily[LowRankUpdate]):
    """SNGD/KID/KIS: local reduction, one all-gather of the kept rows, an SMW solve on the owner."""

    name = "lowrank"
    solvers = tuple(VARIANTS)
    state_type = LowRankState

    def contribute(self, jobs: Sequence[UpdateJob], context: UpdateContext) -> Contribution:
        """Per layer: kept rows a, g, KID's flattened W_p and this rank's [n, r]."""
        payload = Payload()
        for index, job in enumerate(jobs):
            variant = VARIANTS[job.solver]
            a, g = job.batch.lowrank_rows()
            n = a.shape[0]
            r = n if variant.keeps_all else job.batch.kept
            seed = (context.seed + _SEED_STRIDE * index + context.rank) % 2**63
            kept_a, kept_g, weights = variant.reduce(a, g, r, seed)
            fields = {"a": kept_a, "g": kept_g}
            if weights is not None:
                fields["weights"] = weights.reshape(-1, 1)
            fields["counts"] = a.new_tensor([[float(n), float(r)]])
            payload.add(job.name, fields)
        return Contribution(Exchange.ROWS, payload)

    def prepare(self, jobs: Sequence[UpdateJob], received: Payload, context: UpdateContext) -> list[LowRankUpdate]:
        """Gathered rows → SMW inputs (one host sync for every layer's row counts)."""
        if not jobs:
            return []
        counts = torch.stack([received[(job.name, "counts")] for job in jobs]).tolist()
        return [
            VARIANTS[job.solver].update(
                received[(job.name, "a")], received[(job.name, "g")], layer_counts, received.get((job.name, "weights"))
            )
            for job, layer_counts in zip(jobs, counts, strict=True)
        ]

    def cost(self, shape: LayerShape) -> CostEstimate:
        """Local kernel n²(d_a + d_g), gathered kernel and SMW m²(d_a + d_g) + m³, apply 2 m d_a d_g a step."""
        d_a, d_g, m = shape.d_a, shape.d_g, shape.kept
        return CostEstimate(
            build=shape.rows**2 * (d_a + d_g),
            solve=m**2 * (d_a + d_g) + m**3,
            apply=2.0 * m * d_a * d_g,
        )

    def solve_cost(self, prepared: LowRankUpdate) -> float:
        """The gathered kernel and the SMW solve."""
        a, g = prepared.a, prepared.g
        return self.cost(LayerShape(a.shape[1], g.shape[1], kept=a.shape[0])).solve

    def solve(self, prepared: Sequence[LowRankUpdate], context: UpdateContext) -> list[dict[str, Tensor]]:
        """M of every layer, equal sizes batched."""
        return [{"inner": inner} for inner in smw_inners(prepared, context.damping)]

    def solution_template(self, prepared: LowRankUpdate) -> dict[str, Tensor]:
        """A buffer for another rank's M."""
        m = prepared.a.shape[0]
        return {"inner": prepared.a.new_empty(m, m)}

    def assemble(self, prepared: LowRankUpdate, solution: Mapping[str, Tensor], context: UpdateContext) -> LowRankState:
        """Rows, M, divisor and damping."""
        return LowRankState(prepared.a, prepared.g, solution["inner"], float(prepared.divisor), context.damping)

    def carried(self, prepared: LowRankUpdate) -> dict[str, Tensor]:
        """Nothing: every update starts from its own batch."""
        return {}
