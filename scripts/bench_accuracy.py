"""Time-to-accuracy on the offline MNIST subset: iterations and seconds to 96% / 97% test accuracy.

Every run trains the small CNN on ``mnist5k`` (4,000 training / 1,000 test images) with momentum
SGD, a linear warm-up and a cosine decay over the run, with and without hylo, and evaluates the
test set after every evaluation interval of ``--eval-every`` steps (an interval draws its
batches from a fresh permutation of the training set, as an epoch does; at batch 500 an
epoch is 8 steps). Seconds are training time only (evaluation excluded), as the engine's
``total_time_s``.

For each batch size: plain SGD at each learning rate of ``--sgd-lrs`` (the best is the one with
the highest median final accuracy), then each hylo solver at ``--lr``; each over ``--seeds``
(the seed of the initial weights and the batch order; the split is fixed). The table gives,
per run, the median and range over seeds of the iterations and seconds to each threshold
(``-`` when a seed never reached it; the median is then taken over the seeds that did,
with the count in brackets) and of the final accuracy.

    python scripts/bench_accuracy.py                              # batch 500 (120 iterations) and 64
    python scripts/bench_accuracy.py --batch-sizes 500 --solvers hybrid kfac --seeds 0
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from scripts.data import DataOptions, DataSplits, load_dataset
from scripts.engine import HYLO_SOLVERS, RunConfig, RunResult, train, write_rows


@dataclass(frozen=True)
class Outcome:
    """One run's curve reduced to what the table shows."""

    batch_size: int
    name: str
    lr: float
    seed: int
    final_acc: float
    reached: dict[float, tuple[int, float] | None]  # threshold -> (iterations, seconds) or never


def first_reach(result: RunResult, threshold: float) -> tuple[int, float] | None:
    """(iterations, training seconds) at the first evaluation with test accuracy >= ``threshold``."""
    for entry in result.log:
        if entry.test_metric >= threshold:
            return entry.step, entry.total_time_s
    return None


def run_config(args: argparse.Namespace, batch_size: int, solver: str | None, lr: float, seed: int) -> RunConfig:
    """One run of the benchmark: ``iterations[batch]`` steps in intervals of ``--eval-every``."""
    iterations = args.iterations[args.batch_sizes.index(batch_size)]
    intervals = max(1, iterations // args.eval_every)
    return RunConfig(
        dataset="mnist5k",
        model="cnn",
        solver=solver,
        epochs=intervals,
        max_steps=args.eval_every,
        batch_size=batch_size,
        lr=lr,
        lr_schedule="cosine",
        warmup_epochs=args.warmup_intervals,
        momentum=0.9,
        weight_decay=args.weight_decay,
        damping=args.damping,
        update_freq=args.freq,
        kl_clip=args.kl_clip,
        rank_ratio=args.rank_ratio,
        seed=seed,
    )


def median_range(values: Sequence[float], fmt: str) -> str:
    """``median [min–max]`` of ``values`` with ``fmt``."""
    if not values:
        return "-"
    text = format(statistics.median(values), fmt)
    return text if len(values) == 1 else f"{text} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def summarise(outcomes: list[Outcome], thresholds: Sequence[float]) -> str:
    """The table: per batch size and run, iterations and seconds to each threshold and the final accuracy."""
    lines = []
    header = f"{'batch':>5} {'run':<12} {'lr':>6}"
    for t in thresholds:
        header += f" {'iters to ' + format(100 * t, 'g') + '%':>20} {'s to ' + format(100 * t, 'g') + '%':>20}"
    header += f" {'final acc %':>20}"
    lines += [header, "-" * len(header)]
    for key in dict.fromkeys((o.batch_size, o.name, o.lr) for o in outcomes):
        runs = [o for o in outcomes if (o.batch_size, o.name, o.lr) == key]
        row = f"{key[0]:>5} {key[1]:<12} {key[2]:>6g}"
        for t in thresholds:
            hits = [o.reached[t] for o in runs if o.reached[t] is not None]
            count = "" if len(hits) == len(runs) else f" ({len(hits)}/{len(runs)})"
            row += f" {median_range([h[0] for h in hits], '.0f') + count:>20}"  # type: ignore[index]
            row += f" {median_range([h[1] for h in hits], '.1f') + count:>20}"  # type: ignore[index]
        row += f" {median_range([100 * o.final_acc for o in runs], '.1f'):>20}"
        lines.append(row)
    return "\n".join(lines)


def best_sgd_lr(outcomes: list[Outcome], batch_size: int) -> float:
    """The SGD learning rate with the highest median final accuracy at ``batch_size``."""
    sgd = [o for o in outcomes if o.batch_size == batch_size and o.name == "sgd"]
    lrs = sorted({o.lr for o in sgd})
    return max(lrs, key=lambda lr: statistics.median(o.final_acc for o in sgd if o.lr == lr))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (defaults: the settings quoted in the README)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[500, 64])
    parser.add_argument(
        "--iterations", type=int, nargs="+", default=[120, 480], help="steps per run, one per batch size"
    )
    parser.add_argument("--eval-every", type=int, default=8, help="steps between test evaluations")
    parser.add_argument("--solvers", nargs="+", default=list(HYLO_SOLVERS), choices=HYLO_SOLVERS)
    parser.add_argument("--sgd-lrs", type=float, nargs="*", default=[0.03, 0.05, 0.07, 0.1])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.96, 0.97])
    parser.add_argument("--lr", type=float, default=0.1, help="peak lr of the hylo runs")
    parser.add_argument("--damping", type=float, default=0.3)
    parser.add_argument("--freq", type=int, default=10, help="hylo update_freq")
    parser.add_argument("--kl-clip", type=float, default=1e-2)
    parser.add_argument("--rank-ratio", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=5e-4)
    parser.add_argument("--warmup-intervals", type=float, default=0.5, help="lr warm-up, in evaluation intervals")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="CSV of every run's curve (long format)")
    args = parser.parse_args(argv)
    if len(args.iterations) != len(args.batch_sizes):
        parser.error("--iterations needs one value per --batch-sizes entry")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every (batch size, run, seed), print the table, optionally write the curves."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data: DataSplits = load_dataset("mnist5k", DataOptions(seed=0))
    outcomes: list[Outcome] = []
    curves: list[dict[str, object]] = []
    began = time.perf_counter()
    for batch_size in args.batch_sizes:
        runs: list[tuple[str | None, float]] = [(None, lr) for lr in args.sgd_lrs]
        runs += [(solver, args.lr) for solver in args.solvers]
        for solver, lr in runs:
            for seed in args.seeds:
                result = train(run_config(args, batch_size, solver, lr, seed), data)
                reached = {t: first_reach(result, t) for t in args.thresholds}
                outcomes.append(Outcome(batch_size, result.name, lr, seed, result.test_accuracy, reached))
                curves += [
                    {"batch_size": batch_size, "run": result.name, "lr": lr, "seed": seed, "step": e.step}
                    | {"test_acc": e.test_metric, "train_s": round(e.total_time_s, 4)}
                    for e in result.log
                ]
                print(
                    f"batch {batch_size:>4} {result.name:<12} lr {lr:<6g} seed {seed}: "
                    f"final {100 * result.test_accuracy:.1f}% in {result.log[-1].total_time_s:.1f} s",
                    flush=True,
                )
    if args.sgd_lrs:
        best = {b: best_sgd_lr(outcomes, b) for b in args.batch_sizes}
        outcomes = [o for o in outcomes if o.name != "sgd" or o.lr == best[o.batch_size]]
    print()
    print(summarise(outcomes, args.thresholds))
    if args.sgd_lrs:
        print("sgd: the lr of the grid", args.sgd_lrs, "with the best median final accuracy at each batch size")
    print(f"total {time.perf_counter() - began:.0f} s")
    if args.out is not None:
        write_rows(args.out, curves)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
