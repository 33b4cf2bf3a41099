"""The read-only views a preconditioner hands to user code: each layer as it stands (:class:`~hylo.records.LayerInfo`,
with its state as a :class:`~hylo.records.StateView`) and the run's :class:`~hylo.records.Progress`
(docs/usage.md, "Inspecting layers").

Built on request from the collaborators' own records, copying no tensor: a view shows the state's tensors
themselves, read-only by convention.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from hylo.config import HyLoConfig
from hylo.layers.rows import SampleRows
from hylo.records import LayerInfo, Progress, StateView
from hylo.solvers import HeldState, RemoteState
from hylo.state import RegisteredLayer

if TYPE_CHECKING:
    from hylo.pipeline.guard import Guard
    from hylo.pipeline.planner import Planner
    from hylo.telemetry.monitor import Telemetry
    from hylo.trend import GradNormTrend


def state_view(state: HeldState) -> StateView:
    """``state`` read-only: its family, damping, tensors and its other fields (the rows it keeps as their count)."""
    fields: dict[str, object] = {}
    if dataclasses.is_dataclass(state):
        for spec in dataclasses.fields(state):
            value = getattr(state, spec.name)
            if isinstance(value, SampleRows):
                fields[spec.name] = value.count
            elif not isinstance(value, Tensor | Mapping):  # tensors are in ``tensors``
                fields[spec.name] = value
    remote = isinstance(state, RemoteState)
    damping = None if isinstance(state, RemoteState) else state.damping
    tensors = types.MappingProxyType(dict(state.tensors()))
    return StateView(
        state.family, type(state).__name__, damping, tensors, types.MappingProxyType(fields), remote, state
    )


def layer_infos(
    layers: Sequence[RegisteredLayer],
    config: HyLoConfig,
    trend: GradNormTrend,
    planner: Planner,
    guard: Guard,
) -> list[LayerInfo]:
    """Every layer as it stands: what :meth:`RegisteredLayer.info` reports, its state, captured calls and memory,
    and the policy's and the guard's facts of it (``trend``'s EMAs and flags, the layers ``planner`` holds rejected,
    ``guard``'s fallback counters; the EMAs and the counters read from the device in one transfer each)."""
    norms: list[float | None] = [None] * len(layers) if trend.ema is None else list(trend.ema.tolist())
    counts, rejected = guard.fallbacks.tolist(), planner.rejected
    infos = []
    for i, layer in enumerate(layers):
        state, capture = layer.state, layer.capture
        infos.append(
            dataclasses.replace(
                layer.info(config),
                state=None if state is None else state_view(state),
                memory=state.nbytes() if state is not None else 0,
                calls=tuple(capture.calls()),
                pending=len(capture.pending()),
                grad_norm=norms[i],
                trend=trend.last_trend[i],
                critical=trend.critical[i],
                rejected=layer.name in rejected,
                fallbacks=int(counts[i]),
                idle=layer.idle,
            )
        )
    return infos


def progress(planner: Planner, telemetry: Telemetry) -> Progress:
    """The run's counters (``planner``'s) and what of the profiler is on (``telemetry``'s)."""
    return Progress(
        planner.step,
        planner.updates,
        planner.needs_update,
        telemetry.recording,
        telemetry.watch.enabled,
        telemetry.studies is not None,
    )
