"""hylo: distributed second-order training with a hybrid low-rank natural gradient (HyLo).

The public API is what this module exports. The collaborators a user may inject or extend
are in :mod:`hylo.distributed` (communicators) and :mod:`hylo.solvers` (solver families);
every other module is internal and may change between releases.
"""

from hylo.config import HyLoConfig
from hylo.distributed import CommunicationError
from hylo.preconditioner import HyLoPreconditioner, LayerInfo, MemoryUsage
from hylo.records import Decision, LayerStats
from hylo.version import __version__

__all__ = [
    "CommunicationError",
    "Decision",
    "HyLoConfig",
    "HyLoPreconditioner",
    "LayerInfo",
    "LayerStats",
    "MemoryUsage",
    "__version__",
]
