"""Per-layer curvature states: K-FAC (Kronecker eigenbasis) and the shared SMW low-rank form."""

from hylo.solvers.kfac import KFACState, blend_factors, kfac_update_many
from hylo.solvers.lowrank import LowRankState, LowRankUpdate, lowrank_update_many, sample_kernel

__all__ = [
    "KFACState",
    "LowRankState",
    "LowRankUpdate",
    "blend_factors",
    "kfac_update_many",
    "lowrank_update_many",
    "sample_kernel",
]
