"""Where a step's time goes: consecutive intervals charged to layers and phases (docs/profiling.md, "Timing").

A :class:`Stopwatch` splits one ``step()`` into back-to-back intervals. Each ``lap`` closes the
interval since the previous one and charges it to a phase and to one or more layers (split in
proportion to the given weights), or to a step-level slot when no layer is named. Intervals
are consecutive, so the charged times add up to the step's time between ``start`` and the last
lap: nothing inside is unaccounted for, and an interval is charged to the code that ran in it.

On CPU the marks are ``time.perf_counter()``; on CUDA they are events recorded on the current
stream and :meth:`Stopwatch.finish` synchronises once per step (only while profiling). A
disabled stopwatch (``Stopwatch(None)``) does nothing at all.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: The per-layer phases of an update step, in the order they run.
PHASES = ("capture", "reduce", "gather", "solve", "broadcast", "precondition")
#: Step-level slots: work that belongs to no layer.
STEP_SLOTS = ("check", "decide", "study")


@dataclass
class StepTimes:
    """Milliseconds of one step: per (layer, phase), per step-level slot, and in total."""

    layers: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(lambda: dict.fromkeys(PHASES, 0.0)))
    slots: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_SLOTS, 0.0))
    total: float = 0.0
    #: Per layer, the time its gradient hooks spent reducing its calls in the step's backward
    #: passes (docs/design.md, "Memory"): before ``step()``, so not part of ``total``.
    hooks: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def phase_total(self, phase: str) -> float:
        """``phase`` summed over layers."""
        return sum(times[phase] for times in self.layers.values())


class Stopwatch:
    """Charges consecutive intervals of one step to (layer, phase) or step-level slots.

    Args:
        device: the device whose work is timed; None disables the stopwatch.
    """

    def __init__(self, device: torch.device | None) -> None:
        self.enabled = device is not None
        self._cuda = device is not None and device.type == "cuda"
        self._origin: Any = None
        self._laps: list[tuple[str, tuple[str, ...], Sequence[float] | None, Any]] = []
        self._hooks: list[tuple[str, Any, Any]] = []

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed_ms(self, begin: Any, end: Any) -> float:
        if self._cuda:
            return float(begin.elapsed_time(end))
        return 1e3 * (end - begin)

    def start(self) -> None:
        """Open the step's first interval."""
        if self.enabled:
            self._laps = []
            self._origin = self._mark()

    def mark(self) -> Any:
        """The start of an interval outside the step (None when disabled); close it with :meth:`hook`."""
        return self._mark() if self.enabled else None

    def hook(self, layer: str, begin: Any) -> None:
        """Charge the interval since ``begin`` (a :meth:`mark`) to ``layer``'s backward-hook reduction."""
        if self.enabled:
            self._hooks.append((layer, begin, self._mark()))

    def lap(self, phase: str, layers: Sequence[str] | str = (), weights: Sequence[float] | None = None) -> None:
        """Close the current interval: charge it to ``phase`` of ``layers`` (split by ``weights``, else
        evenly), or to the step-level slot ``phase`` when no layer is named."""
        if not self.enabled:
            return
        names = (layers,) if isinstance(layers, str) else tuple(layers)
        if not names and phase in PHASES:
            return  # no layer did this phase here (e.g. a rank that owns none): the interval runs on
        self._laps.append((phase, names, weights, self._mark()))

    def finish(self) -> StepTimes:
        """The step's times (one device synchronisation on CUDA); the stopwatch is ready for the next step."""
        times = StepTimes()
        if not self.enabled or self._origin is None:
            self._hooks = []
            return times
        if self._cuda:
            torch.cuda.synchronize()
        previous = self._origin
        for phase, names, weights, mark in self._laps:
            ms = self._elapsed_ms(previous, mark)
            previous = mark
            if not names:
                times.slots[phase] = times.slots.get(phase, 0.0) + ms
                continue
            shares = [float(w) for w in weights] if weights is not None else [1.0] * len(names)
            total = sum(shares)
            for name, share in zip(names, shares, strict=True):
                times.layers[name][phase] += ms * (share / total if total > 0 else 1.0 / len(names))
        times.total = self._elapsed_ms(self._origin, previous)
        for layer, begin, end in self._hooks:
            times.hooks[layer] += self._elapsed_ms(begin, end)
        self._origin, self._laps, self._hooks = None, [], []
        return times


#: The stopwatch of runs that do not profile.
DISABLED = Stopwatch(None)
