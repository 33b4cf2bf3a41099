"""Solver families and their variants (docs/design.md, "Solver families").

- :mod:`~hylo.solvers.base`: the family interface the update stage calls, the states it keeps and the group
  kernels (a family's batched apply of equal layers between updates); :mod:`~hylo.solvers.layout`: the one
  layout of a state's tensors;
- :mod:`~hylo.solvers.kfac`: the K-FAC family; :mod:`~hylo.solvers.lowrank`: the low-rank family
  and its variants (:class:`RowReduction`), with :mod:`~hylo.solvers.reduce` (KIS sampling, the
  KID skeleton) and :mod:`~hylo.solvers.smw` (the Sherman–Morrison–Woodbury solve);
- :mod:`~hylo.solvers.kfac_adam`: Adam's moments in the K-FAC eigenbasis, registered as a family;
- :mod:`~hylo.solvers.registry`: solver names → families, :func:`register_family` and :func:`register_variant`.
"""

from __future__ import annotations

from hylo.solvers.base import GroupKernel, HeldState, LayerState, LoopKernel, RemoteState, SolverFamily, UpdateContext
from hylo.solvers.lowrank import RowReduction
from hylo.solvers.registry import (
    FAMILIES,
    HYBRID,
    LAYER_SOLVERS,
    FamilyHandle,
    VariantHandle,
    family_named,
    family_of,
    register_family,
    register_variant,
    solver_names,
    variant_names,
    whole_step,
)
from hylo.solvers.smw import LowRankUpdate

__all__ = [
    "FAMILIES",
    "HYBRID",
    "LAYER_SOLVERS",
    "GroupKernel",
    "HeldState",
    "LayerState",
    "LoopKernel",
    "LowRankUpdate",
    "RemoteState",
    "RowReduction",
    "SolverFamily",
    "UpdateContext",
    "FamilyHandle",
    "VariantHandle",
    "family_named",
    "family_of",
    "register_family",
    "register_variant",
    "solver_names",
    "variant_names",
    "whole_step",
]
