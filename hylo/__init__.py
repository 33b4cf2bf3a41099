"""hylo: distributed second-order training with a hybrid low-rank natural gradient (HyLo)."""

from hylo.config import HyLoConfig
from hylo.preconditioner import HyLoPreconditioner, LayerInfo

__version__ = "0.1.0"
__all__ = ["HyLoConfig", "HyLoPreconditioner", "LayerInfo", "__version__"]
