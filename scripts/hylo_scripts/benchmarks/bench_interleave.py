"""Per-step costs measured interleaved in one process: every method's training steps in turns, in blocks of whole
update cycles (docs/benchmarks.md, "Peers").

A machine whose speed drifts (on this project's shared CPU, by up to 2× within minutes) makes runs timed one after
another a comparison of different machines. Here each method's run is rebuilt as a :class:`Stepper` — the run's
model from its seed, its batches in its order, its optimizer, preconditioner and schedules, built as
:func:`hylo_scripts.training.loop.train` builds them — and :func:`interleave` steps them in turns: after ``warmup`` blocks
each, ``rounds`` rounds in which every method takes one block of :func:`block_lengths` steps, a whole number of its
update cycles, timed with the device synchronised (the order rotates from round to round). A method's per-step
cost is the mean over its blocks, so its curvature-update steps are amortised over whole cycles, and its ratio to
the baseline's is read per round, where a drift reaches every method alike (:func:`costs`). A method's time to a
target is then its deterministic steps to the target times that cost (:func:`time_to`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from hylo_scripts.benchmarks import timing
from hylo_scripts.data.registry import DataSplits
from hylo_scripts.models.registry import build_model
from hylo_scripts.training.loop import (
    OptimizerFactory,
    PreconditionerFactory,
    adapts,
    make_optimizer,
    make_preconditioner,
    make_scheduler,
)
from hylo_scripts.training.runconfig import RunConfig
from hylo_scripts.training.tasks import TASKS

#: The longest block (steps) when the cycles' least common multiple is longer: each method then takes the largest
#: whole number of its own cycles within it (at least one).
BLOCK_CAP = 60
#: The shortest block (steps) when the cycles allow it: short blocks time the switch between the methods.
BLOCK_FLOOR = 10


def block_lengths(cycles: Mapping[str, int], cap: int = BLOCK_CAP, floor: int = BLOCK_FLOOR) -> dict[str, int]:
    """Steps per block of each method: the least common multiple of every method's cycle, times the smallest whole
    number that makes it at least ``floor`` within ``cap``, when it is at most ``cap`` (one length for all); else the
    largest multiple of the method's own cycle up to ``cap`` (at least one cycle).

    A cycle or a cap below 1 is a ``ValueError``.
    """
    if cap < 1 or any(c < 1 for c in cycles.values()):
        raise ValueError(f"cycles and the block cap must be >= 1, got {dict(cycles)} and {cap}")
    common = math.lcm(*cycles.values()) if cycles else 1
    if common <= cap:
        return dict.fromkeys(cycles, common * max(1, min(cap // common, -(-floor // common))))
    return {name: max(1, cap // cycle) * cycle for name, cycle in cycles.items()}


def interleave(
    steppers: Mapping[str, Callable[[int], object]],
    blocks: Mapping[str, int],
    *,
    rounds: int,
    warmup: int = 1,
    clock: Callable[[], float],
) -> dict[str, list[float]]:
    """Per method, the seconds per step of each timed round's block (``rounds`` entries).

    ``steppers[name](n)`` takes ``n`` training steps of the method; ``clock()`` reads the time after the device's
    queued work (:func:`hylo_scripts.benchmarks.timing.now`). First ``warmup`` untimed blocks of each method (its first
    updates, allocations and caches), then ``rounds`` rounds in which every method takes one block of
    ``blocks[name]`` steps, timed alone; round r starts with the (r mod M)-th of the M methods, so that none is
    always first or always after the same one.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got {rounds} and {warmup}")
    names = list(steppers)
    for _ in range(warmup):
        for name in names:
            steppers[name](blocks[name])
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(rounds):
        for name in names[turn % len(names) :] + names[: turn % len(names)]:
            began = clock()
            steppers[name](blocks[name])
            seconds[name].append((clock() - began) / blocks[name])
    return seconds


@dataclass(frozen=True)
class Cost:
    """A method's interleaved per-step cost: ``ms_per_step`` (mean over its blocks), ``ratio`` (to the baseline's
    mean), ``round_ratios`` (its block's per-step time over the baseline's, per round), ``block`` (steps per
    block) and ``rounds``."""

    ms_per_step: float
    ratio: float
    round_ratios: tuple[float, ...]
    block: int
    rounds: int


def costs(seconds: Mapping[str, list[float]], blocks: Mapping[str, int], baseline: str) -> dict[str, Cost]:
    """The :class:`Cost` of every method of :func:`interleave`'s ``seconds`` against ``baseline``'s."""
    reference = statistics.fmean(seconds[baseline])
    return {
        name: Cost(
            ms_per_step=1000.0 * statistics.fmean(mine),
            ratio=statistics.fmean(mine) / reference,
            round_ratios=tuple(a / b for a, b in zip(mine, seconds[baseline], strict=True)),
            block=blocks[name],
            rounds=len(mine),
        )
        for name, mine in seconds.items()
    }


def time_to(steps: int | None, cost: Cost | None) -> float | None:
    """Seconds to a target reached in ``steps`` at ``cost`` (None: never reached, or no cost measured)."""
    if steps is None or cost is None:
        return None
    return steps * cost.ms_per_step / 1000.0


class Stepper:
    """One run's training steps, resumable block by block: the model, batches, optimizer, preconditioner and
    schedules of :func:`hylo_scripts.training.loop.train` for ``cfg`` on one process (the same initial weights and batches in
    the same order), without its evaluations, files and timing.

    ``stepper(n)`` takes the next ``n`` steps. ``steps`` is how many the measurement will take: beyond the run's own
    length the run's epochs are extended (the schedules stretch; the cost of a step does not depend on them).
    ``close()`` removes hylo's hooks.
    """

    def __init__(
        self,
        cfg: RunConfig,
        data: DataSplits,
        device: torch.device,
        *,
        optimizer_factory: OptimizerFactory | None = None,
        preconditioner_factory: PreconditionerFactory | None = None,
        steps: int = 0,
    ) -> None:
        self.data, self.device = data, device
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            data.train, num_replicas=1, rank=0, shuffle=True, seed=cfg.seed + 1, drop_last=True
        )
        self.loader = DataLoader(
            data.train,
            batch_size=cfg.batch_size,
            sampler=self.sampler,
            drop_last=True,
            num_workers=cfg.workers,
            pin_memory=device.type == "cuda",
        )
        self.steps_per_epoch = min(len(self.loader), cfg.max_steps or len(self.loader))
        if steps > self.steps_per_epoch * cfg.epochs:
            cfg = dataclasses.replace(cfg, epochs=math.ceil(steps / self.steps_per_epoch))
        self.cfg = cfg
        self.task = TASKS[cfg.task]
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options()).to(device)
        built: list[torch.optim.Optimizer] = []

        def scheduled_lr(_step: int) -> float:
            return float(built[0].param_groups[0]["lr"])

        self.pre = make_preconditioner(self.model, cfg, scheduled_lr, self.steps_per_epoch, record=False)
        if optimizer_factory is not None:
            self.optimizer = optimizer_factory(self.model, cfg)
        else:
            adapted = self.pre.parameters() if self.pre is not None and adapts(cfg) else ()
            self.optimizer = make_optimizer(self.model, cfg, adapted)
        built.append(self.optimizer)
        self.scheduler = make_scheduler(self.optimizer, cfg, self.steps_per_epoch)
        self.other = preconditioner_factory(self.model, self.optimizer) if preconditioner_factory else None
        self.epoch = 0
        self.batches = self._batches()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The run's batches, epoch after epoch (each epoch's order from the sampler's seed and the epoch)."""
        for epoch in itertools.count():
            self.epoch = epoch
            self.sampler.set_epoch(epoch)
            self.data.train.set_epoch(epoch)
            batches = iter(self.loader)
            for _ in range(self.steps_per_epoch):
                yield next(batches)

    def __call__(self, steps: int) -> None:
        """Take the run's next ``steps`` training steps."""
        for _ in range(steps):
            self.data.train.set_epoch(self.epoch)  # another stepper may have moved the shared dataset's epoch
            x, y = next(self.batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.task.loss(self.cfg, self.model(x), y)
            loss.backward()
            if self.pre is not None:
                self.pre.step()
            elif self.other is not None:
                self.other.step()
            self.optimizer.step()
            self.scheduler.step()

    def close(self) -> None:
        """Remove hylo's hooks (nothing else holds on to the model)."""
        if self.pre is not None:
            self.pre.remove()


def measure(
    steppers: Mapping[str, Stepper],
    cycles: Mapping[str, int],
    baseline: str,
    *,
    rounds: int,
    warmup: int = 1,
    cap: int = BLOCK_CAP,
) -> dict[str, Cost]:
    """:func:`interleave` the ``steppers`` in blocks of :func:`block_lengths` of their ``cycles``, timed with the
    device synchronised, and the :func:`costs` against ``baseline``."""
    blocks = block_lengths(cycles, cap)
    device = next(iter(steppers.values())).device
    seconds = interleave(steppers, blocks, rounds=rounds, warmup=warmup, clock=lambda: timing.now(device))
    return costs(seconds, blocks, baseline)


def steps_needed(cycles: Mapping[str, int], rounds: int, warmup: int = 1, cap: int = BLOCK_CAP) -> int:
    """The most steps any method takes in :func:`measure` (its warm-up and timed blocks)."""
    blocks = block_lengths(cycles, cap)
    return (rounds + warmup) * max(blocks.values(), default=0)
