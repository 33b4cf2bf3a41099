"""The preconditioner's options: one immutable :class:`HyLoConfig` made of typed sections.

docs/usage.md, "Options". Each option is a field of one section — the top level (the solver,
its cadence and damping), :class:`KFACConfig`, :class:`LowRankConfig`, :class:`ConvConfig`,
:class:`PolicyConfig`, :class:`DistributedConfig` and :class:`TelemetryConfig` — and carries its
documentation and its rule in the field's metadata, the one place its default, meaning and
check live (:func:`options` lists them; the training scripts build their flags from it).
Options are given flat (``HyLoConfig(damping=0.3, trend_window=50)``) or as sections
(``HyLoConfig(policy=PolicyConfig(trend_window=50))``); every value is checked when the config
is made, and a bad one is a ``ValueError`` naming the option.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, TypeVar, cast, get_args

from hylo.layers.batch import DampingConvention
from hylo.layers.conv import DEFAULT_MAX_UNFOLD_MB, ConvRows
from hylo.records import LayerStats
from hylo.rules import (
    COUNT,
    DECAY,
    MEGABYTES,
    MEGABYTES_OR_ZERO,
    NON_NEGATIVE,
    PATH,
    POSITIVE,
    RATIO,
    REGEXES,
    Hyper,
    IntHyper,
    OptionSpec,
    Rule,
    Section,
    default_of,
    is_collection,
    is_count,
    option,
    window_decay,
)
from hylo.solvers import HYBRID, solver_names, variant_names
from hylo.solvers.adam_rule import KFACAdamConfig
from hylo.solvers.kfac import KFACConfig
from hylo.solvers.lowrank import ADAPTIVE, LowRankConfig
from hylo.solvers.registry import adapts_rank, solver_rule, variant_rule

T = TypeVar("T", int, float)
#: How owners share solved layers between ranks (see :class:`DistributedConfig`).
Strategy = Literal["inverse", "gradient"]
#: The studies ``studies`` accepts (docs/profiling.md, "Studies").
Study = Literal["grad_norm", "rank", "grad_error"]
STUDIES: tuple[Study, ...] = get_args(Study)
#: The most eigenvalue columns the rank study writes per layer (``rank_top_k``).
MAX_RANK_TOP_K = 4096


# --------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class ConvConfig(Section):
    """How a convolution's rows are built (docs/solvers.md, "Convolutions"; docs/design.md, "Memory")."""

    section_name: ClassVar[str | None] = "conv"

    conv_rows: ConvRows = option(
        "sum",
        doc="a convolution's low-rank rows: 'sum' (rank one per sample, mean patch × summed output gradient: "
        "the right scale), 'exact' (the true per-sample gradients, m·d_a·d_g numbers per layer) or 'mean' "
        "(HyLo's surrogate, L times too small for L output positions)",
        fixed=True,
    )
    max_unfold_mb: float = option(
        DEFAULT_MAX_UNFOLD_MB,
        doc="the most megabytes of a convolution's unfolded patches in flight at once: K-FAC's factor A, "
        "exact per-sample rows and the patch means are built in blocks of samples (or of one sample's output "
        "rows) of at most this size",
        rule=MEGABYTES,
        fixed=True,
    )


@dataclass(frozen=True)
class PolicyConfig(Section):
    """How each layer's solver is chosen at an update (docs/hybrid-policy.md)."""

    section_name: ClassVar[str | None] = "policy"

    layer_solvers: Mapping[str, str] = option(
        doc="per-layer overrides {name regex (full match): solver}; the first match wins",
        rule=Rule(lambda m: isinstance(m, Mapping), "a mapping {name regex: solver}"),
        default_factory=dict,
    )
    solver_fn: Callable[[str, int, LayerStats], str] | None = option(
        None,
        doc="(layer_name, step, stats) -> solver, called at update steps with a hylo.LayerStats; overrides "
        "the built-in hybrid rule",
        rule=Rule(callable, "callable (layer_name, step, stats) -> solver"),
    )
    fidelity_budget: float = option(
        0.05,
        doc="a layer gets exact sngd (else kfac) when that costs at most this share of an average layer's "
        "forward+backward work over the period; 0 turns the rule off",
        rule=NON_NEGATIVE,
    )
    comm_flops_per_byte: float = option(
        100.0,
        doc="with P > 1 ranks: the multiply-adds one byte of traffic is worth in the cost model (compute "
        "rate over network bandwidth)",
        rule=NON_NEGATIVE,
    )
    adaptive: tuple[int, int, int] | None = option(
        None,
        doc="HyLo's fixed windows (a0, a1, a2) in epochs of I = iters_per_epoch steps: the critical variant "
        "iff step < I·a0 or I·a1 < step <= I·a2 (0-based step, as HyLo's code counts), the stable one "
        "otherwise; replaces the trend",
        rule=Rule(
            lambda w: len(tuple(w)) == 3 and all(is_count(e, 0) for e in w) and w[1] <= w[2],
            "three epochs (a0, a1, a2) with a1 <= a2",
        ),
    )
    iters_per_epoch: int | None = option(None, doc="steps per epoch, required by adaptive", rule=COUNT)
    trend_decay: float | None = option(
        None,
        doc="EMA decay of each layer's gradient norm (and of its square); None: 1 − 2/(trend_window + 1), a "
        "memory of one window",
        rule=Rule(DECAY.holds, "in [0, 1) (or None: matched to trend_window)"),
    )
    trend_window: int = option(100, doc="steps over which the EMA's relative change is measured", rule=COUNT)
    critical_enter: float = option(
        0.2,
        doc="a layer turns critical when the change exceeds this (or critical_noise times its noise, if larger)",
        rule=POSITIVE,
    )
    critical_exit: float = option(
        0.1,
        doc="a critical layer turns stable when the change falls below this (or half the noise threshold, if larger)",
        rule=POSITIVE,
    )
    critical_noise: float = option(
        3.0,
        doc="z: the change must exceed z times its measured noise (std) to turn a layer critical (z/2 to "
        "keep it critical); 0 disables the noise floor",
        rule=NON_NEGATIVE,
    )
    critical_variant: str = option(
        "kid", doc="the low-rank variant of a layer in the critical regime", rule=variant_rule()
    )
    stable_variant: str = option("kis", doc="the low-rank variant of a layer in the stable regime", rule=variant_rule())
    kfac_solver: str = option(
        "kfac",
        doc="what hybrid gives a layer where K-FAC wins (fidelity or cost): 'kfac', or 'kfac_adam' (Adam in the "
        'K-FAC eigenbasis; docs/hybrid-policy.md, "With kfac_adam")',
        rule=Rule(
            lambda x: x in solver_names() and x not in variant_names(),
            lambda: (
                "a registered solver that is "
                f"not a low-rank variant, one of {tuple(n for n in solver_names() if n not in variant_names())}"
            ),
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for pattern, solver in dict(self.layer_solvers).items():
            if solver not in solver_names():
                raise ValueError(f"layer_solvers[{pattern!r}] must be one of {solver_names()}, got {solver!r}")
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                raise ValueError(f"layer_solvers key {pattern!r} is not a valid regular expression: {err}") from err
        if self.adaptive is not None:
            self._set("adaptive", tuple(self.adaptive))
            if self.iters_per_epoch is None:
                raise ValueError("iters_per_epoch must be an int >= 1 when adaptive is set")
        if not self.critical_exit <= self.critical_enter:
            raise ValueError(
                f"critical_exit must satisfy 0 < critical_exit <= critical_enter, got "
                f"critical_exit={self.critical_exit!r}, critical_enter={self.critical_enter!r}"
            )

    def override_for(self, layer: str) -> str | None:
        """The ``layer_solvers`` entry whose pattern fully matches ``layer`` first, if any."""
        for pattern, solver in self.layer_solvers.items():
            if re.fullmatch(pattern, layer):
                return solver
        return None

    @property
    def decay(self) -> float:
        """The trend's EMA decay: ``trend_decay``, or the one whose memory is ``trend_window`` steps."""
        return window_decay(self.trend_window) if self.trend_decay is None else self.trend_decay


@dataclass(frozen=True)
class DistributedConfig(Section):
    """How ranks share the work (docs/distributed.md)."""

    section_name: ClassVar[str | None] = "distributed"

    strategy: Strategy = option(
        "inverse",
        doc="'inverse': owners broadcast solved states (no traffic between updates); 'gradient': owners keep "
        "their states and broadcast preconditioned gradients every step (less memory per rank)",
        fixed=True,
    )
    bucket_cap_mb: float = option(
        25.0,
        doc="largest flat buffer of one fused collective (of the default communicator)",
        rule=MEGABYTES,
        fixed=True,
    )


@dataclass(frozen=True)
class TelemetryConfig(Section):
    """Profiling and the paper's studies (docs/profiling.md)."""

    section_name: ClassVar[str | None] = "telemetry"

    profile_dir: str | os.PathLike[str] | None = option(
        None,
        doc="directory of the profiling and study CSVs (timing-r{rank}.csv and steps-r{rank}.csv on every "
        "rank; decisions.csv, run.json and the studies' files on rank 0); None: nothing is timed or written",
        rule=PATH,
        fixed=True,
    )
    profile_append: bool = option(
        False,
        doc="continue the files already in profile_dir (a resumed run) instead of refusing them",
        rule=Rule(lambda x: isinstance(x, bool), "a bool"),
        fixed=True,
    )
    studies: tuple[Study, ...] = option(
        (),
        doc="any of 'grad_norm' (every step), 'rank' and 'grad_error' (sampled updates); they need profile_dir",
        rule=Rule(lambda s: is_collection(s) and all(x in STUDIES for x in s), f"drawn from {STUDIES}"),
        fixed=True,
    )
    rank_every: int = option(1, doc="run the rank study at every rank_every-th update", rule=COUNT)
    rank_top_k: int = option(
        10,
        doc=f"eigenvalues of K/B written per layer (sv_1 … sv_k, one CSV column each; at most {MAX_RANK_TOP_K})",
        rule=Rule(lambda x: is_count(x) and x <= MAX_RANK_TOP_K, f"an int in [1, {MAX_RANK_TOP_K}]"),
        fixed=True,
    )
    grad_error_every: int = option(
        1, doc="run the gradient-error study at every grad_error_every-th update", rule=COUNT
    )
    grad_error_methods: tuple[str, ...] = option(
        ("kid", "kis"),
        doc="the solvers compared with exact SNGD by the gradient-error study: any registered solver ('kfac' "
        "from the batch's factors, 'sngd' on the run's own convolution rows)",
        rule=Rule(
            lambda m: is_collection(m) and len(m) > 0 and all(x in solver_names() for x in m),
            "a non-empty selection of the registered solvers",
        ),
    )
    grad_error_ratios: tuple[float | Literal["auto"], ...] | None = option(
        None,
        doc="the ρ at which row-reducing solvers (KID, KIS) are measured ('auto': at rank_energy and the cap); "
        "None: (rank_ratio,)",
        rule=Rule(
            lambda r: is_collection(r) and len(r) > 0 and all(x == ADAPTIVE or RATIO.holds(x) for x in r),
            "ratios in (0, 1] or 'auto'",
        ),
    )
    study_exact_rows_mb: float = option(
        256.0,
        doc="largest gathered exact per-sample rows (m·d_a·d_g numbers) of a convolution the studies build "
        "for their reference; above it the reference uses conv_rows",
        rule=MEGABYTES_OR_ZERO,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("studies", "grad_error_methods", "grad_error_ratios"):
            if getattr(self, name) is not None:
                self._set(name, tuple(getattr(self, name)))
        if self.studies and self.profile_dir is None:
            raise ValueError(f"studies {self.studies} write CSV files: set profile_dir")


SECTIONS: dict[str, type[Section]] = {
    "kfac": KFACConfig,
    "kfac_adam": KFACAdamConfig,
    "lowrank": LowRankConfig,
    "conv": ConvConfig,
    "policy": PolicyConfig,
    "distributed": DistributedConfig,
    "telemetry": TelemetryConfig,
}


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
        doc="apply the states per group of equal layers, one batched kernel each; False: layer by layer, the "
        "reference path (same results to round-off)",
        rule=Rule(lambda x: isinstance(x, bool), "a bool"),
    )
    kfac: KFACConfig = field(default_factory=KFACConfig)
    kfac_adam: KFACAdamConfig = field(default_factory=KFACAdamConfig)
    lowrank: LowRankConfig = field(default_factory=LowRankConfig)
    conv: ConvConfig = field(default_factory=ConvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)

    def __init__(self, **options: Any) -> None:
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in options.items():
            if key in SECTIONS:
                if not isinstance(value, SECTIONS[key]):
                    raise ValueError(f"{key} must be a {SECTIONS[key].__name__}, got {type(value).__name__}")
                continue
            section = _SECTION_OF.get(key, ...)
            if section is ...:
                close = [name for name in sorted(_SECTION_OF) if name.startswith(key[:4])][:3]
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise TypeError(f"unknown hylo option {key!r}{hint} (see hylo.config.options())")
            if section is None:
                self._set(key, value)
            else:
                sections[section][key] = value
        for f in fields(self):
            if f.name in SECTIONS:
                base: Any = options.get(f.name) or SECTIONS[f.name]()
                self._set(f.name, dataclasses.replace(base, **sections[f.name]) if sections[f.name] else base)
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
        section = _SECTION_OF[name]
        return getattr(self if section is None else getattr(self, section), name)

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


#: The top level and every section, in the order :func:`options` lists them.
_CLASSES: tuple[type[Section], ...] = (HyLoConfig, *SECTIONS.values())


def options() -> list[OptionSpec]:
    """Every option of :class:`HyLoConfig`, top level first, then section by section."""
    return [spec for cls in _CLASSES for spec in cls.option_specs().values()]


#: Every option by flat name; an option name is defined once.
_SPECS: dict[str, OptionSpec] = {}
for _spec_ in options():
    if _spec_.name in _SPECS or _spec_.name in SECTIONS:
        raise ImportError(f"option name {_spec_.name!r} is defined twice")
    _SPECS[_spec_.name] = _spec_
#: Each option's section (None: the top level), by flat name.
_SECTION_OF: dict[str, str | None] = {name: spec.section for name, spec in _SPECS.items()}


def resolve(name: str, value: T | Callable[[int], T], step: int) -> T:
    """Evaluate option ``name`` — a constant or a callable of the step — at ``step``, checked by its rule.

    A float option's value comes back as a float: an int the rule accepts (at most 2**63) never reaches
    torch as a Python int, whose products (``lr²``) would leave int64."""
    spec = _SPECS[name]
    if callable(value):
        result = value(step)
        assert spec.rule is not None, f"{name} is not a schedule"
        spec.rule.check(name, result, step)
    else:
        result = value
    return cast(T, float(result)) if spec.type is float else result
