"""The training scripts' schedules: learning rate (warm-up, then step decay or cosine) and hylo's damping.

Both are functions of the 0-based optimizer step, so a resumed run that restores its step
counters continues on the same curve:

- **Learning rate** (a factor of the peak ``lr``, for ``torch.optim.lr_scheduler.LambdaLR``):
  a linear warm-up over ``warmup_steps`` (step ``s`` gets ``(s + 1) / warmup_steps``), then
  either HyLo's step decay (× ``decay`` at each milestone step) or a cosine from 1 to 0 at
  ``total_steps``.
- **Damping** (a callable of hylo's step, ``HyLoPreconditioner(damping=...)``): constant
  during the warm-up, then log-linear from ``damping`` to ``target`` over ``decay_steps``
  and ``target`` afterwards: λ(s) = λ₀ (λ₁/λ₀)^min(1, (s − warm-up)/decay_steps). This is the
  intent of HyLo's per-update damping decay (λ₀ to λ₁ over ``--damping-decay-epochs``),
  written as a closed form so that it does not depend on how often the curvature is updated.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

#: The learning-rate schedules after the warm-up.
LR_SCHEDULES = ("step", "cosine")


def lr_factor(
    schedule: str, *, total_steps: int, warmup_steps: int, milestones: Sequence[int] = (), decay: float = 0.1
) -> Callable[[int], float]:
    """The factor of the peak learning rate at a 0-based step (``milestones`` are steps, for ``"step"``)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr schedule must be one of {LR_SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")
    marks = sorted(milestones)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "step":
            return float(decay ** sum(1 for mark in marks if step >= mark))
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def damping_schedule(damping: float, target: float, *, warmup_steps: int, decay_steps: int) -> Callable[[int], float]:
    """λ at hylo's 0-based step: ``damping`` through the warm-up, then log-linear to ``target`` over ``decay_steps``."""
    if not (damping > 0 and target > 0):
        raise ValueError(f"damping and target damping must be > 0, got {damping} and {target}")
    if decay_steps < 1:
        raise ValueError(f"decay_steps must be >= 1, got {decay_steps}")
    ratio = target / damping

    def at(step: int) -> float:
        progress = min(1.0, max(0, step - warmup_steps) / decay_steps)
        return damping * ratio**progress

    return at
