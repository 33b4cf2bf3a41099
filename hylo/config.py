"""The preconditioner's options: one immutable :class:`HyLoConfig` made of typed sections.

docs/usage.md, "Options". Each option is a field of one section — the top level (the solver,
its cadence and damping), :class:`KFACConfig`, :class:`LowRankConfig`, :class:`ConvConfig`,
:class:`PolicyConfig`, :class:`DistributedConfig`, :class:`TelemetryConfig`, and the section of
each family registered with :func:`hylo.register_family` — and carries its documentation and its
rule in the field's metadata, the one place its default, meaning and check live (:func:`options`
lists them; the training scripts build their flags from it).
Options are given flat (``HyLoConfig(damping=0.3, trend_window=50)``) or as sections
(``HyLoConfig(policy=PolicyConfig(trend_window=50))``); every value is checked when the config
is made, and a bad one is a ``ValueError`` naming the option.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, TypeVar, cast

from hylo.layers.batch import DampingConvention
from hylo.layers.statistics import CallStatistic
from hylo.rules import (
    COUNT,
    POSITIVE,
    REGEXES,
    Hyper,
    IntHyper,
    OptionSpec,
    Rule,
    Section,
    default_of,
    option,
)
from hylo.sections import (
    ConvConfig,
    DistributedConfig,
    PolicyConfig,
    TelemetryConfig,
)
from hylo.solvers import FAMILIES, HYBRID, FamilyOptions, SolverFamily, family_of
from hylo.solvers.kfac import KFACConfig
from hylo.solvers.lowrank import LowRankConfig
from hylo.solvers.registry import RESERVED_NAMES, adapts_rank, family_sections, section_names, solver_rule

T = TypeVar("T", int, float)


#: The sections every configuration has, by name: the built-in families' and the preconditioner's own.
BUILTIN_SECTIONS: dict[str, type[Section]] = {
    "kfac": KFACConfig,
    "lowrank": LowRankConfig,
    "conv": ConvConfig,
    "policy": PolicyConfig,
    "distributed": DistributedConfig,
    "telemetry": TelemetryConfig,
}


def sections() -> dict[str, type[Section]]:
    """Every section by name: the built-in ones, then the registered families' in registration order."""
    registered = {str(cls.section_name): cls for cls in family_sections() if cls.section_name not in BUILTIN_SECTIONS}
    return {**BUILTIN_SECTIONS, **registered}


@dataclass(frozen=True, init=False)
class HyLoConfig(Section):
    """Options of :class:`hylo.HyLoPreconditioner` (docs/usage.md, "Options").

    Give options flat (``HyLoConfig(solver="kfac", factor_decay=0.9)``), as sections
    (``HyLoConfig(kfac=KFACConfig(factor_decay=0.9))``) or both (flat options apply on top of
    the sections given). Read them through the sections (``config.kfac.factor_decay``);
    :meth:`replace` makes a changed copy. :func:`options` lists every option with its meaning.
    """

    solver: str = option(
        HYBRID,
        doc="'kfac', 'sngd', 'kid', 'kis' (or a registered variant), or 'hybrid' to choose one per layer and update",
        rule=solver_rule(allow_hybrid=True),
    )
    update_freq: IntHyper = option(
        10, doc="steps between curvature updates (step 0 is an update step)", rule=COUNT, schedule=True
    )
    stagger_updates: bool = option(
        False,
        doc="spread each cycle's layer updates over its update_freq steps: a layer updates where step % "
        "update_freq is its offset, the offsets balancing the layers' estimated solve costs, so that no step "
        "carries every layer's update (step 0, and a step that owes an update, update every layer); needs a "
        "fixed solver, no factor_update_freq and no sampled studies",
        rule=Rule(lambda x: isinstance(x, bool), "a bool"),
    )
    damping: Hyper = option(
        1.0,
        doc="Tikhonov damping λ > 0 of (F + λI), read at update steps (a stored state keeps the λ it was solved with)",
        rule=POSITIVE,
        schedule=True,
    )
    kl_clip: Hyper | None = option(
        None,
        doc="scale the whole preconditioned step by min(1, sqrt(kl_clip / (lr²·Σ v̂·∇W))); None disables it",
        rule=Rule(POSITIVE.holds, "a finite number > 0 (or None to disable)"),
        schedule=True,
    )
    lr: Hyper | None = option(
        None,
        doc="the learning rate kl_clip reads (required with it): a function reading the optimizer's lr when "
        "a scheduler changes it",
        rule=Rule(
            lambda x: POSITIVE.holds(x) and math.isfinite(float(x) * float(x)),
            "a finite number > 0 whose square is finite (kl_clip scales by lr²)",
        ),
        schedule=True,
    )
    skip_layers: tuple[str, ...] = option(
        (),
        doc="regular expressions that leave a module alone when one fully matches its name ('fc', "
        "'layers\\..*') or its class name ('Linear', 'Conv2d'); case-sensitive",
        rule=REGEXES,
        fixed=True,
    )
    damping_convention: DampingConvention = option(
        "hylo",
        doc="'hylo': λ damps the Fisher of g = n·∂L/∂s (the same at every batch size); 'kaisa': every "
        "layer's Fisher divided by KAISA's ratio c (n² on Linear, n²·L^(4+e) on Conv2d), so KAISA's damping "
        "carries over and solver='kfac' takes KAISA's eigen-method step",
        fixed=True,
    )
    grouped: bool = option(
        True,
        doc="apply the states per group of equal layers, one batched kernel each; False: the same kernels one "
        "layer a group (same results to round-off)",
        rule=Rule(lambda x: isinstance(x, bool), "a bool"),
    )
    kfac: KFACConfig = field(default_factory=KFACConfig)
    lowrank: LowRankConfig = field(default_factory=LowRankConfig)
    conv: ConvConfig = field(default_factory=ConvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    #: The registered families' sections by name (read with :meth:`section`); give one as a keyword, its name
    #: the section's ``section_name`` (``HyLoConfig(<name>=MySection(...))``), or its options flat.
    family_sections: Mapping[str, Section] = field(default_factory=dict)

    def __init__(self, **options: Any) -> None:
        known = sections()
        given_sections = {**options.pop("family_sections", {})}
        flat: dict[str, dict[str, Any]] = {name: {} for name in known}
        section_of = _section_of()
        for key, value in options.items():
            if key in known:
                given_sections[key] = value
                continue
            section = section_of.get(key, ...)
            if section is ...:
                close = [name for name in sorted(section_of) if name.startswith(key[:4])][:3]
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise TypeError(f"unknown hylo option {key!r}{hint} (see hylo.config.options())")
            if section is None:
                self._set(key, value)
            else:
                flat[section][key] = value
        built: dict[str, Section] = {}
        for name, cls in known.items():
            base = given_sections.pop(name, None) or cls()
            if not isinstance(base, cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {type(base).__name__}")
            built[name] = dataclasses.replace(cast(Any, base), **flat[name]) if flat[name] else base
        if given_sections:
            raise TypeError(f"unknown hylo sections {sorted(given_sections)} (registered: {sorted(known)})")
        for f in fields(self):
            if f.name in BUILTIN_SECTIONS:
                self._set(f.name, built[f.name])
            elif f.name == "family_sections":
                self._set(f.name, MappingProxyType({n: s for n, s in built.items() if n not in BUILTIN_SECTIONS}))
            elif f.name not in options:
                self._set(f.name, default_of(f))
        self.__post_init__()

    def __post_init__(self) -> None:
        if isinstance(self.skip_layers, str):
            raise ValueError("skip_layers must be a sequence of names, not a single string")
        super().__post_init__()
        self._set("skip_layers", tuple(self.skip_layers))
        if self.kl_clip is not None and self.lr is None:
            raise ValueError("lr must be given when kl_clip is set (the clip scales by lr²)")
        if self.stagger_updates:
            if self.solver == HYBRID or self.policy.solver_fn is not None:
                raise ValueError(
                    "stagger_updates needs a fixed solver: the hybrid policy (or a solver_fn) decides every layer at "
                    "one update step, on a trend sampled once per update"
                )
            if self.kfac.factor_update_freq is not None:
                raise ValueError(
                    "stagger_updates and factor_update_freq: a staggered step updates some layers; refreshing the "
                    "others' factors at it is not supported (use one or the other)"
                )
            sampled = sorted(set(self.telemetry.studies) & {"rank", "grad_error"})
            if sampled:
                raise ValueError(
                    f"stagger_updates: studies {sampled} sample an update of every layer at one step; run them "
                    "without it"
                )
        if self.lowrank.adaptive:
            policy = self.policy
            named = {self.solver, policy.critical_variant, policy.stable_variant, *policy.layer_solvers.values()}
            fixed = sorted(name for name in named if not adapts_rank(name))
            if fixed:
                raise ValueError(
                    f"rank_ratio='auto': low-rank variant(s) {fixed} keep a configured rank and do not choose one "
                    "(RowReduction.adapts_rank); use a numeric rank_ratio, or kid/kis"
                )

    def replace(self, **options: Any) -> HyLoConfig:
        """A copy with ``options`` (flat names or sections) changed, checked like a new config."""
        return dataclasses.replace(self, **options)

    def value(self, name: str) -> Any:
        """The value of option ``name`` (a flat name, whatever its section)."""
        section = _section_of()[name]
        return getattr(self if section is None else self.section(section), name)

    def section(self, name: str) -> Section:
        """The section called ``name``: a built-in one (``"kfac"``, …) or a registered family's."""
        if name in BUILTIN_SECTIONS:
            return cast(Section, getattr(self, name))
        if name in self.family_sections:
            return self.family_sections[name]
        raise KeyError(f"no section {name!r}; this config has {sorted([*BUILTIN_SECTIONS, *self.family_sections])}")

    def family_options(self) -> FamilyOptions:
        """Every family's options section, looked up by type (what the families read at an update and in their
        cost estimates: ``config.family_options()(KFACConfig)``)."""
        return FamilyOptions([self.kfac, self.lowrank, *self.family_sections.values()])

    def families(self) -> tuple[SolverFamily[Any], ...]:
        """The registered families this config can give a layer, in registration order: every one under a
        ``solver_fn``; else those of ``solver`` (or, for ``"hybrid"``, of ``kfac_solver`` and the two regimes'
        variants) and of the ``layer_solvers`` overrides."""
        policy = self.policy
        if policy.solver_fn is not None:
            return tuple(FAMILIES)
        named = {*policy.layer_solvers.values()}
        if self.solver == HYBRID:
            named |= {policy.kfac_solver, policy.critical_variant, policy.stable_variant}
        else:
            named.add(self.solver)
        reached = {id(family_of(name)) for name in named}
        return tuple(family for family in FAMILIES if id(family) in reached)

    def statistics(self) -> tuple[CallStatistic[Any], ...]:
        """The statistics of :meth:`families`, each once, in their order: what the hooks may reduce calls to and the
        ranks agree on (docs/design.md, "Memory")."""
        return tuple(dict.fromkeys(family.statistic for family in self.families()))

    def initial_solver(self, layer: str) -> str:
        """A layer's solver before its first update: its override, else ``solver``."""
        return self.policy.override_for(layer) or self.solver

    def constants(self) -> dict[str, Any]:
        """Every option that is a plain value, by flat name (callables left out; paths as strings)."""
        values = {spec.name: self.value(spec.name) for spec in options()}
        values = {name: value for name, value in values.items() if not callable(value)}
        if values.get("profile_dir") is not None:
            values["profile_dir"] = os.fspath(values["profile_dir"])
        return values


def options() -> list[OptionSpec]:
    """Every option of :class:`HyLoConfig`, top level first, then section by section (the registered families'
    sections last, in registration order)."""
    return list(_specs().values())


#: The option specs by flat name, per tuple of sections they were built for (the registry may change).
_SPECS_CACHE: dict[tuple[type[Section], ...], dict[str, OptionSpec]] = {}


def _specs() -> dict[str, OptionSpec]:
    """Every option by flat name (an option name is defined once: :func:`hylo.register_family` checks it)."""
    classes: tuple[type[Section], ...] = (HyLoConfig, *sections().values())
    if classes not in _SPECS_CACHE:
        _SPECS_CACHE.clear()
        _SPECS_CACHE[classes] = {spec.name: spec for cls in classes for spec in cls.option_specs().values()}
    return _SPECS_CACHE[classes]


def _section_of() -> dict[str, str | None]:
    """Each option's section (None: the top level), by flat name."""
    return {name: spec.section for name, spec in _specs().items()}


# The names a registered family's section may not take (hylo.register_family checks them), and each option
# name defined once: the built-in ones here, the registered families' sections (some registered before this
# module was imported) against them.
RESERVED_NAMES.update(BUILTIN_SECTIONS, ("family_sections",))
_BUILTIN: tuple[type[Section], ...] = (HyLoConfig, *BUILTIN_SECTIONS.values())
for _spec_ in (spec for cls in _BUILTIN for spec in cls.option_specs().values()):
    if _spec_.name in RESERVED_NAMES:
        raise ImportError(f"option name {_spec_.name!r} is defined twice")
    RESERVED_NAMES.add(_spec_.name)
for _section_ in (cls for cls in family_sections() if cls.section_name not in BUILTIN_SECTIONS):
    if section_names(_section_) & RESERVED_NAMES:
        raise ImportError(f"a registered family's section {_section_.__name__} reuses a built-in option name")


def resolve(name: str, value: T | Callable[[int], T], step: int) -> T:
    """Evaluate option ``name`` — a constant or a callable of the step — at ``step``, checked by its rule.

    A float option's value comes back as a float: an int the rule accepts (at most 2**63) never reaches
    torch as a Python int, whose products (``lr²``) would leave int64."""
    spec = _specs()[name]
    if callable(value):
        result = value(step)
        assert spec.rule is not None, f"{name} is not a schedule"
        spec.rule.check(name, result, step)
    else:
        result = value
    return cast(T, float(result)) if spec.type is float else result
