"""Typed options of the preconditioner: the one place defaults and checks live."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeVar

SolverName = Literal["kfac", "sngd", "kid", "kis", "hybrid"]
#: Every solver name the preconditioner understands.
SOLVER_NAMES: tuple[str, ...] = ("kfac", "sngd", "kid", "kis", "hybrid")

T = TypeVar("T", int, float)
#: A hyperparameter: a constant or a callable of the step (0-based count of ``step()`` calls).
Hyper = float | Callable[[int], float]
IntHyper = int | Callable[[int], int]


def _positive(x: float) -> bool:
    return x > 0 and math.isfinite(x)


_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "damping": (_positive, "a finite number > 0"),
    "update_freq": (lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= 1, "an int >= 1"),
    "factor_decay": (lambda x: 0.0 <= x < 1.0, "in [0, 1)"),
    "kl_clip": (_positive, "a finite number > 0 (or None to disable)"),
    "lr": (_positive, "a finite number > 0"),
}


def check_value(name: str, value: Any, step: int | None = None) -> None:
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


def resolve(name: str, value: T | Callable[[int], T], step: int) -> T:
    """Evaluate a constant-or-callable hyperparameter at ``step`` and validate the result."""
    if callable(value):
        result = value(step)
        check_value(name, result, step)
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
    """

    solver: str = "sngd"
    update_freq: IntHyper = 10
    damping: Hyper = 1.0
    factor_decay: Hyper = 0.95
    kl_clip: Hyper | None = None
    lr: Hyper | None = None
    skip_layers: tuple[str, ...] = ()
    rank_ratio: float = 0.1
    rank: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.solver not in SOLVER_NAMES:
            raise ValueError(f"solver must be one of {SOLVER_NAMES}, got {self.solver!r}")
        for name in ("update_freq", "damping", "factor_decay", "lr"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                check_value(name, value)
        if self.kl_clip is not None:
            if not callable(self.kl_clip):
                check_value("kl_clip", self.kl_clip)
            if self.lr is None:
                raise ValueError("lr must be given when kl_clip is set (the clip scales by lr²)")
        if isinstance(self.skip_layers, str):
            raise ValueError("skip_layers must be a sequence of names, not a single string")
        object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        if not (isinstance(self.rank_ratio, (int, float)) and 0.0 < self.rank_ratio <= 1.0):
            raise ValueError(f"rank_ratio must be in (0, 1], got {self.rank_ratio!r}")
        if self.rank is not None and (
            not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1
        ):
            raise ValueError(f"rank must be an int >= 1 (rows kept per rank), got {self.rank!r}")

    def rows_kept(self, local_rows: int) -> int:
        """Rows r each rank keeps for KID/KIS out of ``local_rows``."""
        r = self.rank if self.rank is not None else max(1, math.floor(self.rank_ratio * local_rows))
        return min(r, local_rows)

    def constants(self) -> dict[str, Any]:
        """The options that are plain values (callables are left out), for ``state_dict``."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not callable(getattr(self, f.name))
        }
