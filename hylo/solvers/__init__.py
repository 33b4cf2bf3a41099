"""Solver families and their variants (docs/design.md, "Solver families").

- :mod:`~hylo.solvers.base`: the family interface the update stage calls and the states it keeps;
  :mod:`~hylo.solvers.kernel`: the group kernels (a family's batched apply of equal layers between updates,
  and its split under FSDP2); :mod:`~hylo.solvers.layout`: the one layout of a state's tensors;
- :mod:`~hylo.solvers.kfac`: the K-FAC family; :mod:`~hylo.solvers.lowrank`: the low-rank family
  and its variants (:class:`RowReduction`), with :mod:`~hylo.solvers.reduce` (KIS sampling, the
  KID skeleton) and :mod:`~hylo.solvers.smw` (the Sherman–Morrison–Woodbury solve);
- :mod:`~hylo.solvers.bundled`: the families that ship with hylo and register themselves through
  :func:`register_family` (Adam's moments in the K-FAC eigenbasis);
- :mod:`~hylo.solvers.registry`: solver names → families, :func:`register_family` and :func:`register_variant`.
"""

from __future__ import annotations

from hylo.solvers import bundled  # noqa: F401  (registers the bundled families)
from hylo.solvers.base import (
    FamilyOptions,
    HeldState,
    LayerState,
    RemoteState,
    SolverFamily,
    UpdateContext,
)
from hylo.solvers.kernel import GroupKernel, LoopKernel
from hylo.solvers.lowrank import RowReduction
from hylo.solvers.registry import (
    FAMILIES,
    HYBRID,
    LAYER_SOLVERS,
    FamilyHandle,
    VariantHandle,
    family_named,
    family_of,
    family_sections,
    register_family,
    register_variant,
    solver_names,
    variant_names,
    whole_step,
)
from hylo.solvers.smw import LowRankUpdate

__all__ = [
    "FAMILIES",
    "FamilyOptions",
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
    "family_sections",
    "family_of",
    "register_family",
    "register_variant",
    "solver_names",
    "variant_names",
    "whole_step",
]
