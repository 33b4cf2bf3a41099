"""hylo against the optimizers users would otherwise pick: Muon, SOAP, Shampoo, SINGD, KAISA and a tuned baseline.

Each task trains the same model from the same initial weights on the same batches (the seed's,
:func:`hylo_scripts.training.loop.train`) with the same schedule (linear warm-up, cosine to 0 at the last
step) for every method; each method runs at every lr of its own small grid (``--lrs`` overrides
it) over ``--seeds``, and its best lr is the one with the best median final metric over the
seeds, read at the end of training.

- ``classification``: the CNN on ``mnist5k`` at batch 500, 120 iterations, evaluated every 8
  (``bench_accuracy.py``'s settings); the baseline is SGD with momentum 0.9, the metric test
  accuracy (higher is better).
- ``lm``: the transformer of ``bench_accuracy.py --task lm`` (2 blocks of width 128, 4 heads,
  context 64, batch 32, 400 steps, evaluated every 25); the baseline is AdamW (weight decay
  0.01), the metric the validation loss (nats per byte, lower is better). ``--batch-size 256``
  runs it at 8× the tokens per step (the users' regime), its training bytes scaled with the
  batch (``--max-bytes``, default 1,000,000 × batch / 32: the same passes over the data).

The baseline runs first: for each seed, its final metric at its best lr is the target, and each
method's steps to its first evaluation at or beyond the target are given with their ratio to the
baseline's own. Time is measured interleaved (:mod:`hylo_scripts.benchmarks.bench_interleave`): after the
runs, every method at its best lr is rebuilt in this one process (the first seed's model, batches,
optimizer and preconditioner) and stepped in turns, in blocks of whole update cycles (the least
common multiple of the methods' cycles, at most ``--cost-block`` steps), ``--cost-rounds`` rounds
after ``--cost-warmup`` blocks each; a method's ms/step is the mean over its blocks and its cost
ratio the per-round ratio to the baseline's block. Its time to the target is its steps to the
target × its ms/step, and the time ratio is that over the baseline's, so that a drift in the
machine's speed reaches every method alike. The runs' own (sequential) training seconds stay as a
cross-check column. When Muon ran, each method's steps and (interleaved) time to Muon's final
metric at its best lr, per seed, are given too, against Muon's own. Parameters a peer does not
train itself go to the baseline optimizer at the baseline's best lr (:mod:`hylo_scripts.benchmarks.peers`).
A method whose package is missing is skipped with a printed note and a CSV row saying why.
docs/benchmarks.md, "Peers", has the methods, the grids and a table.

    python scripts/bench_peers.py                                  # both tasks, every method, 3 seeds
    python scripts/bench_peers.py --task lm --seeds 0 --steps 100 --methods muon soap
    python scripts/bench_peers.py --task lm --batch-size 256                 # 8× the tokens per step
    python scripts/bench_peers.py --task lm --solvers kfac_adam --variant exact factor_sample=1.0   # two hylos
    python scripts/bench_peers.py --quick --out runs/peers.csv     # a smoke test in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hylo_scripts.benchmarks import bench_accuracy, bench_interleave, peers
from hylo_scripts.benchmarks.bench_accuracy import LMCurve, median_range
from hylo_scripts.benchmarks.bench_interleave import Cost, Stepper, time_to
from hylo_scripts.benchmarks.flags import add_variant_flag, default_device, hylo_option, parse_variants
from hylo_scripts.benchmarks.flags import device as device_type
from hylo_scripts.data.registry import DataOptions, DataSplits, load_dataset
from hylo_scripts.training.argtypes import positive_int
from hylo_scripts.training.hylo_options import ADAPTIVE, solver_choices
from hylo_scripts.training.loop import RunResult, train
from hylo_scripts.training.runconfig import RunConfig
from hylo_scripts.training.rundir import write_rows

#: ``--task`` values.
TASKS = ("classification", "lm", "both")
#: hylo's solvers run by default.
DEFAULT_SOLVERS = ("kfac", "hybrid")
#: ``--quick`` sizes per task (a smoke test: seconds), under any flag given explicitly; every grid is cut to its
#: middle lr, and the interleaved timing takes :data:`QUICK_COST_ROUNDS` rounds.
QUICK: dict[str, dict[str, Any]] = {
    "classification": {"batch_sizes": [100], "iterations": [8], "eval_every": 4},
    "lm": dict(bench_accuracy.QUICK),
}
#: ``--cost-rounds`` by default, and with ``--quick``.
COST_ROUNDS, QUICK_COST_ROUNDS = 5, 2
#: The LM bench's windows per step and training bytes at that batch (``--batch-size`` scales the bytes with it).
LM_BATCH, LM_BYTES = 32, 1_000_000
#: The methods whose final metric is the second target, the first of them that ran ("time to Muon's loss").
SECOND_TARGETS = ("muon", "muon-f32")
#: The columns of ``--out``: one row per run (a skipped method: one row with its reason).
COLUMNS = (
    "task",
    "method",
    "lr",
    "seed",
    "status",
    "reason",
    "metric",
    "final",
    "best_lr",
    "lr_at_edge",
    "target",
    "steps_to_target",
    "seconds_to_target",
    "baseline_steps",
    "baseline_seconds",
    "step_ratio",
    "time_ratio",
    "ms_per_step",
    "best",
    "goal",
    "steps_to_goal",
    "seconds_to_goal",
    "batch_size",
    "interleaved_ms_per_step",
    "cost_ratio",
    "cost_ratio_median",
    "cost_ratio_min",
    "cost_ratio_max",
    "block_steps",
    "cost_rounds",
    "interleaved_seconds_to_target",
    "interleaved_time_ratio",
    "second_method",
    "second_target",
    "steps_to_second",
    "second_step_ratio",
    "interleaved_seconds_to_second",
    "second_time_ratio",
)


@dataclass(frozen=True)
class Run:
    """One (method, lr, seed) run: its curve of (step, training seconds, loss-like value) and ms per step.

    The value is the validation loss on ``lm`` and the test error (1 − accuracy) on classification,
    so that lower is better and :meth:`LMCurve.first_below` finds the first evaluation at the target.
    """

    method: str
    curve: LMCurve
    ms_per_step: float

    @property
    def final(self) -> float:
        """The last evaluation's value (inf when not finite: a diverged run ranks last)."""
        value = self.curve.final_loss
        return value if math.isfinite(value) else math.inf


def ms_per_step(result: RunResult) -> float:
    """Median over evaluation intervals of the interval's training milliseconds per step."""
    previous = 0
    rates = []
    for entry in result.log:
        rates.append(1000.0 * entry.epoch_time_s / max(1, entry.step - previous))
        previous = entry.step
    return statistics.median(rates)


def to_run(method: str, lr: float, seed: int, result: RunResult, task: str) -> Run:
    """The :class:`Run` of a training result (classification: error = 1 − accuracy)."""
    if task == "lm":
        points = [(e.step, e.total_time_s, e.test_loss) for e in result.log]
    else:
        points = [(e.step, e.total_time_s, 1.0 - e.test_metric) for e in result.log]
    return Run(method, LMCurve(method, lr, seed, points), ms_per_step(result))


def best_lr(runs: Sequence[Run], method: str) -> float:
    """The lr of ``method`` with the lowest median final value (highest accuracy / lowest loss) over seeds."""
    mine = [r for r in runs if r.method == method]
    if not mine:
        raise ValueError(f"no runs of {method!r}")
    lrs = sorted({r.curve.lr for r in mine})
    return min(lrs, key=lambda lr: statistics.median(r.final for r in mine if r.curve.lr == lr))


def targets(runs: Sequence[Run], baseline: str, lr: float) -> dict[int, tuple[float, int, float]]:
    """Per seed: the baseline's final value at ``lr`` and its own (steps, seconds) to first reach it."""
    out = {}
    for run in runs:
        if run.method == baseline and run.curve.lr == lr:
            target = run.curve.final_loss
            own = run.curve.first_below(target)
            if own is not None:  # None only when the final value is NaN: no target for that seed
                out[run.curve.seed] = (target, own[0], own[1])
    return out


def reach(run: Run, goals: dict[int, tuple[float, int, float]]) -> dict[str, Any]:
    """``run``'s steps and seconds to its seed's target and their ratios to the baseline's (None: never)."""
    goal = goals.get(run.curve.seed)
    if goal is None:
        return dict.fromkeys(("target", "steps_to_target", "seconds_to_target", "baseline_steps"), None) | {
            "baseline_seconds": None,
            "step_ratio": None,
            "time_ratio": None,
        }
    target, steps, seconds = goal
    hit = run.curve.first_below(target)
    return {
        "target": target,
        "steps_to_target": None if hit is None else hit[0],
        "seconds_to_target": None if hit is None else round(hit[1], 4),
        "baseline_steps": steps,
        "baseline_seconds": round(seconds, 4),
        "step_ratio": None if hit is None else hit[0] / steps,
        "time_ratio": None if hit is None else hit[1] / max(seconds, 1e-12),
    }


def cost_columns(cost: Cost | None) -> dict[str, Any]:
    """A method's interleaved cost as CSV columns: ms/step, the mean ratio to the baseline's, the per-round ratios'
    median and range, the block and the rounds (all None: not measured)."""
    names = ("interleaved_ms_per_step", "cost_ratio", "cost_ratio_median", "cost_ratio_min", "cost_ratio_max")
    if cost is None:
        return dict.fromkeys((*names, "block_steps", "cost_rounds"))
    ratios = cost.round_ratios
    values = (round(cost.ms_per_step, 3), cost.ratio, statistics.median(ratios), min(ratios), max(ratios))
    return dict(zip(names, values, strict=True)) | {"block_steps": cost.block, "cost_rounds": cost.rounds}


def interleaved_reach(reached: Mapping[str, Any], cost: Cost | None, baseline: Cost | None) -> dict[str, Any]:
    """Time to the target from :func:`reach`'s steps: the run's steps × its interleaved cost, and its ratio to the
    baseline's steps × the baseline's cost (None: never reached, or a cost not measured)."""
    mine = time_to(reached["steps_to_target"], cost)
    theirs = time_to(reached["baseline_steps"], baseline)
    return {
        "interleaved_seconds_to_target": None if mine is None else round(mine, 4),
        "interleaved_time_ratio": None if mine is None or not theirs else mine / theirs,
    }


def second_reach(
    run: Run,
    second: str | None,
    goals: Mapping[int, tuple[float, int, float]],
    cost: Cost | None,
    second_cost: Cost | None,
) -> dict[str, Any]:
    """``run``'s steps to the ``second`` method's final value (:func:`targets` of it, per seed) and their ratio to
    the second method's own steps; the interleaved time to it and its ratio to the second method's own (None:
    never reached, no such run, or a cost not measured)."""
    goal = goals.get(run.curve.seed) if second is not None else None
    empty = ("second_target", "steps_to_second", "second_step_ratio", "interleaved_seconds_to_second")
    if goal is None:
        return {"second_method": second} | dict.fromkeys((*empty, "second_time_ratio"))
    target, own, _ = goal
    hit = run.curve.first_below(target)
    steps = None if hit is None else hit[0]
    mine, theirs = time_to(steps, cost), time_to(own, second_cost)
    return {
        "second_method": second,
        "second_target": target,
        "steps_to_second": steps,
        "second_step_ratio": None if steps is None else steps / own,
        "interleaved_seconds_to_second": None if mine is None else round(mine, 4),
        "second_time_ratio": None if mine is None or not theirs else mine / theirs,
    }


def goal_reach(run: Run, task: str, goal: float | None) -> dict[str, Any]:
    """The run's best metric over its evaluations and, on classification, its steps and seconds to ``goal`` % test
    accuracy (None: never, or no goal)."""
    best = metric_of(task, min(value for _, _, value in run.curve.points))
    if task == "lm" or goal is None:
        return {"best": best, "goal": None, "steps_to_goal": None, "seconds_to_goal": None}
    hit = run.curve.first_below(1.0 - goal / 100.0)
    return {
        "best": best,
        "goal": goal,
        "steps_to_goal": None if hit is None else hit[0],
        "seconds_to_goal": None if hit is None else round(hit[1], 4),
    }


def metric_of(task: str, value: float) -> float:
    """The reported metric of a curve value: accuracy in % (classification) or the validation loss (lm)."""
    return value if task == "lm" else 100.0 * (1.0 - value)


def _cell(values: Sequence[Any], fmt: str, count: str = "") -> str:
    """``median [range]`` of the values that are not None, with ``count`` (``-``: none)."""
    present = [v for v in values if v is not None]
    return median_range(present, fmt) + count if present else "-"


def summarise(task: str, rows: Sequence[dict[str, Any]], notes: Sequence[str], regime: str = "") -> str:
    """The table: per method at its best lr, the final metric, steps to the target and their ratio, the interleaved
    ms/step and cost ratio, the time to the target and its ratio from them, the runs' sequential time ratio and
    ms/step; the steps and time to the second method's final metric (when it ran) and the accuracy goal's columns."""
    metric = "final val loss" if task == "lm" else "final acc %"
    header = (
        f"{'method':<15} {'best lr':>8} {metric:>22} {'steps to target':>20} {'step ratio':>18} {'ms/step':>8} "
        f"{'cost ratio':>18} {'s to target':>18} {'time ratio':>18} {'seq. time ratio':>18} {'seq. ms/step':>12}"
    )
    second = next((r["second_method"] for r in rows if r.get("second_target") is not None), None)
    if second is not None:
        header += f" {f'steps to {second}':>18} {'step ratio':>18} {f'time vs {second}':>18}"
    goal = next((r["goal"] for r in rows if r.get("goal") is not None), None)
    if goal is not None:
        header += f" {'best acc %':>18} {f'steps to {goal:g}%':>18} {f's to {goal:g}%':>18}"
    title = f"task {task}{regime}: target = the baseline's final metric at its best lr, per seed"
    if second is not None:
        title += f"; and {second}'s"
    lines = [title, header, "-" * len(header)]
    for method in dict.fromkeys(r["method"] for r in rows if r["status"] != "skipped"):
        runs = [r for r in rows if r["method"] == method and r["best_lr"] and r["status"] != "failed"]
        if not runs:
            lines.append(f"{method:<15} no finished run at any lr (see the notes)")
            continue
        hits = [r for r in runs if r["steps_to_target"] is not None]
        count = "" if len(hits) == len(runs) else f" ({len(hits)}/{len(runs)})"
        finals = [r["final"] for r in runs if math.isfinite(r["final"])]
        diverged = "" if len(finals) == len(runs) else f" ({len(runs) - len(finals)} diverged)"
        fmt = ".4f" if task == "lm" else ".1f"
        edge = "*" if runs[0]["lr_at_edge"] else ""
        cost = runs[0]
        ms = "-" if cost["interleaved_ms_per_step"] is None else f"{cost['interleaved_ms_per_step']:.1f}"
        ratios = [cost[f"cost_ratio_{k}"] for k in ("median", "min", "max")]
        ratio = "-" if ratios[0] is None else f"{ratios[0]:.2f} [{ratios[1]:.2f}–{ratios[2]:.2f}]"
        line = (
            f"{method:<15} {format(runs[0]['lr'], 'g') + edge:>8} {median_range(finals, fmt) + diverged:>22} "
            f"{_cell([r['steps_to_target'] for r in hits], '.0f', count):>20} "
            f"{_cell([r['step_ratio'] for r in hits], '.2f', count):>18} {ms:>8} {ratio:>18} "
            f"{_cell([r['interleaved_seconds_to_target'] for r in hits], '.1f', count):>18} "
            f"{_cell([r['interleaved_time_ratio'] for r in hits], '.2f', count):>18} "
            f"{_cell([r['time_ratio'] for r in hits], '.2f', count):>18} "
            f"{statistics.median(r['ms_per_step'] for r in runs):>12.1f}"
        )
        if second is not None:
            reached = [r for r in runs if r["steps_to_second"] is not None]
            tally = "" if len(reached) == len(runs) else f" ({len(reached)}/{len(runs)})"
            line += (
                f" {_cell([r['steps_to_second'] for r in reached], '.0f', tally):>18}"
                f" {_cell([r['second_step_ratio'] for r in reached], '.2f', tally):>18}"
                f" {_cell([r['second_time_ratio'] for r in reached], '.2f', tally):>18}"
            )
        lines.append(line + (_goal_columns(runs) if goal is not None else ""))
    lines.append("median [range] over seeds at each method's best lr; (k/n): only k of n seeds reached the target;")
    lines.append(
        "ms/step: interleaved, mean over blocks of whole update cycles; cost ratio: per-round ratio to the baseline's "
        "block, median [range]; s to target, time ratio: steps × ms/step; seq.: the runs' own training seconds"
    )
    lines.append("* the best lr is at an end of the method's grid (widen it with --lrs)")
    lines += notes
    return "\n".join(lines)


def _goal_columns(runs: Sequence[dict[str, Any]]) -> str:
    """Best accuracy, and steps and seconds to the accuracy goal, median [range] over the runs (k/n: reached)."""
    hits = [r for r in runs if r["steps_to_goal"] is not None]
    count = "" if len(hits) == len(runs) else f" ({len(hits)}/{len(runs)})"
    return (
        f" {median_range([r['best'] for r in runs], '.1f'):>18}"
        f" {median_range([r['steps_to_goal'] for r in hits], '.0f') + count:>18}"
        f" {median_range([r['seconds_to_goal'] for r in hits], '.1f') + count:>18}"
    )


def task_args(args: argparse.Namespace, task: str) -> argparse.Namespace:
    """``bench_accuracy``'s options for ``task``: its defaults, ``--quick``'s sizes, then this run's flags."""
    values = dict(bench_accuracy.DEFAULTS[task]) | {"freq": None, "rank_ratio": [0.1]}
    if task == "classification":
        values |= {"batch_sizes": [500], "iterations": [120]}
    if args.quick:
        values |= QUICK[task]
    if task == "classification" and args.iterations is not None:
        values["iterations"] = [args.iterations]
    if task == "lm" and args.steps is not None:
        values["steps"] = args.steps
    if task == "lm" and args.batch_size is not None:  # the same passes over the data as at the default batch
        values["max_bytes"] = values["max_bytes"] * args.batch_size // values["batch_size"]
        values["batch_size"] = args.batch_size
    if task == "lm" and args.max_bytes is not None:
        values["max_bytes"] = args.max_bytes
    return argparse.Namespace(**values)


def regime(task: str, options: argparse.Namespace) -> str:
    """The task's size per step, for the table's title: ``" (batch 32 × 64 tokens)"``."""
    if task == "lm":
        return f" (batch {options.batch_size} × {options.seq_len} tokens, {options.max_bytes:,} training bytes)"
    return f" (batch {options.batch_sizes[0]})"


def cycle_of(method: peers.Method, cfg: RunConfig) -> int:
    """The steps of ``method``'s update cycle in the run ``cfg``: hylo's ``update_freq``, else the method's own."""
    return int(cfg.hylo["update_freq"]) if cfg.solver is not None else method.cycle


def measure_costs(
    args: argparse.Namespace,
    task: str,
    data: DataSplits,
    chosen: Mapping[str, tuple[peers.Method, RunConfig, float]],
    notes: list[str],
) -> dict[str, Cost]:
    """Every ``chosen`` method's (name -> method, its best lr's config, rest_lr) per-step cost, interleaved
    (:func:`hylo_scripts.benchmarks.bench_interleave.measure`) against the baseline's; {} without ``--cost-rounds`` or when the
    baseline cannot be built. A method that fails to build or step is left out with a note."""
    baseline = peers.BASELINES[task]
    if not args.cost_rounds or baseline not in chosen:
        return {}
    cycles = {name: cycle_of(method, cfg) for name, (method, cfg, _) in chosen.items()}
    sizes = {"rounds": args.cost_rounds, "warmup": args.cost_warmup, "cap": args.cost_block}
    need = bench_interleave.steps_needed(cycles, **sizes)
    steppers: dict[str, Stepper] = {}
    try:
        for name, (method, cfg, rest_lr) in chosen.items():
            try:
                steppers[name] = Stepper(
                    cfg,
                    data,
                    args.device,
                    optimizer_factory=None if method.optimizer is None else method.optimizer(cfg.lr, rest_lr),
                    preconditioner_factory=method.preconditioner,
                    steps=need,
                )
            except Exception as err:  # reported, the others are measured
                notes.append(f"{name}: no interleaved cost, {type(err).__name__}: {err}")
        if baseline not in steppers:
            return {}
        blocks = bench_interleave.block_lengths({n: cycles[n] for n in steppers}, args.cost_block)
        print(
            f"{task}: timing {', '.join(f'{n} ({blocks[n]} steps)' for n in steppers)} in turns, "
            f"{args.cost_warmup} warm-up block(s) and {args.cost_rounds} rounds",
            flush=True,
        )
        began = time.perf_counter()
        try:
            found = bench_interleave.measure(steppers, {n: cycles[n] for n in steppers}, baseline, **sizes)
        except Exception as err:
            notes.append(f"interleaved timing failed, {type(err).__name__}: {err}")
            return {}
        print(f"{task}: interleaved timing took {time.perf_counter() - began:.1f} s", flush=True)
        return found
    finally:
        for stepper in steppers.values():
            stepper.close()


def run_config(
    options: argparse.Namespace,
    task: str,
    method: peers.Method,
    lr: float,
    seed: int,
    hylo: Mapping[str, Any],
    rest_lr: float = math.nan,
) -> RunConfig:
    """One run's config: ``bench_accuracy``'s of the task, with hylo's solver, the ``--set`` options ``hylo`` and a
    variant's own for a hylo method; an adaptive solver's other parameters train at the baseline's tuned ``rest_lr``."""
    if task == "lm":
        cfg = bench_accuracy.lm_config(options, method.solver, lr, seed)
    else:
        cfg = bench_accuracy.run_config(options, options.batch_sizes[0], method.solver, lr, seed)
    if method.solver in ADAPTIVE and math.isfinite(rest_lr):
        cfg = dataclasses.replace(cfg, rest_lr=rest_lr)
    if method.solver is None or not (hylo or method.options):
        return cfg
    return dataclasses.replace(cfg, hylo={**cfg.hylo, **hylo, **dict(method.options)})


def load(task: str, options: argparse.Namespace) -> DataSplits:
    """The task's data (mnist5k, or the stdlib corpus with its spread validation windows)."""
    if task == "lm":
        return bench_accuracy.lm_data(options)
    return load_dataset("mnist5k", DataOptions(seed=0))


def run_task(args: argparse.Namespace, task: str, curves: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every method × lr × seed of ``task``; print each run and the table; return the CSV rows (and, with
    ``--curves``, append every evaluation to ``curves``)."""
    options = task_args(args, task)
    data = load(task, options)
    baseline = peers.BASELINES[task]
    methods = [peers.METHODS[baseline]]
    methods += [peers.METHODS[m] for m in args.methods if m != baseline and task in peers.METHODS[m].grids]
    methods += [peers.hylo_method(s) for s in args.solvers]
    methods += [peers.hylo_method(s, name, options) for s in args.solvers for name, options in args.variants.items()]
    if args.set and args.solvers:
        print(f"{task}: hylo runs with {dict(args.set)} over the task's options", flush=True)
    runs: list[Run] = []
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    rest_lr = math.nan
    for method in methods:
        reason = peers.missing(method)
        if reason is not None:
            note = f"{method.name}: skipped, {reason}"
            print(note, flush=True)
            notes.append(note)
            rows.append(dict.fromkeys(COLUMNS) | {"task": task, "method": method.name, "status": "skipped"})
            rows[-1]["reason"] = reason
            continue
        grid = args.lrs.get(method.name, method.grids[task])
        if args.quick and method.name not in args.lrs:
            grid = (grid[len(grid) // 2],)
        for lr in grid:
            for seed in args.seeds:
                cfg = run_config(options, task, method, lr, seed, dict(args.set), rest_lr)
                factory = None if method.optimizer is None else method.optimizer(lr, rest_lr)
                began = time.perf_counter()
                try:
                    result = train(
                        cfg,
                        data,
                        device=args.device,
                        optimizer_factory=factory,
                        preconditioner_factory=method.preconditioner,
                    )
                except Exception as err:  # a peer's failure is reported in its row, the benchmark goes on
                    message = f"{type(err).__name__}: {err}"
                    print(f"{task} {method.name:<13} lr {lr:<8g} seed {seed}: FAILED {message}", flush=True)
                    rows.append(
                        dict.fromkeys(COLUMNS)
                        | {"task": task, "method": method.name, "lr": lr, "seed": seed, "status": "failed"}
                        | {"reason": message}
                    )
                    continue
                run = to_run(method.name, lr, seed, result, task)
                runs.append(run)
                print(
                    f"{task} {method.name:<13} lr {lr:<8g} seed {seed}: final "
                    f"{metric_of(task, run.curve.final_loss):.4g} ({run.ms_per_step:.1f} ms/step, "
                    f"{time.perf_counter() - began:.1f} s)",
                    flush=True,
                )
        if method.name == baseline:
            rest_lr = best_lr(runs, baseline)
    goals = targets(runs, baseline, rest_lr)
    best = {m: best_lr(runs, m) for m in dict.fromkeys(r.method for r in runs)}
    chosen = {
        m.name: (m, run_config(options, task, m, best[m.name], args.seeds[0], dict(args.set), rest_lr), rest_lr)
        for m in methods
        if m.name in best
    }
    costs = measure_costs(args, task, data, chosen, notes)
    second = next((name for name in SECOND_TARGETS if name in best), None)
    second_goals = {} if second is None else targets(runs, second, best[second])
    for run in runs:
        grid = sorted({r.curve.lr for r in runs if r.method == run.method})
        at_best = run.curve.lr == best[run.method]
        cost = costs.get(run.method) if at_best else None
        reached = reach(run, goals)
        rows.append(
            dict.fromkeys(COLUMNS)
            | {"task": task, "method": run.method, "lr": run.curve.lr, "seed": run.curve.seed, "status": "ok"}
            | {"metric": "val_loss" if task == "lm" else "test_acc_pct"}
            | {"final": metric_of(task, run.curve.final_loss), "best_lr": at_best}
            | reached
            | {"ms_per_step": round(run.ms_per_step, 3)}
            | goal_reach(run, task, args.accuracy)
            | {"lr_at_edge": len(grid) > 1 and best[run.method] in (grid[0], grid[-1])}
            | {"batch_size": options.batch_size if task == "lm" else options.batch_sizes[0]}
            | cost_columns(cost)
            | interleaved_reach(reached, cost, costs.get(baseline))
            | second_reach(run, second, second_goals, cost, None if second is None else costs.get(second))
        )
    order = [m.name for m in methods]
    rows.sort(key=lambda row: order.index(row["method"]))  # stable: by method, each in its runs' order
    notes += [
        f"{r['method']} lr {r['lr']:g} seed {r['seed']}: failed, {r['reason']}" for r in rows if r["status"] == "failed"
    ]
    if args.curves is not None:
        curves.extend(
            {"task": task, "method": run.method, "lr": run.curve.lr, "seed": run.curve.seed, "step": step}
            | {"train_s": round(seconds, 4), "metric": metric_of(task, value)}
            for run in runs
            for step, seconds, value in run.curve.points
        )
    print()
    print(summarise(task, rows, notes, regime(task, options)))
    print()
    return rows


def parse_lrs(values: Sequence[str], known: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """``--lrs METHOD=a,b,c ...`` as {method: grid}; an unknown method or a bad number is a ValueError."""
    grids: dict[str, tuple[float, ...]] = {}
    for text in values:
        name, sep, numbers = text.partition("=")
        if not sep or not numbers:
            raise ValueError(f"--lrs {text!r}: expected METHOD=lr,lr,...")
        if name not in known:
            raise ValueError(f"--lrs {text!r}: unknown method {name!r} (one of {', '.join(known)})")
        try:
            grid = tuple(float(x) for x in numbers.split(","))
        except ValueError as err:
            raise ValueError(f"--lrs {text!r}: {err}") from err
        if not all(math.isfinite(x) and x > 0 for x in grid):
            raise ValueError(f"--lrs {text!r}: every lr must be a finite number > 0")
        grids[name] = grid
    return grids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: the settings of docs/benchmarks.md, "Peers")."""
    peer_names = [m for m in peers.METHODS if m not in peers.BASELINES.values()]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=TASKS, default="both", help="classification, lm or both (default)")
    parser.add_argument("--methods", nargs="*", choices=peer_names, default=peer_names, help="peers (default all)")
    parser.add_argument("--solvers", nargs="*", choices=solver_choices(), default=list(DEFAULT_SOLVERS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lrs", nargs="+", default=[], metavar="METHOD=A,B,C", help="a method's lr grid")
    parser.add_argument(
        "--set",
        nargs="+",
        type=hylo_option,
        default=[],
        metavar="KEY=VALUE",
        help="hylo options of every hylo run, over the task's (damping 0.3, kl_clip 0.01, update_freq 10, ρ 0.1)",
    )
    add_variant_flag(
        parser, "another hylo method per solver, hylo-<solver>-NAME, with these options over --set's (repeatable)"
    )
    parser.add_argument("--steps", type=positive_int, help="lm: steps per run (default 400)")
    parser.add_argument("--iterations", type=positive_int, help="classification: steps per run (default 120)")
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"lm: windows per step (default {LM_BATCH}; 256: 8× the tokens), the training bytes scaled with it",
    )
    parser.add_argument(
        "--max-bytes", type=positive_int, help=f"lm: training bytes (default {LM_BYTES:,} × batch size / {LM_BATCH})"
    )
    parser.add_argument(
        "--cost-rounds",
        type=int,
        default=None,
        help=f"rounds of the interleaved timing (default {COST_ROUNDS}, --quick {QUICK_COST_ROUNDS}; 0: none)",
    )
    parser.add_argument(
        "--cost-warmup", type=int, default=1, help="untimed blocks of each method before the rounds (default 1)"
    )
    parser.add_argument(
        "--cost-block",
        type=positive_int,
        default=bench_interleave.BLOCK_CAP,
        help="the longest block of the interleaved timing, in steps: the methods' cycles' least common multiple "
        f"when it fits, else each method's whole cycles within it (default {bench_interleave.BLOCK_CAP})",
    )
    parser.add_argument(
        "--accuracy",
        type=float,
        default=96.0,
        help="classification: the test accuracy (%%) whose steps and seconds the table reports (default 96)",
    )
    parser.add_argument("--device", type=device_type, default=default_device(), help="cpu or cuda (default)")
    parser.add_argument("--threads", type=positive_int, default=2)
    parser.add_argument("--out", type=Path, default=Path("peers.csv"), help="CSV of every run (default peers.csv)")
    parser.add_argument("--curves", type=Path, default=None, help="CSV of every run's curve (long format)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    args = parser.parse_args(argv)
    try:
        args.variants = parse_variants(args.variant)
    except ValueError as err:
        parser.error(str(err))
    known = list(peers.METHODS) + [f"hylo-{s}" for s in solver_choices()]
    known += [f"hylo-{s}-{name}" for s in solver_choices() for name in args.variants]
    try:
        args.lrs = parse_lrs(args.lrs, known)
    except ValueError as err:
        parser.error(str(err))
    tasks = ("classification", "lm") if args.task == "both" else (args.task,)
    if args.steps is not None and "lm" not in tasks:
        parser.error("--steps: not a flag of --task classification")
    if args.iterations is not None and "classification" not in tasks:
        parser.error("--iterations: not a flag of --task lm")
    for flag in ("batch_size", "max_bytes"):
        if getattr(args, flag) is not None and "lm" not in tasks:
            parser.error(f"--{flag.replace('_', '-')}: not a flag of --task classification")
    if args.cost_rounds is None:
        args.cost_rounds = QUICK_COST_ROUNDS if args.quick else COST_ROUNDS
    if args.cost_rounds < 0 or args.cost_warmup < 0:
        parser.error("--cost-rounds and --cost-warmup must be >= 0")
    for task in tasks:
        options = task_args(args, task)
        steps = options.steps if task == "lm" else options.iterations[0]
        if steps < options.eval_every:
            parser.error(f"{task}: {steps} steps is fewer than one evaluation interval ({options.eval_every})")
    for flag, options in [("--set", dict(args.set))] + [(f"--variant {n}", o) for n, o in args.variants.items()]:
        try:  # checked before any run, by hylo's own validation of the run's options
            RunConfig(solver=args.solvers[0] if args.solvers else "kfac", hylo={**dict(args.set), **options})
        except ValueError as err:
            parser.error(f"{flag}: {err}")
    args.tasks = tasks
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark of each task, print the tables, write the CSV(s) (exit status 0)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    curves: list[dict[str, Any]] = []
    for task in args.tasks:
        rows += run_task(args, task, curves)
    write_rows(args.out, [{c: r.get(c) for c in COLUMNS} for r in rows])
    if args.curves is not None:
        write_rows(args.curves, curves)
        print(f"wrote {args.curves}")
    print(f"wrote {args.out}; total {time.perf_counter() - began:.0f} s on {args.device}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
