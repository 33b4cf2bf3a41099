"""The paper's studies at sampled update steps (docs/profiling.md, "Studies").

Both studies start from the **reference**: the exact SNGD solve on the update's gathered
batch — every rank's rows, divisor B — run through the same solver families and stage as
training, in a separate stage that training never sees (its states, generator and records
are untouched, so a run is bit-for-bit the same with and without the studies). For a
convolution the reference rows are its exact per-sample gradients when the gathered
m·d_a·d_g numbers fit ``study_exact_rows_mb`` on every rank (``"sngd-exact"``), else the
run's ``conv_rows`` form (``"sngd-sum"``/``"sngd-mean"``).

- **rank**: the eigenvalues of K/B (K the reference rows' kernel) and the numerical rank at
  90/99/99.9% of their sum (the trace).
- **grad_error**: for each method the relative error ‖v − v_ref‖/‖v_ref‖ of the preconditioned
  gradient against the reference's: a solver that keeps r of n rows (KID, KIS, a registered
  variant) on the reference rows with r = ⌊ρ·n⌋ per rank at each ratio ρ, one that solves on all
  rows (SNGD) on the run's own rows, and K-FAC from the batch's own factors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from hylo.config import HyLoConfig
from hylo.distributed import Communicator
from hylo.layers.batch import LayerBatch
from hylo.layers.gradmatrix import GradMatrix
from hylo.layers.math import LayerMath
from hylo.layers.rows import SampleRows
from hylo.pipeline.placement import Local
from hylo.pipeline.stage import UpdateStage
from hylo.records import ErrorRecord, RankRecord
from hylo.solvers import family_of
from hylo.solvers.base import LayerState, UpdateContext, UpdateJob
from hylo.solvers.lowrank import ADAPTIVE
from hylo.solvers.smw import LowRankState

#: Shares of the trace at which rank-analysis.csv reports the numerical rank.
RANK_LEVELS = (0.9, 0.99, 0.999)


def kernel_spectrum(rows: SampleRows, divisor: float) -> Tensor:
    """Eigenvalues of K/B for the rows' kernel K, in float64, descending, clamped at 0."""
    kernel = rows.to(torch.float64).kernel() / divisor
    return torch.linalg.eigvalsh(kernel).flip(0).clamp(min=0.0)


def numerical_ranks(eigenvalues: Tensor, levels: Sequence[float] = RANK_LEVELS) -> list[int]:
    """For descending eigenvalues ≥ 0: the fewest leading ones whose sum reaches each share of the total."""
    total = float(eigenvalues.sum())
    if eigenvalues.numel() == 0 or total <= 0:
        return [0] * len(levels)
    cumulative = torch.cumsum(eigenvalues, 0) / total
    # a share within rounding of the level counts as reaching it (rank-one data gives 1 − 1e-16)
    targets = torch.tensor([level - 1e-12 for level in levels], dtype=cumulative.dtype)
    found = torch.searchsorted(cumulative, targets)
    return [min(int(i) + 1, eigenvalues.numel()) for i in found]


class StudyRunner:
    """Runs the rank and gradient-error studies at an update step; rank 0 gets the records."""

    def __init__(self, comm: Communicator, layers: Mapping[str, LayerMath]) -> None:
        self.comm = comm
        self.stage = UpdateStage(comm)
        #: Every rank holds every state the studies solve (no FSDP2: whole gradients).
        self.sharing = Local(self.stage)
        self._exact: dict[str, LayerMath] = {}
        self._form: dict[str, str] = {}
        for name, math_ in layers.items():
            exact = math_.exact_rows_math()
            if exact is not None:
                self._exact[name] = exact
                self._form[name] = f"sngd-{math_.rows_form}"
            else:
                self._form[name] = "sngd-exact"

    def _reference_batches(
        self, names: Sequence[str], batches: Sequence[LayerBatch], config: HyLoConfig
    ) -> tuple[list[LayerBatch], list[str]]:
        """Each layer's batch with exact per-sample rows where every rank can afford them, and its name."""
        cap = config.telemetry.study_exact_rows_mb * 2**20
        affordable = torch.tensor(
            [
                name in self._exact
                and self.comm.world_size * batch.rows * batch.math.d_a * batch.math.d_g * batch.math.dtype.itemsize
                <= cap
                for name, batch in zip(names, batches, strict=True)
            ]
        )
        if self.comm.world_size > 1:
            affordable = self.comm.all_true(affordable)
        chosen, forms = [], []
        for name, batch, exact in zip(names, batches, affordable.tolist(), strict=True):
            if exact:
                chosen.append(dataclasses.replace(batch, math=self._exact[name]))
                forms.append("sngd-exact")
            else:
                chosen.append(batch)
                forms.append(self._form[name])
        return chosen, forms

    def _solve(
        self, names: Sequence[str], solver: str, batches: Sequence[LayerBatch], context: UpdateContext
    ) -> dict[str, LayerState]:
        """The states of ``solver`` on ``batches`` (every rank holds every state); non-finite ones left out."""
        jobs = [UpdateJob(name, solver, batch, None) for name, batch in zip(names, batches, strict=True)]
        result = self.stage.update(jobs, context, self.sharing)
        return {
            name: state
            for name, state in result.states.items()
            if name not in result.rejected and isinstance(state, LayerState)
        }

    def run(
        self,
        step: int,
        names: Sequence[str],
        batches: Sequence[LayerBatch],
        grads: Sequence[GradMatrix],
        context: UpdateContext,
        config: HyLoConfig,
        rank: bool,
        grad_error: bool,
    ) -> tuple[list[RankRecord], list[ErrorRecord]]:
        """The studies' records for this update (empty on ranks other than 0; every rank takes part)."""
        context = dataclasses.replace(context, seed=(config.lowrank.seed * 1_000_003 + step) % 2**62)
        reference_batches, forms = self._reference_batches(names, batches, config)
        reference = self._solve(names, "sngd", reference_batches, context)
        lead = self.comm.rank == 0
        rank_records: list[RankRecord] = []
        if rank and lead:
            for name, form in zip(names, forms, strict=True):
                state = reference.get(name)
                if not isinstance(state, LowRankState):
                    continue
                spectrum = kernel_spectrum(state.rows, state.divisor)
                rank_records.append(
                    RankRecord(
                        name,
                        state.rows.count,
                        form,
                        numerical_ranks(spectrum),
                        spectrum[: config.telemetry.rank_top_k].tolist(),
                    )
                )
        if not grad_error:
            return rank_records, []

        grad_of = dict(zip(names, grads, strict=True))
        targets = {name: state.precondition(grad_of[name]) for name, state in reference.items()} if lead else {}
        ratios = config.telemetry.grad_error_ratios or (config.lowrank.rank_ratio,)
        rows: list[tuple[str, str, float | str | None]] = []
        errors: list[Tensor] = []
        for method in config.telemetry.grad_error_methods:
            family = family_of(method)
            for ratio in ratios if family.reduces_rows(method) else (None,):
                method_context = context
                if family.solves_rows(method) and ratio is None:  # exact SNGD on the run's own rows
                    method_batches = list(batches)
                elif ratio is None:
                    method_batches = list(reference_batches)
                else:
                    cap = config.lowrank.rank if ratio == ADAPTIVE else None  # a fixed ρ is measured at ρ itself
                    lowrank = dataclasses.replace(config.lowrank, rank_ratio=ratio, rank=cap)
                    method_batches = [dataclasses.replace(b, kept=lowrank.rows_kept(b.rows)) for b in reference_batches]
                    method_context = dataclasses.replace(context, options=context.options.replaced(lowrank))
                states = self._solve(names, method, method_batches, method_context)
                if not lead:
                    continue
                for name, target in targets.items():
                    if name not in states:
                        continue
                    v = states[name].precondition(grad_of[name]).to(torch.float64)
                    ref = target.to(torch.float64)
                    errors.append(torch.linalg.vector_norm(v - ref) / torch.linalg.vector_norm(ref))
                    rows.append((name, method, ratio))
        values = torch.stack(errors).tolist() if errors else []
        form_of = dict(zip(names, forms, strict=True))
        return rank_records, [
            ErrorRecord(name, method, ratio, value, form_of[name])
            for (name, method, ratio), value in zip(rows, values, strict=True)
        ]
