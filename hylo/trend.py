"""Each layer's gradient-norm trend: the hybrid policy's critical regime (docs/hybrid-policy.md, "Critical regime").

Per layer, EMAs of ‖∇W‖ and ‖∇W‖² with decay β (``trend_decay``, by default the decay whose
memory is ``trend_window`` steps); at an update, the trend t = |EMA − EMA_ref| / |EMA_ref| against
the newest sample at least a window old, its noise, and the critical flags with hysteresis. The
trend holds state only: its parameters are read from the :class:`~hylo.config.PolicyConfig`
passed to each call.

A sample is folded in as min(‖∇W‖, :data:`NORM_CAP`): the cap (√(float64 max)/2 ≈ 6.7·10¹⁵³) keeps
its square, both EMAs and every difference :meth:`GradNormTrend.sample` takes finite, so finite
norms (or a float64 norm that overflowed although every entry is finite) never make the trend
non-finite; norms below the cap are folded in exactly as they are (docs/hybrid-policy.md,
"Critical regime"). :func:`checked_trend` checks a saved trend before a load restores it
(docs/reliability.md, "Checkpoints").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from hylo.rules import is_index, is_number
from hylo.sections import PolicyConfig

#: The largest norm a sample contributes: its square, and a difference of two squares, stay finite in float64.
NORM_CAP = math.sqrt(torch.finfo(torch.float64).max) / 2.0


class GradNormTrend:
    """EMAs of each layer's gradient norm and squared norm, kept on device; sampled at update steps.

    ``observe`` costs one fused update of a (2, layers) tensor per step and never syncs;
    ``sample`` does one host transfer for all layers and updates the critical flags with
    hysteresis, against thresholds raised to ``z`` times the measured noise of the trend
    (docs/hybrid-policy.md, "Critical regime").
    """

    def __init__(self, n_layers: int) -> None:
        self.moments: Tensor | None = None  # rows: EMA of ‖∇W‖, EMA of ‖∇W‖²
        self.history: deque[tuple[int, list[float], list[float]]] = deque()  # (step, EMA, variance)
        self.critical = [True] * n_layers
        self.last_trend: list[float | None] = [None] * n_layers
        self.last_noise: list[float | None] = [None] * n_layers
        self._exponents: Tensor | None = None  # (1, 2) as a column, made once per device by _powers

    def tensors(self) -> list[Tensor]:
        """What the trend keeps between steps: its EMAs and the exponents :meth:`observe` uses."""
        held = [] if self.moments is None else [self.moments]
        return held if self._exponents is None else [*held, self._exponents]

    def _powers(self, device: torch.device) -> Tensor:
        """The column (1, 2) of exponents :meth:`observe` raises the norms to, made once per device."""
        powers = self._exponents
        if powers is None or powers.device != device:
            powers = self._exponents = torch.tensor([[1.0], [2.0]], dtype=torch.float64).to(device)
        return powers

    @property
    def ema(self) -> Tensor | None:
        """EMA of each layer's gradient norm (on device); None before the first ``observe``."""
        return None if self.moments is None else self.moments[0]

    @property
    def ema_sq(self) -> Tensor | None:
        """EMA of each layer's squared gradient norm (on device); None before the first ``observe``."""
        return None if self.moments is None else self.moments[1]

    def observe(self, norms: Tensor, decay: float, present: Tensor | None = None) -> None:
        """Fold this step's per-layer gradient norms into the EMAs with ``decay`` (on device).

        Layers not ``present`` (no gradient this step) keep their EMAs as they were. A norm above
        :data:`NORM_CAP` (or an infinite one) counts as :data:`NORM_CAP`: the EMAs stay finite.
        """
        norms = norms.detach().to(torch.float64).clamp(max=NORM_CAP)
        moments = norms.unsqueeze(0).pow(self._powers(norms.device))  # (‖∇W‖, ‖∇W‖²) in one operation
        if self.moments is None:
            self.moments = moments
            return
        blended = torch.lerp(self.moments, moments, 1.0 - decay)
        self.moments = blended if present is None else torch.where(present, blended, self.moments)

    def snapshot(self) -> tuple[Any, ...]:
        """Everything ``observe`` and ``sample`` change (cheap: no tensor copies), for :meth:`restore`."""
        return (self.moments, deque(self.history), list(self.critical), list(self.last_trend), list(self.last_noise))

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Go back to a :meth:`snapshot` (a step that failed leaves the trend as it was)."""
        moments, history, critical, last_trend, last_noise = snapshot
        self.moments, self.history = moments, deque(history)
        self.critical, self.last_trend, self.last_noise = list(critical), list(last_trend), list(last_noise)

    def sample(self, step: int, config: PolicyConfig) -> tuple[list[float], list[float | None], list[bool]]:
        """EMA values, relative change over the window, and critical flags at ``step``, by ``config``'s
        ``trend_window`` and thresholds."""
        window, decay = config.trend_window, config.decay
        enter, exit_, z = config.critical_enter, config.critical_exit, config.critical_noise
        assert self.moments is not None, "observe() must run before sample()"
        ema, ema_sq = self.moments.tolist()
        variance = [max(sq - m * m, 0.0) for m, sq in zip(ema, ema_sq, strict=True)]
        past = None
        while self.history and self.history[0][0] <= step - window:
            past = self.history.popleft()
        if past is not None:
            self.history.appendleft(past)  # keep the newest value at least a window old
        self.history.append((step, ema, variance))
        # std of the difference of two EMAs of i.i.d. values a window apart, per unit of the values' std
        spread = math.sqrt(2.0 * (1.0 - decay) / (1.0 + decay))
        for i, value in enumerate(ema):
            if past is None:
                self.last_trend[i] = self.last_noise[i] = None
                continue
            reference, scale = past[1][i], max(abs(past[1][i]), 1e-30)
            trend = abs(value - reference) / scale
            # the larger variance of the window's two ends: a dip of the EMA (and with it of the
            # variance, for noise that scales with the norm) cannot lower the bar by itself
            noise = spread * math.sqrt(max(variance[i], past[2][i])) / scale
            self.last_trend[i], self.last_noise[i] = trend, noise
            if self.critical[i] and trend < max(exit_, 0.5 * z * noise):
                self.critical[i] = False
            elif not self.critical[i] and trend > max(enter, z * noise):
                self.critical[i] = True
        return ema, list(self.last_trend), list(self.critical)

    def state_dict(self) -> dict[str, Any]:
        """Serializable state."""
        return {
            "ema": None if self.ema is None else self.ema.cpu().clone(),
            "ema_sq": None if self.ema_sq is None else self.ema_sq.cpu().clone(),
            "history": list(self.history),
            "critical": list(self.critical),
            "last_trend": list(self.last_trend),
            "last_noise": list(self.last_noise),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore ``state_dict``; a state without ``ema_sq`` (older format) starts it at ema² (noise unknown)."""
        ema = state["ema"]
        if ema is None:
            self.moments = None
        else:
            ema = ema.to(device=device, dtype=torch.float64)
            ema_sq = state.get("ema_sq")
            capped = ema.clamp(max=NORM_CAP)
            ema_sq = capped * capped if ema_sq is None else ema_sq.to(device=device, dtype=torch.float64)
            self.moments = torch.stack((ema, ema_sq))
        # older states keep no variance per sample: 0 (unknown) leaves the current one to judge
        self.history = deque(
            (int(entry[0]), list(entry[1]), list(entry[2]) if len(entry) > 2 else [0.0] * len(entry[1]))
            for entry in state["history"]
        )
        self.critical = list(state["critical"])
        self.last_trend = list(state["last_trend"])
        self.last_noise = list(state.get("last_noise", [None] * len(self.critical)))


#: Keys of a saved trend (``ema_sq`` and ``last_noise`` are absent from older states).
TREND_KEYS = frozenset(("ema", "ema_sq", "history", "critical", "last_trend", "last_noise"))


def _finite_numbers(values: object, n: int, optional: bool = False) -> bool:
    """Whether ``values`` is a list or tuple of ``n`` finite numbers (or ``None`` where ``optional``)."""
    return (
        isinstance(values, list | tuple)
        and len(values) == n
        and all((v is None and optional) or (is_number(v) and math.isfinite(v)) for v in values)
    )


def _trend_problems(state: Mapping[Any, Any], n: int) -> list[str]:
    """What keeps ``state`` from being the trend of ``n`` layers (nothing: an empty list)."""
    problems = []
    unknown = sorted(set(state) - TREND_KEYS, key=repr)
    if unknown:
        problems.append(f"unknown keys {unknown}")
    for key in ("ema", "history", "critical", "last_trend"):
        if key not in state:
            problems.append(f"no {key!r}")
    for key in ("ema", "ema_sq"):
        value = state.get(key)
        if value is not None and not (
            isinstance(value, Tensor)
            and value.dtype in (torch.float32, torch.float64)
            and value.layout == torch.strided
            and tuple(value.shape) == (n,)
            and bool(value.isfinite().all())
        ):
            problems.append(f"{key} is not {n} finite float values")
    if state.get("ema") is None and state.get("ema_sq") is not None:
        problems.append("ema_sq without ema")
    history = state.get("history", [])
    if not isinstance(history, list | tuple) or not all(
        isinstance(entry, list | tuple)
        and len(entry) in (2, 3)
        and is_index(entry[0])
        and all(_finite_numbers(values, n) for values in entry[1:])
        and (len(entry) == 2 or all(v >= 0 for v in entry[2]))
        for entry in history
    ):
        problems.append("history is not a list of (step, EMAs, variances) of finite values")
    critical = state.get("critical", [])
    if not (isinstance(critical, list | tuple) and len(critical) == n and all(isinstance(c, bool) for c in critical)):
        problems.append(f"critical flags {critical!r}")
    for key in ("last_trend", "last_noise"):
        if not _finite_numbers(state.get(key, [None] * n), n, optional=True):
            problems.append(f"{key} {state.get(key)!r}")
    return problems


def checked_trend(state: object, n: int, device: torch.device) -> GradNormTrend:
    """A trend loaded from ``state`` and checked against ``n`` layers (else ``ValueError``)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state_dict's trend is not a mapping: {type(state).__name__}")
    problems = _trend_problems(state, n)
    if problems:
        raise ValueError(f"state_dict's trend does not fit {n} layers: {'; '.join(problems)}")
    trend = GradNormTrend(n)
    trend.load_state_dict(dict(state), device)
    return trend
