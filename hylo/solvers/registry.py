"""Solver names and the families that run them; public registration of families and low-rank variants.

docs/design.md, "Solver families". The update stage groups layers by family and calls the
family interface (:class:`~hylo.solvers.base.SolverFamily`); nothing outside this package, the
configuration and the hybrid policy tests a solver's or a family's name. The built-in solvers are
``kfac`` (the K-FAC family) and the low-rank family's variants ``sngd``, ``kid`` and ``kis``;
:func:`register_family` adds a family with its options and statistic (the families of
:mod:`hylo.solvers.bundled` are registered through it, as a user's is) and :func:`register_variant` a
low-rank variant, from user code (docs/extending.md).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from hylo.layers.statistics import CallStatistic
from hylo.rules import Rule, Section
from hylo.solvers.base import SolverFamily
from hylo.solvers.kfac import KFACFamily
from hylo.solvers.lowrank import ExactRows, LowRankFamily, RowReduction, SampledRows, SkeletonRows

#: The low-rank family: its variants are the registered row reductions.
LOWRANK = LowRankFamily()
#: The families, in the order the stage launches their collectives (K-FAC's all-reduce first,
#: so that it overlaps the low-rank local reductions), then those :func:`register_family` added.
FAMILIES: list[SolverFamily[Any]] = [KFACFamily(), LOWRANK]
#: Every option name and section name a configuration has beyond the families' sections (the top level and the
#: sections of :mod:`hylo.config`, which fills it): a registered family's section and options take none of them.
RESERVED_NAMES: set[str] = set()
#: What ``solver="hybrid"`` asks for: a solver per layer and update, chosen by the policy.
HYBRID = "hybrid"
#: The built-in solvers, in their fixed order (the first entries of :func:`solver_names`).
LAYER_SOLVERS: tuple[str, ...] = ("kfac", "sngd", "kid", "kis")
_NAME = re.compile(r"[a-z][a-z0-9_]*")

LOWRANK.variants.update({"sngd": ExactRows(), "kid": SkeletonRows(), "kis": SampledRows()})


def solver_names() -> tuple[str, ...]:
    """Every solver one layer can run: the built-in ones, then registered variants in registration order."""
    return tuple(name for family in FAMILIES for name in family.solvers)


def family_of(solver: str) -> SolverFamily:
    """The family that runs ``solver``; ``ValueError`` for an unknown name."""
    for family in FAMILIES:
        if solver in family.solvers:
            return family
    raise ValueError(f"unknown solver {solver!r}; expected one of {solver_names()}")


def whole_step(solver: str) -> bool:
    """Whether ``solver``'s result is the whole update direction (its family's states advance each step, as
    Adam's moments do), so that its parameters take SGD without momentum (docs/usage.md, "Adaptive
    solvers"); False for ``"hybrid"``, which is no one layer's solver."""
    return solver != HYBRID and family_of(solver).state_type.advances


def family_named(name: str) -> SolverFamily:
    """The registered family called ``name`` (what a state's ``family`` names); ``ValueError`` for an unknown one."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown solver family {name!r}; expected one of {[family.name for family in FAMILIES]}")


def variant_names() -> tuple[str, ...]:
    """The low-rank variants (the solvers that work on per-sample rows)."""
    return LOWRANK.solvers


def adapts_rank(solver: str) -> bool:
    """Whether ``solver`` can run under ``rank_ratio="auto"``: any solver but a registered low-rank variant that
    keeps a configured rank without choosing it (:attr:`~hylo.solvers.lowrank.RowReduction.adapts_rank`)."""
    variant = LOWRANK.variants.get(solver)
    return variant is None or variant.runs_adaptive()


def solver_rule(allow_hybrid: bool) -> Rule:
    """An option naming a registered solver (or ``"hybrid"`` when ``allow_hybrid``), checked when it is read."""

    def holds(name: object) -> bool:
        return name in solver_names() or (allow_hybrid and name == HYBRID)

    return Rule(holds, lambda: f"one of {solver_names() + ((HYBRID,) if allow_hybrid else ())}")


def variant_rule() -> Rule:
    """An option naming a registered low-rank variant."""
    return Rule(
        lambda name: name in variant_names(),
        lambda: f"a registered low-rank variant, one of {variant_names()}",
    )


class VariantHandle:
    """Returned by :func:`register_variant`: ``remove()`` unregisters the variant."""

    def __init__(self, name: str) -> None:
        self.name = name

    def remove(self) -> None:
        """Unregister the variant (idempotent); preconditioners still using it fail at their next update."""
        LOWRANK.variants.pop(self.name, None)


def register_variant(name: str, reduction: RowReduction) -> VariantHandle:
    """Add a low-rank variant ``name`` that reduces each rank's rows with ``reduction``.

    The name is then a solver like ``"kis"``: for ``solver``, ``layer_solvers``, ``solver_fn``,
    the hybrid policy's ``critical_variant``/``stable_variant`` and ``grad_error_methods``; the
    policy's decisions carry its cost, and ``decisions.csv`` a ``cost_<name>`` column for it.
    Register it before building a :class:`~hylo.HyLoConfig` that names it, on every rank.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a variant's name is lowercase letters, digits and '_', starting with a letter; got {name!r}")
    if name == HYBRID or name in solver_names():
        raise ValueError(f"solver name {name!r} is taken (registered: {solver_names()}, and {HYBRID!r})")
    if not isinstance(reduction, RowReduction):
        raise ValueError(f"register_variant needs a hylo.solvers.RowReduction instance, got {type(reduction).__name__}")
    LOWRANK.variants[name] = reduction
    return VariantHandle(name)


class FamilyHandle:
    """Returned by :func:`register_family`: ``remove()`` unregisters the family."""

    def __init__(self, family: SolverFamily[Any]) -> None:
        self.family = family

    def remove(self) -> None:
        """Unregister the family (idempotent); preconditioners still using its solvers fail at their next update."""
        if self.family in FAMILIES:
            FAMILIES.remove(self.family)


def register_family(family: SolverFamily[Any]) -> FamilyHandle:
    """Add a solver family: its solvers become names for ``solver``, ``layer_solvers``, ``solver_fn``, the policy's
    ``kfac_solver`` and the studies, with the stage, checkpoints, FSDP2 and the cost model going through its
    interface (:class:`~hylo.solvers.base.SolverFamily`; docs/extending.md, "Solver families"). Its options
    section becomes a section of :class:`hylo.HyLoConfig` and its options flat keywords; its statistic is what the
    layers' hooks capture for it.

    ``ValueError`` unless ``family`` is a ``SolverFamily`` instance whose name is new, whose solver names are
    lowercase letters, digits and '_' and not taken, whose ``statistic`` is a
    :class:`~hylo.layers.statistics.CallStatistic` instance, and whose ``section`` (if any) is a frozen
    :class:`~hylo.rules.Section` dataclass whose name and option names no other option or section has. Register it
    on every rank, before making a config that names it.
    """
    if not isinstance(family, SolverFamily):
        raise ValueError(f"register_family needs a hylo.solvers.SolverFamily instance, got {type(family).__name__}")
    if any(other.name == family.name for other in FAMILIES):
        raise ValueError(f"a solver family named {family.name!r} is registered already")
    statistic = getattr(family, "statistic", None)
    if not isinstance(statistic, CallStatistic):
        raise ValueError(
            f"family {family.name!r}: statistic must be a hylo.layers.CallStatistic instance, got {statistic!r}"
        )
    _check_section(family)
    taken = solver_names()
    for name in family.solvers:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(
                f"a solver's name is lowercase letters, digits and '_', starting with a letter; got {name!r}"
            )
        if name == HYBRID or name in taken:
            raise ValueError(f"solver name {name!r} is taken (registered: {taken}, and {HYBRID!r})")
    FAMILIES.append(family)
    return FamilyHandle(family)


def family_sections() -> list[type[Section]]:
    """The options sections of the registered families, in registration order."""
    return [family.section for family in FAMILIES if family.section is not None]


def section_names(section: type[Section]) -> set[str]:
    """The names a section takes in a configuration: its own and its options'."""
    return {str(section.section_name), *section.option_specs()}


def _check_section(family: SolverFamily[Any]) -> None:
    """``ValueError`` unless ``family.section`` is None, a registered family's (the two share it), or a frozen Section
    dataclass whose section and option names are free (none of :data:`RESERVED_NAMES`, none of another family's)."""
    section = family.section
    if section is None or section in family_sections():  # none, or shared with the family that brought it
        return
    if not (isinstance(section, type) and issubclass(section, Section) and dataclasses.is_dataclass(section)):
        raise ValueError(f"family {family.name!r}: section must be a Section dataclass, got {section!r}")
    if not section.__dataclass_params__.frozen:
        raise ValueError(f"family {family.name!r}: section {section.__name__} must be a frozen dataclass")
    name = section.section_name
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"family {family.name!r}: section {section.__name__} needs a section_name, got {name!r}")
    taken = set(RESERVED_NAMES).union(*(section_names(other) for other in family_sections()))
    clashes = sorted(section_names(section) & taken)
    if clashes:
        raise ValueError(f"family {family.name!r}: section {section.__name__} reuses option or section names {clashes}")
    try:
        section()
    except Exception as err:
        raise ValueError(
            f"family {family.name!r}: section {section.__name__}() fails with its defaults: {err}"
        ) from err
