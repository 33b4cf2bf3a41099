"""hylo: distributed second-order training with a hybrid low-rank natural gradient (HyLo).

The public API is what this module exports — the preconditioner, its optimizer form
(:class:`HyLoOptimizer`), its configuration and records,
the checkpoint files :func:`save_checkpoint` and :func:`load_checkpoint`, and the extension
points :func:`register_layer_type` (a layer type's math, subclassing
:class:`hylo.layers.LayerMath`), :func:`register_family` (a solver family, subclassing
:class:`hylo.solvers.SolverFamily`) and :func:`register_variant` (a low-rank row reduction,
subclassing :class:`hylo.solvers.RowReduction`; docs/extending.md) — and five modules:
:mod:`hylo.config` (every option, with :func:`hylo.config.options` describing each),
:mod:`hylo.layers` and :mod:`hylo.solvers` (what the extension points build on),
:mod:`hylo.distributed` (communicators a user may inject) and :mod:`hylo.integrity` (checksums
that seal a training script's own checkpoint files; docs/reliability.md, "Checksums"). Every
other module is internal and may change between releases.
"""

from hylo.config import (
    ConvConfig,
    DistributedConfig,
    HyLoConfig,
    KFACConfig,
    LowRankConfig,
    PolicyConfig,
    TelemetryConfig,
)
from hylo.distributed import CommunicationError
from hylo.layers import LayerMath, register_layer_type
from hylo.layers.coverage import Coverage
from hylo.memory import MemoryUsage
from hylo.optimizer import HyLoOptimizer
from hylo.pipeline.checkpoint import load_checkpoint, save_checkpoint
from hylo.preconditioner import HyLoPreconditioner, LayerInfo
from hylo.records import Decision, LayerStats, Progress, StateView
from hylo.solvers import RowReduction, register_family, register_variant
from hylo.version import __version__

__all__ = [
    "CommunicationError",
    "ConvConfig",
    "Coverage",
    "Decision",
    "DistributedConfig",
    "HyLoConfig",
    "HyLoOptimizer",
    "HyLoPreconditioner",
    "KFACConfig",
    "LayerInfo",
    "LayerMath",
    "LayerStats",
    "LowRankConfig",
    "MemoryUsage",
    "PolicyConfig",
    "Progress",
    "RowReduction",
    "StateView",
    "TelemetryConfig",
    "__version__",
    "load_checkpoint",
    "register_family",
    "register_layer_type",
    "register_variant",
    "save_checkpoint",
]
