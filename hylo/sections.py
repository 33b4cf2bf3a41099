"""The preconditioner's own sections of :class:`hylo.HyLoConfig`: how convolutions' rows are built, how the
hybrid policy chooses, how ranks share the work, and what is profiled (docs/usage.md, "Options").

The solver families' sections live with their families (:class:`~hylo.solvers.kfac.KFACConfig`,
:class:`~hylo.solvers.lowrank.LowRankConfig`, a registered family's own); :mod:`hylo.config` holds them all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

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
    Rule,
    Section,
    is_collection,
    is_count,
    option,
    window_decay,
)
from hylo.solvers import solver_names, variant_names
from hylo.solvers.lowrank import ADAPTIVE
from hylo.solvers.registry import variant_rule

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
        doc="what hybrid gives a layer where K-FAC wins (fidelity or cost): 'kfac', or another registered solver "
        "that is not a low-rank variant, such as Adam in the K-FAC eigenbasis "
        '(docs/hybrid-policy.md, "With Adam in the K-FAC eigenbasis")',
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
        "their states and share preconditioned gradients every step (less memory per rank)",
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
