"""Typed options of the preconditioner: the one place defaults and checks live."""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar, get_args

from hylo.layers import (
    CONV_ROWS,
    DAMPING_CONVENTIONS,
    DEFAULT_KFC_EXPONENT,
    DEFAULT_MAX_UNFOLD_MB,
    ConvRows,
    DampingConvention,
)
from hylo.records import LayerStats
from hylo.solvers import LAYER_SOLVERS, LayerSolver

#: What ``solver`` accepts: a layer solver, or ``"hybrid"`` to choose one per layer and update.
SolverName = Literal[LayerSolver, "hybrid"]
SOLVER_NAMES: tuple[SolverName, ...] = get_args(SolverName)
#: How owners share solved layers between ranks (see :class:`HyLoConfig`).
Strategy = Literal["inverse", "gradient"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
#: KIS's estimator (see :class:`HyLoConfig`).
KISEstimator = Literal["unbiased", "hylo"]
KIS_ESTIMATORS: tuple[KISEstimator, ...] = get_args(KISEstimator)

#: The studies ``studies`` accepts (docs/design.md, "Studies").
Study = Literal["grad_norm", "rank", "grad_error"]
STUDIES: tuple[Study, ...] = get_args(Study)
#: The methods ``grad_error_methods`` accepts.
GradErrorMethod = Literal["kid", "kis", "kfac", "sngd"]
GRAD_ERROR_METHODS: tuple[GradErrorMethod, ...] = get_args(GradErrorMethod)

T = TypeVar("T", int, float)
#: A hyperparameter: a constant or a callable of the step (0-based count of ``step()`` calls).
Hyper = float | Callable[[int], float]
IntHyper = int | Callable[[int], int]


def _is_bool(x: object) -> bool:
    """Python, NumPy and 0-dim torch booleans: never a number here."""
    return isinstance(x, bool) or str(getattr(x, "dtype", "")) in ("bool", "torch.bool")


def _positive(x: float) -> bool:
    return not _is_bool(x) and x > 0 and math.isfinite(x)


def is_number(x: object) -> bool:
    """An int or float, not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "damping": (_positive, "a finite number > 0"),
    "update_freq": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1, "an int >= 1"),
    "factor_update_freq": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1, "an int >= 1"),
    "factor_decay": (lambda x: not _is_bool(x) and 0.0 <= x < 1.0, "a number in [0, 1)"),
    "kl_clip": (_positive, "a finite number > 0 (or None to disable)"),
    "lr": (_positive, "a finite number > 0"),
}


def _check_value(name: str, value: Any, step: int | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` if ``value`` is not allowed for it."""
    ok, expected = _CHECKS[name]
    valid = False
    try:
        valid = bool(ok(value))
    except TypeError:
        valid = False
    if not valid:
        where = "" if step is None else f" (returned by the callable at step {step})"
        raise ValueError(f"{name} must be {expected}, got {value!r}{where}")


def rows_for_ratio(ratio: float, rows: int) -> int:
    """r = max(1, ⌊ρ·n⌋), at most n: the rows a rank keeps out of n at rank ratio ρ."""
    return min(rows, max(1, math.floor(ratio * rows)))


def resolve(name: str, value: T | Callable[[int], T], step: int) -> T:
    """Evaluate a constant-or-callable hyperparameter at ``step`` and validate the result."""
    if callable(value):
        result = value(step)
        _check_value(name, result, step)
        return result
    return value


@dataclass(frozen=True)
class HyLoConfig:
    """Options of :class:`hylo.HyLoPreconditioner`.

    Attributes:
        solver: ``"kfac"``, ``"sngd"``, ``"kid"``, ``"kis"`` or ``"hybrid"``.
        update_freq: steps between factor/inverse updates (step 0 is an update step).
        damping: Tikhonov damping λ > 0 of (F + λI).
        factor_decay: running-average decay β of the K-FAC factors.
        kl_clip: scale the whole preconditioned step by min(1, sqrt(kl_clip / (lr²·Σ v̂·∇W)));
            None disables it.
        lr: learning rate used by ``kl_clip`` (required when ``kl_clip`` is set).
        skip_layers: module names or class names (regular expressions, full match) to leave alone.
        rank_ratio: KID/KIS rows kept per rank, r = max(1, floor(ρ·n)); ρ in (0, 1].
        rank: absolute rows kept per rank (overrides ``rank_ratio`` when set).
        seed: seed of the generator that draws the KIS rows.
        conv_rows: a convolution's low-rank rows: ``"sum"`` (rank-one surrogate of each
            per-sample gradient with the right scale), ``"exact"`` (the true per-sample
            gradients, m·d_a·d_g numbers per layer) or ``"mean"`` (HyLo's surrogate, L times
            too small for L output positions); see docs/design.md, "Convolutions".
        kfc_exponent: e of a convolution's K-FAC factors L^e·E_p[a aᵀ] ⊗ E_p[g gᵀ] over its L
            output positions (1: Grosse & Martens' KFC; 2: fully correlated positions);
            docs/design.md, "K-FAC conventions".
        max_unfold_mb: the most megabytes of a convolution's unfolded patches in flight at
            once: K-FAC's factor A, exact per-sample rows and the patch means are built in
            chunks of samples (and of output rows, when one sample's patches exceed it) of at
            most this size; docs/design.md, "Memory".
        damping_convention: ``"hylo"`` (λ damps the Fisher of g = n·∂L/∂s, the same at every
            batch size) or ``"kaisa"`` (every layer's Fisher divided by KAISA's ratio c: n² on
            Linear, n²·L^(4+e) on Conv2d, so KAISA's damping and learning rate carry over and
            ``solver="kfac"`` takes KAISA's eigen-method step).
        kis_estimator: ``"unbiased"`` (priority sampling with Horvitz–Thompson weights,
            divisor B) or ``"hylo"`` (HyLo's unweighted draw, divisor m).
        factor_update_freq: steps between refreshes of K-FAC's running factors (KAISA's
            ``factor_update_freq``); the factors are also refreshed at every update step.
            None: only at update steps.
        fidelity_budget: the hybrid policy gives a layer exact ``sngd`` (else ``kfac``) when that
            costs at most this share of an average layer's forward+backward work over the
            period; 0 turns the rule off.
        comm_flops_per_byte: multiply-adds one byte of traffic is worth in the hybrid cost model
            (the machine's compute rate over its network bandwidth); used when P > 1.
        layer_solvers: per-layer overrides, ``{name regex (full match): solver}``; first match wins.
        solver_fn: ``(layer_name, step, stats) -> solver`` called at update steps (see
            :class:`hylo.LayerStats`); overrides the built-in hybrid rule.
        adaptive: HyLo's fixed windows ``(a0, a1, a2)`` in epochs of I = ``iters_per_epoch`` steps:
            KID iff step < I·a0 or I·a1 < step ≤ I·a2 (the 0-based step, as HyLo's code counts),
            KIS otherwise; replaces the gradient-norm trend.
        iters_per_epoch: steps per epoch, for ``adaptive``.
        trend_decay: EMA decay of the per-layer gradient norm (and of its square); None: the
            decay whose memory is the window, 1 − 2/(trend_window + 1).
        trend_window: steps over which the EMA's relative change is measured.
        critical_enter: a layer becomes critical (KID) when that change exceeds this (or
            ``critical_noise`` times the change's measured noise, if larger).
        critical_exit: a critical layer returns to KIS when the change falls below this (or
            half the noise threshold, if larger).
        critical_noise: z, the multiple of the change's noise (std) a change must exceed to
            count; 0 disables the noise floor.
        strategy: ``"inverse"`` (owners broadcast solved states; no traffic between updates) or
            ``"gradient"`` (owners keep their states and broadcast preconditioned gradients
            every step; less memory per rank).
        bucket_cap_mb: largest flat buffer of one collective (default communicator only).
        profile_dir: directory of the profiling and study CSVs (docs/design.md, "Profiling"):
            ``timing-r{rank}.csv`` and ``steps-r{rank}.csv`` on every rank, ``decisions.csv``,
            ``run.json`` and the studies' files on rank 0. None: nothing is timed or written.
        studies: any of ``"grad_norm"`` (every step), ``"rank"`` and ``"grad_error"`` (sampled
            update steps); they need ``profile_dir``.
        profile_append: continue the files already in ``profile_dir`` (a resumed run) instead
            of refusing them.
        rank_every: run the rank study at every ``rank_every``-th update.
        rank_top_k: eigenvalues of K/B written per layer (``sv_1`` … ``sv_k``).
        grad_error_every: run the gradient-error study at every ``grad_error_every``-th update.
        grad_error_methods: the methods compared with exact SNGD: ``"kid"``, ``"kis"``,
            ``"kfac"`` and ``"sngd"`` (the run's own convolution rows).
        grad_error_ratios: the ρ at which KID and KIS are measured; None: ``(rank_ratio,)``.
        study_exact_rows_mb: largest gathered exact per-sample rows (m·d_a·d_g numbers) of a
            convolution the studies build for their reference; above it they use ``conv_rows``.
    """

    solver: SolverName = "hybrid"
    update_freq: IntHyper = 10
    damping: Hyper = 1.0
    factor_decay: Hyper = 0.95
    kl_clip: Hyper | None = None
    lr: Hyper | None = None
    skip_layers: tuple[str, ...] = ()
    rank_ratio: float = 0.1
    rank: int | None = None
    seed: int = 0
    conv_rows: ConvRows = "sum"
    kfc_exponent: float = DEFAULT_KFC_EXPONENT
    max_unfold_mb: float = DEFAULT_MAX_UNFOLD_MB
    damping_convention: DampingConvention = "hylo"
    kis_estimator: KISEstimator = "unbiased"
    factor_update_freq: IntHyper | None = None
    fidelity_budget: float = 0.05
    comm_flops_per_byte: float = 100.0
    layer_solvers: Mapping[str, LayerSolver] = field(default_factory=dict)
    solver_fn: Callable[[str, int, LayerStats], LayerSolver] | None = None
    adaptive: tuple[int, int, int] | None = None
    iters_per_epoch: int | None = None
    trend_decay: float | None = None
    trend_window: int = 100
    critical_enter: float = 0.2
    critical_exit: float = 0.1
    critical_noise: float = 3.0
    strategy: Strategy = "inverse"
    bucket_cap_mb: float = 25.0
    profile_dir: str | os.PathLike[str] | None = None
    studies: tuple[Study, ...] = ()
    profile_append: bool = False
    rank_every: int = 1
    rank_top_k: int = 10
    grad_error_every: int = 1
    grad_error_methods: tuple[GradErrorMethod, ...] = ("kid", "kis")
    grad_error_ratios: tuple[float, ...] | None = None
    study_exact_rows_mb: float = 256.0

    def __post_init__(self) -> None:
        if self.solver not in SOLVER_NAMES:
            raise ValueError(f"solver must be one of {SOLVER_NAMES}, got {self.solver!r}")
        for name in ("update_freq", "factor_update_freq", "damping", "factor_decay", "lr"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                _check_value(name, value)
        if self.kl_clip is not None:
            if not callable(self.kl_clip):
                _check_value("kl_clip", self.kl_clip)
            if self.lr is None:
                raise ValueError("lr must be given when kl_clip is set (the clip scales by lr²)")
        if isinstance(self.skip_layers, str):
            raise ValueError("skip_layers must be a sequence of names, not a single string")
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        for pattern in self.skip_layers:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                raise ValueError(f"skip_layers entry {pattern!r} is not a valid regular expression: {err}") from err
        if isinstance(self.rank_ratio, bool) or not (
            isinstance(self.rank_ratio, (int, float)) and 0.0 < self.rank_ratio <= 1.0
        ):
            raise ValueError(f"rank_ratio must be in (0, 1], got {self.rank_ratio!r}")
        if self.rank is not None and (not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1):
            raise ValueError(f"rank must be an int >= 1 (rows kept per rank), got {self.rank!r}")
        if isinstance(self.seed, bool) or not (isinstance(self.seed, numbers.Integral) and 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "seed", int(self.seed))

        if self.conv_rows not in CONV_ROWS:
            raise ValueError(f"conv_rows must be one of {CONV_ROWS}, got {self.conv_rows!r}")
        if _is_bool(self.kfc_exponent) or not (
            isinstance(self.kfc_exponent, (int, float)) and 0.0 <= self.kfc_exponent <= 4.0
        ):
            raise ValueError(f"kfc_exponent must be a number in [0, 4], got {self.kfc_exponent!r}")
        object.__setattr__(self, "kfc_exponent", float(self.kfc_exponent))
        if _is_bool(self.max_unfold_mb) or not (
            isinstance(self.max_unfold_mb, (int, float)) and 0 < self.max_unfold_mb < math.inf
        ):
            raise ValueError(f"max_unfold_mb must be a finite number > 0, got {self.max_unfold_mb!r}")
        if self.damping_convention not in DAMPING_CONVENTIONS:
            raise ValueError(
                f"damping_convention must be one of {DAMPING_CONVENTIONS}, got {self.damping_convention!r}"
            )
        if self.kis_estimator not in KIS_ESTIMATORS:
            raise ValueError(f"kis_estimator must be one of {KIS_ESTIMATORS}, got {self.kis_estimator!r}")
        for name in ("fidelity_budget", "comm_flops_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if not (isinstance(self.bucket_cap_mb, (int, float)) and self.bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")
        self._check_policy()
        self._check_studies()

    def _check_studies(self) -> None:
        for name in ("studies", "grad_error_methods"):
            if isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a sequence of names, not a single string")
        object.__setattr__(self, "studies", tuple(self.studies))
        object.__setattr__(self, "grad_error_methods", tuple(self.grad_error_methods))
        unknown = [s for s in self.studies if s not in STUDIES]
        if unknown:
            raise ValueError(f"studies must be drawn from {STUDIES}, got {unknown}")
        if self.studies and self.profile_dir is None:
            raise ValueError(f"studies {self.studies} write CSV files: set profile_dir")
        bad_methods = [m for m in self.grad_error_methods if m not in GRAD_ERROR_METHODS]
        if bad_methods or not self.grad_error_methods:
            raise ValueError(
                f"grad_error_methods must be a non-empty selection of {GRAD_ERROR_METHODS}, got {bad_methods or '()'}"
            )
        if self.profile_dir is not None and not isinstance(self.profile_dir, (str, os.PathLike)):
            raise ValueError(f"profile_dir must be a path or None, got {self.profile_dir!r}")
        for name in ("rank_every", "rank_top_k", "grad_error_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.grad_error_ratios is not None:
            if isinstance(self.grad_error_ratios, (str, float, int)):
                raise ValueError(f"grad_error_ratios must be a sequence of ratios, got {self.grad_error_ratios!r}")
            ratios = tuple(self.grad_error_ratios)
            if not ratios or not all(is_number(r) and 0.0 < r <= 1.0 for r in ratios):
                raise ValueError(f"grad_error_ratios must be ratios in (0, 1], got {self.grad_error_ratios!r}")
            object.__setattr__(self, "grad_error_ratios", ratios)
        if not (is_number(self.study_exact_rows_mb) and 0 <= self.study_exact_rows_mb < math.inf):
            raise ValueError(f"study_exact_rows_mb must be a finite number >= 0, got {self.study_exact_rows_mb!r}")

    def _check_policy(self) -> None:
        for pattern, solver in dict(self.layer_solvers).items():
            if solver not in LAYER_SOLVERS:
                raise ValueError(f"layer_solvers[{pattern!r}] must be one of {LAYER_SOLVERS}, got {solver!r}")
            try:
                re.compile(pattern)
            except (re.error, TypeError) as err:
                raise ValueError(f"layer_solvers key {pattern!r} is not a valid regular expression: {err}") from err
        if self.solver_fn is not None and not callable(self.solver_fn):
            raise ValueError("solver_fn must be callable (layer_name, step, stats) -> solver")
        if self.adaptive is not None:
            window = tuple(self.adaptive)
            if (
                len(window) != 3
                or not all(isinstance(e, int) and e >= 0 for e in window)
                or not (window[1] <= window[2])
            ):
                raise ValueError(f"adaptive must be three epochs (a0, a1, a2) with a1 <= a2, got {self.adaptive!r}")
            object.__setattr__(self, "adaptive", window)
            if not (isinstance(self.iters_per_epoch, int) and self.iters_per_epoch >= 1):
                raise ValueError("iters_per_epoch must be an int >= 1 when adaptive is set")
        if self.trend_decay is not None and not (is_number(self.trend_decay) and 0.0 <= self.trend_decay < 1.0):
            raise ValueError(
                f"trend_decay must be in [0, 1) (or None: matched to trend_window), got {self.trend_decay!r}"
            )
        if not (isinstance(self.trend_window, int) and self.trend_window >= 1):
            raise ValueError(f"trend_window must be an int >= 1, got {self.trend_window!r}")
        if not (0.0 < self.critical_exit <= self.critical_enter):
            raise ValueError(
                f"critical_exit must satisfy 0 < critical_exit <= critical_enter, got "
                f"critical_exit={self.critical_exit!r}, critical_enter={self.critical_enter!r}"
            )
        if not (is_number(self.critical_noise) and 0.0 <= self.critical_noise < math.inf):
            raise ValueError(f"critical_noise must be a finite number >= 0, got {self.critical_noise!r}")

    def override_for(self, layer: str) -> LayerSolver | None:
        """The ``layer_solvers`` entry whose pattern fully matches ``layer`` first, if any."""
        for pattern, solver in self.layer_solvers.items():
            if re.fullmatch(pattern, layer):
                return solver
        return None

    def initial_solver(self, layer: str) -> SolverName:
        """A layer's solver before its first update: its override, else ``solver``."""
        return self.override_for(layer) or self.solver

    def rows_kept(self, local_rows: int) -> int:
        """Rows r each rank keeps for KID/KIS out of ``local_rows``."""
        if self.rank is not None:
            return min(self.rank, local_rows)
        return rows_for_ratio(self.rank_ratio, local_rows)

    def constants(self) -> dict[str, Any]:
        """The options that are plain values (callables are left out; paths as strings), for ``state_dict``."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if not callable(getattr(self, f.name))}
        if values["profile_dir"] is not None:
            values["profile_dir"] = os.fspath(values["profile_dir"])
        return values
