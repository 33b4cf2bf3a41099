"""What a preconditioner writes into ``profile_dir``: one method per file (docs/profiling.md, "Files").

Every rank: ``timing-r{rank}.csv`` (per update step and layer) and ``steps-r{rank}.csv`` (per
step). Rank 0: ``decisions.csv``, ``run.json`` and the studies' ``grad-norm.csv``,
``rank-analysis.csv``, ``grad-error.csv``. Per-step gradient norms stay on the device until
the next flush (one host transfer per update, none per step).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from hylo.records import Decision, ErrorRecord, RankRecord
from hylo.telemetry.profiling import PHASES, STEP_SLOTS, StepTimes
from hylo.telemetry.recording import CsvLog, ProfileFiles
from hylo.telemetry.studies import RANK_LEVELS

_PHASE_MS = tuple(f"{phase}_ms" for phase in PHASES)
TIMING_COLUMNS = (
    "step",
    "layer",
    "solver",
    "rows",
    "rows_kept",
    "d_a",
    "d_g",
    *_PHASE_MS,
    "bytes_sent",
    "bytes_held",
    "hook_ms",
)
STEPS_COLUMNS = ("step", "kind", "step_ms", *(f"{slot}_ms" for slot in STEP_SLOTS), *_PHASE_MS, "bytes_sent", "hook_ms")
GRAD_NORM_COLUMNS = ("step", "layer", "norm", "ema", "trend", "critical", "norm_after")
GRAD_ERROR_COLUMNS = ("step", "layer", "method", "rank_ratio", "rel_error", "reference")
DECISION_COLUMNS = (
    "step",
    "layer",
    "solver",
    "reason",
    "trend",
    "cost_kfac",
    "cost_lowrank",
    "cost_sngd",
    "critical",
    "rows_kept",
)


def decision_columns(extra: Sequence[str], notes: Sequence[str] = ()) -> tuple[str, ...]:
    """Columns of decisions.csv: :data:`DECISION_COLUMNS`, then ``cost_<name>`` of each ``extra`` solver
    (the variants registered beyond the built-in ones), then the registered families' ``notes`` columns."""
    return (*DECISION_COLUMNS, *(f"cost_{name}" for name in extra), *notes)


def rank_columns(top_k: int) -> tuple[str, ...]:
    """Columns of rank-analysis.csv with ``top_k`` eigenvalue columns."""
    levels = tuple(f"rank_{str(level)[2:].ljust(2, '0')}" for level in RANK_LEVELS)
    return ("step", "layer", "batch_rows", "reference", *levels, *(f"sv_{i}" for i in range(1, top_k + 1)))


@dataclass(frozen=True)
class LayerTiming:
    """One layer's row of timing-r{rank}.csv, without the times."""

    name: str
    solver: str
    rows: int
    rows_kept: int
    d_a: int
    d_g: int
    bytes_sent: int
    bytes_held: int


class NormBuffer:
    """Per-step gradient norms kept on the device, turned into grad-norm.csv rows at a flush."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._steps: list[tuple[int, Tensor, list[float | None], list[bool]]] = []

    def add(self, step: int, values: Tensor, trend: list[float | None], critical: list[bool]) -> None:
        """One step: ``values`` rows are (norm, ema, norm_after) per layer, on the device."""
        self._steps.append((step, values, list(trend), list(critical)))

    def write(self, log: CsvLog) -> None:
        """Queue every buffered step's rows (one host transfer)."""
        if not self._steps:
            return
        values = torch.stack([entry[1] for entry in self._steps]).tolist()
        for (step, _, trend, critical), (norm, ema, after) in zip(self._steps, values, strict=True):
            for i, name in enumerate(self.names):
                log.add((step, name, norm[i], ema[i], trend[i], critical[i], after[i]))
        self._steps = []


class Recorder:
    """The open files of one preconditioner on one rank."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int,
        append: bool,
        names: Sequence[str],
        studies: Sequence[str],
        top_k: int,
        run: dict[str, object],
        extra_solvers: Sequence[str] = (),
        notes: Sequence[str] = (),
    ) -> None:
        self.files = ProfileFiles(directory, rank, append)
        self.timing = self.files.open(f"timing-r{rank}.csv", TIMING_COLUMNS)
        self.steps = self.files.open(f"steps-r{rank}.csv", STEPS_COLUMNS)
        self.lead = rank == 0
        self.norms: NormBuffer | None = None
        self.decisions = self.rank = self.errors = None
        if self.lead:
            self.decisions = self.files.open("decisions.csv", decision_columns(extra_solvers, notes))
            if "grad_norm" in studies:
                self.norms = NormBuffer(names)
                self.files.open("grad-norm.csv", GRAD_NORM_COLUMNS, self.norms.write)
            if "rank" in studies:
                self.rank = self.files.open("rank-analysis.csv", rank_columns(top_k))
            if "grad_error" in studies:
                self.errors = self.files.open("grad-error.csv", GRAD_ERROR_COLUMNS)
            self.files.write_run(run)
        self.top_k = top_k
        self.extra_solvers = tuple(extra_solvers)
        self.notes = tuple(notes)

    def record_step(self, step: int, kind: str, times: StepTimes, bytes_sent: int) -> None:
        """The step's row of steps-r{rank}.csv."""
        slots = [times.slots.get(slot, 0.0) for slot in STEP_SLOTS]
        phases = [times.phase_total(phase) for phase in PHASES]
        self.steps.add((step, kind, times.total, *slots, *phases, bytes_sent, sum(times.hooks.values())))

    def record_layers(self, step: int, layers: Sequence[LayerTiming], times: StepTimes) -> None:
        """One row of timing-r{rank}.csv per layer that did update work this step."""
        for layer in layers:
            phase_ms = times.layers.get(layer.name, dict.fromkeys(PHASES, 0.0))
            self.timing.add(
                (
                    step,
                    layer.name,
                    layer.solver,
                    layer.rows,
                    layer.rows_kept,
                    layer.d_a,
                    layer.d_g,
                    *(phase_ms[phase] for phase in PHASES),
                    layer.bytes_sent,
                    layer.bytes_held,
                    times.hooks.get(layer.name, 0.0),
                )
            )

    def record_decisions(self, decisions: Sequence[Decision]) -> None:
        """The policy's decisions of one update (rank 0)."""
        if self.decisions is None:
            return
        for d in decisions:
            extra = (d.costs.get(name) for name in self.extra_solvers)
            self.decisions.add(
                (
                    d.step,
                    d.layer,
                    d.solver,
                    d.reason,
                    d.trend,
                    d.cost_kfac,
                    d.cost_lowrank,
                    d.cost_sngd,
                    d.critical,
                    d.rows_kept,
                    *extra,
                    *(d.notes.get(name) for name in self.notes),
                )
            )

    def record_rank(self, step: int, records: Sequence[RankRecord]) -> None:
        """The rank study's rows (rank 0)."""
        if self.rank is None:
            return
        for r in records:
            eigenvalues = [*r.eigenvalues, *([None] * (self.top_k - len(r.eigenvalues)))]
            self.rank.add((step, r.layer, r.batch_rows, r.reference, *r.ranks, *eigenvalues))

    def record_errors(self, step: int, records: Sequence[ErrorRecord]) -> None:
        """The gradient-error study's rows (rank 0)."""
        if self.errors is None:
            return
        for e in records:
            self.errors.add((step, e.layer, e.method, e.rank_ratio, e.rel_error, e.reference))

    def flush(self, sync: bool = False) -> dict[str, int]:
        """Write everything queued (``sync``: to disk); each file's size by name."""
        return self.files.flush(sync)

    def close(self) -> None:
        """Flush and close every file."""
        self.files.close()
