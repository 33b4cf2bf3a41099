"""A preconditioner's telemetry: its stopwatch, its ``profile_dir`` files and its studies (docs/profiling.md).

Without ``profile_dir`` nothing is timed, sampled or written (:meth:`Telemetry.disabled`). With it,
every ``step()`` is timed phase by phase and recorded when it succeeds; the studies run at their
sampled updates on a stage of their own, so training is bit-for-bit the same with and without them.
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
from hylo.records import Decision, StudyResult
from hylo.solvers import FAMILIES, LAYER_SOLVERS, UpdateContext, family_of, solver_names
from hylo.state import RegisteredLayer
from hylo.telemetry.profiling import DISABLED, Stopwatch
from hylo.telemetry.recorder import LayerTiming, Recorder
from hylo.telemetry.recording import run_info
from hylo.telemetry.studies import StudyRunner
from hylo.trend import GradNormTrend


class Telemetry:
    """The stopwatch, recorder and study runner of one preconditioner on one rank."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.watch: Stopwatch = DISABLED
        self.recorder: Recorder | None = None
        self.studies: StudyRunner | None = None

    @classmethod
    def open(cls, config: HyLoConfig, comm: Communicator, layers: Sequence[RegisteredLayer], version: str) -> Telemetry:
        """Open ``profile_dir`` (refusing hylo's files of another run unless appending) and start timing."""
        telemetry = cls(comm)
        options = config.telemetry
        if options.profile_dir is None:
            return telemetry
        device = layers[0].math.weight.device
        constants = {name: repr(value) if callable(value) else value for name, value in config.constants().items()}
        telemetry.recorder = Recorder(
            options.profile_dir,
            rank=comm.rank,
            append=options.profile_append,
            names=[layer.name for layer in layers],
            studies=options.studies,
            top_k=options.rank_top_k,
            run=run_info(constants, comm.world_size, device, version),
            extra_solvers=[name for name in solver_names() if name not in LAYER_SOLVERS],
            notes=list(dict.fromkeys(name for family in FAMILIES for name in family.note_columns)),
        )
        telemetry.watch = Stopwatch(device)
        if "rank" in options.studies or "grad_error" in options.studies:
            telemetry.studies = StudyRunner(comm, {layer.name: layer.math for layer in layers})
        return telemetry

    @property
    def recording(self) -> bool:
        """Whether this preconditioner writes a ``profile_dir``."""
        return self.recorder is not None

    def close(self) -> None:
        """Flush and close the files and stop timing (idempotent)."""
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None
            self.watch = DISABLED

    def flush(self) -> dict[str, int]:
        """Write every queued row to disk (``fsync``) and return each file's size by name (empty when not
        recording): what a checkpoint written now covers (docs/profiling.md, "Checkpoints and kills")."""
        if self.recorder is None:
            return {}
        return self.recorder.flush(sync=True)

    def traffic(self) -> dict[str, int]:
        """Bytes sent so far by tag (empty when not recording): the start of a step's count."""
        return dict(self.comm.bytes_by_tag) if self.recorder is not None else {}

    def studies_due(self, update: int, config: HyLoConfig) -> tuple[bool, bool]:
        """Whether the ``update``-th update runs the rank study and the gradient-error study."""
        if self.studies is None:
            return False, False
        options = config.telemetry
        rank = "rank" in options.studies and update % options.rank_every == 0
        grad_error = "grad_error" in options.studies and update % options.grad_error_every == 0
        return rank, grad_error

    def run_studies(
        self,
        step: int,
        update: int,
        config: HyLoConfig,
        names: Sequence[str],
        batches: Sequence[LayerBatch],
        grads: Sequence[GradMatrix],
        context: UpdateContext,
    ) -> StudyResult | None:
        """The studies sampled at this update (every rank takes part), timed as one ``"study"`` lap."""
        rank, grad_error = self.studies_due(update, config)
        if self.studies is None or not names or not (rank or grad_error):
            return None
        before = dict(self.comm.bytes_by_tag)
        context = dataclasses.replace(context, seed=0, watch=DISABLED)
        ranks, errors = self.studies.run(step, names, batches, grads, context, config, rank, grad_error)
        self.watch.lap("study")
        return StudyResult(ranks, errors, {tag: n - before.get(tag, 0) for tag, n in self.comm.bytes_by_tag.items()})

    def record(
        self,
        step: int,
        kind: str,
        decisions: Sequence[Decision],
        study: StudyResult | None,
        before: Mapping[str, int],
        worked: Sequence[tuple[RegisteredLayer, LayerBatch]],
        chosen: Mapping[str, tuple[tuple[int, int], ...]],
    ) -> None:
        """Write a successful step's rows: decisions, studies, its timing (flushing every file after an update);
        ``chosen``: each low-rank layer's (rows, rows kept) per rank at this update."""
        recorder = self.recorder
        if recorder is None:
            return
        recorder.record_decisions(decisions)
        if study is not None:
            recorder.record_rank(step, study.rank)
            recorder.record_errors(step, study.errors)
        times = self.watch.finish()
        study_traffic = study.traffic if study is not None else {}
        sent = {tag: n - before.get(tag, 0) - study_traffic.get(tag, 0) for tag, n in self.comm.bytes_by_tag.items()}
        recorder.record_step(step, kind, times, sum(sent.values()))
        if kind in ("update", "refresh"):
            recorder.record_layers(
                step,
                [
                    LayerTiming(
                        layer.name,
                        layer.solver,
                        batch.rows,
                        chosen[layer.name][self.comm.rank][1]
                        if layer.name in chosen
                        else family_of(layer.solver).rows_kept(batch, layer.solver),
                        layer.math.d_a,
                        layer.math.d_g,
                        sent.get(layer.name, 0),
                        layer.state.nbytes() if layer.state is not None else 0,
                    )
                    for layer, batch in worked
                ],
                times,
            )
            recorder.flush()

    def record_norms(
        self,
        step: int,
        layers: Sequence[RegisteredLayer],
        norms: Tensor,
        written: Mapping[str, Tensor],
        trend: GradNormTrend,
    ) -> None:
        """Queue the step's grad-norm rows when the study is on (rank 0): norms before, the trend's view, norms
        written back."""
        if self.recorder is None or self.recorder.norms is None:
            return
        after = norms.clone()
        for i, layer in enumerate(layers):
            if layer.name in written:
                after[i] = torch.linalg.vector_norm(written[layer.name].to(layer.math.dtype))
        assert trend.ema is not None
        self.recorder.norms.add(step, torch.stack((norms, trend.ema, after)), trend.last_trend, trend.critical)
