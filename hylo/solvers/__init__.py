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

Everything a family of one's own needs is importable from here (docs/extending.md, "Solver families"): the
interface (:class:`SolverFamily`, :class:`LayerState`), what its phases take and return (:class:`UpdateJob`,
:class:`UpdateContext`, :class:`Contribution`, :class:`Exchange`, :class:`Payload`, :class:`CostEstimate`,
:class:`FamilyOptions`, :class:`Clock`), its options (:class:`Section`, :func:`option`, :class:`Rule`), the layer
side it reads (:class:`CallStatistic`, :class:`LayerMath`, :class:`LayerShape`, :class:`GradMatrix`, the rows
:class:`FactoredRows` and :class:`DenseRows`), a state's checks on load (:func:`checked_tensors`,
:func:`positive_number`), a group kernel's (:class:`GroupKernel`, :func:`stacked`, :func:`applied_alone`) and
:func:`register_family`.
"""

from __future__ import annotations

from hylo.layers import CallStatistic, DenseRows, FactoredRows, GradMatrix, LayerMath, LayerShape
from hylo.payload import Payload, PayloadKey
from hylo.rules import Rule, Section, option
from hylo.solvers import bundled  # noqa: F401  (registers the bundled families)
from hylo.solvers.base import (
    Clock,
    Contribution,
    CostEstimate,
    FamilyOptions,
    HeldState,
    LayerState,
    RemoteState,
    SolverFamily,
    UpdateContext,
    UpdateJob,
    checked_tensors,
    positive_number,
)
from hylo.solvers.kernel import Exchange, GroupKernel, LoopKernel, applied_alone, stacked
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
    "HYBRID",
    "LAYER_SOLVERS",
    "CallStatistic",
    "Clock",
    "Contribution",
    "CostEstimate",
    "DenseRows",
    "Exchange",
    "FactoredRows",
    "FamilyHandle",
    "FamilyOptions",
    "GradMatrix",
    "GroupKernel",
    "HeldState",
    "LayerMath",
    "LayerShape",
    "LayerState",
    "LoopKernel",
    "LowRankUpdate",
    "Payload",
    "PayloadKey",
    "RemoteState",
    "RowReduction",
    "Rule",
    "Section",
    "SolverFamily",
    "UpdateContext",
    "UpdateJob",
    "VariantHandle",
    "applied_alone",
    "checked_tensors",
    "family_named",
    "family_of",
    "family_sections",
    "option",
    "positive_number",
    "register_family",
    "register_variant",
    "solver_names",
    "stacked",
    "variant_names",
    "whole_step",
]
