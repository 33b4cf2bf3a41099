"""Time to accuracy: iterations and seconds to 96% / 97% test accuracy on MNIST, or to AdamW's loss on a language model.

``--task classification`` (the default):

Every run trains the small CNN on ``mnist5k`` (4,000 training / 1,000 test images) with momentum
SGD, a linear warm-up and a cosine decay over the run, with and without hylo, and evaluates the
test set after every evaluation interval of ``--eval-every`` steps (an interval draws its
batches from a fresh permutation of the training set, as an epoch does; at batch 500 an
epoch is 8 steps). Seconds are training time only (evaluation excluded), as the engine's
``total_time_s``.

For each batch size: plain SGD at each learning rate of ``--sgd-lrs`` (the best is the one with
the highest median final accuracy), then each hylo solver at ``--lr`` (default 0.1; 0.01 for an adaptive solver,
``kfac_adam``, whose step is Adam-scaled); each over ``--seeds``
(the seed of the initial weights and the batch order; the split is fixed). The table gives,
per run, the median and range over seeds of the iterations and seconds to each threshold
(``-`` when a seed never reached it; the median is then taken over the seeds that did,
with the count in brackets) and of the final accuracy.

    python scripts/bench_accuracy.py                              # batch 500 (120 iterations) and 64
    python scripts/bench_accuracy.py --batch-sizes 500 --solvers hybrid kfac --seeds 0

``--task lm``: the byte-level transformer of ``train_lm.py`` at a bench size (``--layers 2
--width 128 --heads 4 --seq-len 64``, batch 32, 400 steps) on the standard library's bytes
(``--max-bytes`` of training text), with AdamW, a warm-up of ``--warmup-intervals`` evaluation
intervals and a cosine lr to 0 at the last step. The validation loss (nats per token) is
evaluated every ``--eval-every`` steps on a fixed set of ``--eval-windows`` validation windows,
evenly spaced over the validation bytes. AdamW runs at each lr of ``--adamw-lrs`` (the best
is the one with the lowest median final validation loss), then AdamW + hylo with each
``--solvers`` solver at ``--lr`` (default: AdamW's best lr) and ``--damping`` (default: 1e-3 for
``kfac``, 0.3 for the others), each over ``--seeds``. For each
seed, the target is the final validation loss of AdamW at its best lr with that seed; the
table gives, per solver, the steps and the training seconds at the first evaluation at or
below the target, as ratios to AdamW's own (its first evaluation at or below its final
loss): median and range over the seeds that reached it (count in brackets if not all did).
The issue's targets are ≤ 0.7× the steps and ≤ 0.9× the time. ``--out CURVES.csv`` writes
every curve (long format) and ``CURVES-ratios.csv`` the per-seed ratios. ``--quick``: tiny
sizes (a smoke test in seconds); explicit flags still apply.

    python scripts/bench_accuracy.py --task lm                    # 3 lrs + 4 solvers × 3 seeds, ~25 min
    python scripts/bench_accuracy.py --task lm --seeds 0 --steps 200 --out runs/lm-bench.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hylo_scripts.benchmarks import flags, timing
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.data.registry import DataOptions, DataSplits, load_dataset
from hylo_scripts.data.text import TokenWindows
from hylo_scripts.training import argtypes
from hylo_scripts.training.hylo_options import ADAPTIVE, TRAINER_LRS, solver_choices
from hylo_scripts.training.loop import RunResult, train
from hylo_scripts.training.runconfig import RunConfig
from hylo_scripts.training.rundir import write_rows

#: The tasks of the benchmark.
TASKS = ("classification", "lm")  # the keys of BENCHES
#: Flags of one task only (argparse names) -> the task; given with the other task they are an error.
TASK_FLAGS = {
    "batch_sizes": "classification",
    "iterations": "classification",
    "sgd_lrs": "classification",
    "thresholds": "classification",
    "adamw_lrs": "lm",
    "steps": "lm",
    "batch_size": "lm",
    "seq_len": "lm",
    "layers": "lm",
    "width": "lm",
    "heads": "lm",
    "max_bytes": "lm",
    "eval_windows": "lm",
    "quick": "lm",
}
#: hylo's damping in the benchmark's runs, unless :data:`LM_DAMPING` or ``--damping`` says otherwise.
DAMPING = 0.3
#: The lm bench's damping of a solver when ``--damping`` is not given (the others: :data:`DAMPING`). Under AdamW,
#: which sets the step's length, K-FAC at 0.3 barely turns the decoder's gradients; at 1e-3 it beats KAISA
#: (docs/benchmarks.md, "KAISA and hylo's K-FAC on the language model").
LM_DAMPING = {"kfac": 1e-3, "hybrid": 1e-3}  # hybrid: K-FAC on every matrix of the decoder (its cost model)
#: hylo's update_freq in the benchmark's runs, unless :data:`LM_UPDATE_FREQ` or ``--freq`` says otherwise.
UPDATE_FREQ = 10
#: The lm bench's update_freq of a solver when ``--freq`` is not given (the others: :data:`UPDATE_FREQ`). kfac_adam's basis goes
#: stale fast early in training: on the LM bench its final loss went 1.68 / 1.57 / 1.45 / 1.41 at updates every
#: 20 / 10 / 5 / 3 steps (seed 0, lr 4e-3; docs/benchmarks.md, "Peers"); with the warm-started refresh
#: (:data:`LM_OPTIONS`) every 3 steps reaches AdamW's loss in 125 steps where every 5 took 150 (docs/benchmarks.md,
#: "The LM race with cheaper updates").
LM_UPDATE_FREQ = {"kfac_adam": 3}
#: The lm bench's other hylo options of a solver (over :data:`DAMPING`'s and the task's; ``--set`` overrides them).
LM_OPTIONS: dict[str, dict[str, Any]] = {"kfac_adam": {"basis_refresh": "power"}}
#: Each task's defaults of the flags left unset (lm: the bench size; ``lr`` None: AdamW's best).
DEFAULTS: dict[str, dict[str, Any]] = {
    "classification": {
        "batch_sizes": [500, 64],
        "iterations": [120, 480],
        "eval_every": 8,
        "solvers": list(solver_choices()),
        "sgd_lrs": [0.03, 0.05, 0.07, 0.1],
        "thresholds": [0.96, 0.97],
        "lr": None,
        "damping": DAMPING,
        "kfac_method": "eigen",
        "kl_clip": 1e-2,
        "weight_decay": 5e-4,
        "warmup_intervals": 0.5,
    },
    "lm": {
        "adamw_lrs": [1e-3, 2e-3, 4e-3],
        "solvers": ["kfac", "kid", "kis", "hybrid"],
        "steps": 400,
        "eval_every": 25,
        "batch_size": 32,
        "seq_len": 64,
        "layers": 2,
        "width": 128,
        "heads": 4,
        "max_bytes": 1_000_000,
        "eval_windows": 64,
        "lr": None,
        "damping": None,  # LM_DAMPING
        # docs/benchmarks.md, "KAISA and hylo's K-FAC on the language model": the factored damping wins there
        "kfac_method": "inverse",
        "kl_clip": 1e-2,
        "weight_decay": 0.01,
        "warmup_intervals": 2.0,
    },
}
#: ``--quick``: the lm sizes of a smoke test (seconds), under any flag given explicitly.
QUICK = {
    "adamw_lrs": [2e-3],
    "steps": 8,
    "eval_every": 4,
    "batch_size": 8,
    "seq_len": 16,
    "layers": 1,
    "width": 32,
    "heads": 2,
    "max_bytes": 20_000,
    "eval_windows": 8,
    "warmup_intervals": 0.5,
}


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


def classification_lr(args: argparse.Namespace, solver: str) -> float:
    """The peak lr of ``solver``'s classification runs: ``--lr``, else train.py's default for its solver family
    (``TRAINER_LRS["classification"]``: 0.1, or ``ADAPTIVE_LR`` for an adaptive solver, whose step is Adam-scaled)."""
    if args.lr is not None:
        return float(args.lr)
    return TRAINER_LRS["classification"].of(solver)


#: The solvers whose runs repeat for each ``--rank-ratio`` (they keep r of n rows; hybrid picks KID/KIS).
RANKED = ("kid", "kis", "hybrid")


@dataclass(frozen=True)
class HyLoRun:
    """A hylo run of the benchmark: its solver, its ``rank_ratio`` and the name its rows carry."""

    solver: str
    rank_ratio: float | str

    def label(self, name: str, several: bool) -> str:
        """The run's ``name``, with ``@ρ`` when the benchmark compares several rank ratios (``hylo-hybrid@auto``)."""
        ratio = self.rank_ratio if isinstance(self.rank_ratio, str) else format(self.rank_ratio, "g")
        return f"{name}@{ratio}" if several and self.solver in RANKED else name


def hylo_runs(args: argparse.Namespace) -> list[HyLoRun]:
    """Each ``--solvers`` solver, once per ``--rank-ratio`` for a solver in :data:`RANKED` (else at the first)."""
    return [
        HyLoRun(solver, ratio)
        for solver in args.solvers
        for ratio in (args.rank_ratio if solver in RANKED else args.rank_ratio[:1])
    ]


def _hylo_options(args: argparse.Namespace, solver: str | None, rank_ratio: float | str = 0.1) -> dict[str, Any]:
    """The hylo options of a run with ``solver`` at ``rank_ratio`` (none for the plain optimizer)."""
    if solver is None:
        return {}
    damping = LM_DAMPING.get(solver, DAMPING) if args.damping is None else args.damping
    # kl_clip bounds a natural-gradient step; kfac_adam's step is normalised already (and its lr is Adam's): off
    kl_clip = None if solver in ADAPTIVE else args.kl_clip
    freq = UPDATE_FREQ if args.freq is None else args.freq
    options = {"damping": damping, "update_freq": freq, "kl_clip": kl_clip, "rank_ratio": rank_ratio}
    return options | {"kfac_method": args.kfac_method}


def run_config(
    args: argparse.Namespace, batch_size: int, solver: str | None, lr: float, seed: int, rank_ratio: float | str = 0.1
) -> RunConfig:
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
        hylo=_hylo_options(args, solver, rank_ratio),
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
    """Command-line options (defaults: the settings of docs/benchmarks.md, "Time to accuracy", per ``--task``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=TASKS, default="classification", help="MNIST accuracy or a language model")
    parser.add_argument("--eval-every", type=int, help="steps between test evaluations (default 8; lm 25)")
    parser.add_argument("--solvers", nargs="+", choices=solver_choices(), help="hylo solvers (default all; lm: 4)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--lr", type=float, help="peak lr of the hylo runs (default 0.1, adaptive solvers 0.01; lm: AdamW's best)"
    )
    parser.add_argument("--damping", type=float, help="hylo damping (default 0.3; lm: kfac 1e-3, others 0.3)")
    parser.add_argument("--freq", type=int, default=None, help="hylo update_freq (default 10; lm: LM_UPDATE_FREQ's)")
    parser.add_argument("--kl-clip", type=float, help="hylo kl_clip (default 1e-2)")
    parser.add_argument(
        "--kfac-method", choices=("eigen", "inverse"), help="hylo's kfac_method (default eigen; lm: inverse)"
    )
    parser.add_argument(
        "--rank-ratio",
        type=argtypes.ratio,
        nargs="+",
        default=[0.1],
        help="hylo's rank_ratio: ρ in (0, 1] or auto; several: kid, kis and hybrid run once per value, named "
        "solver@ρ (default 0.1)",
    )
    parser.add_argument("--weight-decay", type=float, help="weight decay (default 5e-4; lm 0.01)")
    parser.add_argument(
        "--warmup-intervals", type=float, help="lr warm-up, in evaluation intervals (default 0.5; lm 2)"
    )
    parser.add_argument("--threads", type=int, default=2)
    flags.add_device(parser)
    parser.add_argument("--out", type=Path, default=None, help="CSV of every run's curve (long format)")
    mnist = parser.add_argument_group("--task classification")
    mnist.add_argument("--batch-sizes", type=int, nargs="+", help="batch sizes (default 500 64)")
    mnist.add_argument("--iterations", type=int, nargs="+", help="steps per run, one per batch size (default 120 480)")
    mnist.add_argument("--sgd-lrs", type=float, nargs="*", help="plain SGD's lr grid (default 0.03 0.05 0.07 0.1)")
    mnist.add_argument("--thresholds", type=float, nargs="+", help="test accuracies to reach (default 0.96 0.97)")
    lm = parser.add_argument_group("--task lm")
    lm.add_argument("--adamw-lrs", type=float, nargs="+", help="AdamW's lr grid (default 1e-3 2e-3 4e-3)")
    lm.add_argument("--steps", type=int, help="steps per run (default 400)")
    lm.add_argument("--batch-size", type=int, help="windows per batch (default 32)")
    lm.add_argument("--seq-len", type=int, help="window and context length in bytes (default 64)")
    lm.add_argument("--layers", type=int, help="transformer blocks (default 2)")
    lm.add_argument("--width", type=int, help="model width (default 128)")
    lm.add_argument("--heads", type=int, help="attention heads (default 4)")
    lm.add_argument("--max-bytes", type=int, help="training bytes of the stdlib corpus (default 1,000,000)")
    lm.add_argument("--eval-windows", type=int, help="validation windows of every evaluation (default 64)")
    lm.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    args = parser.parse_args(argv)
    wrong = [
        name for name, task in TASK_FLAGS.items() if task != args.task and getattr(args, name) not in (None, False)
    ]
    if wrong:
        parser.error(f"{', '.join('--' + n.replace('_', '-') for n in wrong)}: not a flag of --task {args.task}")
    defaults = DEFAULTS[args.task] | (QUICK if args.quick else {})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    problem = BENCHES[args.task].misuse(args)
    if problem:
        parser.error(problem)
    return args


def run_classification(args: argparse.Namespace) -> int:
    """Run every (batch size, run, seed), print the table, optionally write the curves."""
    data: DataSplits = load_dataset("mnist5k", DataOptions(seed=0))
    device: torch.device = args.device
    device_name = describe(device)
    print(f"device: {device_name}", flush=True)
    outcomes: list[Outcome] = []
    curves: list[dict[str, object]] = []
    began = timing.now(device)
    for batch_size in args.batch_sizes:
        several = len(args.rank_ratio) > 1
        runs: list[tuple[HyLoRun | None, float]] = [(None, lr) for lr in args.sgd_lrs]
        runs += [(run, classification_lr(args, run.solver)) for run in hylo_runs(args)]
        for run, lr in runs:
            for seed in args.seeds:
                solver, ratio = (None, 0.1) if run is None else (run.solver, run.rank_ratio)
                result = train(run_config(args, batch_size, solver, lr, seed, ratio), data, device=device)
                name = result.name if run is None else run.label(result.name, several)
                reached = {t: first_reach(result, t) for t in args.thresholds}
                outcomes.append(Outcome(batch_size, name, lr, seed, result.test_accuracy, reached))
                curves += [
                    {"batch_size": batch_size, "run": name, "lr": lr, "seed": seed, "step": e.step}
                    | {"test_acc": e.test_metric, "train_s": round(e.total_time_s, 4), "device": device_name}
                    for e in result.log
                ]
                print(
                    f"batch {batch_size:>4} {name:<12} lr {lr:<6g} seed {seed}: "
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
    print(f"total {timing.now(device) - began:.0f} s")
    if args.out is not None:
        write_rows(args.out, curves)
        print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- --task lm
@dataclass(frozen=True)
class LMCurve:
    """One language-model run: (step, training seconds, validation loss) at each evaluation."""

    name: str
    lr: float
    seed: int
    points: list[tuple[int, float, float]]

    @property
    def final_loss(self) -> float:
        """The validation loss at the last evaluation."""
        return self.points[-1][2]

    def first_below(self, target: float) -> tuple[int, float] | None:
        """(step, training seconds) of the first evaluation with validation loss <= ``target``, or None."""
        return next(((step, seconds) for step, seconds, loss in self.points if loss <= target), None)


def _lm_options(args: argparse.Namespace, solver: str | None) -> dict[str, Any]:
    """The lm bench's options of ``solver``: :data:`LM_OPTIONS`, and its update_freq (:data:`LM_UPDATE_FREQ`) unless
    ``--freq`` was given."""
    if solver is None:
        return {}
    options = dict(LM_OPTIONS.get(solver, {}))
    if solver in LM_UPDATE_FREQ and args.freq is None:
        options["update_freq"] = LM_UPDATE_FREQ[solver]
    return options


def lm_config(
    args: argparse.Namespace, solver: str | None, lr: float, seed: int, rank_ratio: float | str = 0.1
) -> RunConfig:
    """One run of the lm benchmark: ``--steps`` in intervals of ``--eval-every``, AdamW, cosine lr."""
    return RunConfig(
        dataset="stdlib",
        model="transformer",
        seq_len=args.seq_len,
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        max_bytes=args.max_bytes,
        optimizer="adamw",
        solver=solver,
        epochs=max(1, args.steps // args.eval_every),
        max_steps=args.eval_every,
        batch_size=args.batch_size,
        lr=lr,
        lr_schedule="cosine",
        warmup_epochs=args.warmup_intervals,
        weight_decay=args.weight_decay,
        hylo=_hylo_options(args, solver, rank_ratio) | _lm_options(args, solver),
        seed=seed,
    )


def best_adamw_lr(curves: Sequence[LMCurve]) -> float:
    """The AdamW lr with the lowest median final validation loss."""
    adamw = [c for c in curves if c.name == "adamw"]
    lrs = sorted({c.lr for c in adamw})
    return min(lrs, key=lambda lr: statistics.median(c.final_loss for c in adamw if c.lr == lr))


def lm_ratios(curves: Sequence[LMCurve], best_lr: float) -> list[dict[str, Any]]:
    """Per hylo run: AdamW's (best lr, same seed) final loss as target and the steps / seconds ratios to reach it."""
    baseline = {c.seed: c for c in curves if c.name == "adamw" and c.lr == best_lr}
    rows = []
    for curve in curves:
        if curve.name == "adamw" or curve.seed not in baseline:
            continue
        reference = baseline[curve.seed]
        target = reference.final_loss
        own = reference.first_below(target)
        assert own is not None  # its last evaluation is at its final loss
        hit = curve.first_below(target)
        rows.append(
            {
                "run": curve.name,
                "lr": curve.lr,
                "seed": curve.seed,
                "target_loss": target,
                "adamw_steps": own[0],
                "adamw_s": round(own[1], 4),
                "steps": None if hit is None else hit[0],
                "seconds": None if hit is None else round(hit[1], 4),
                "step_ratio": None if hit is None else hit[0] / own[0],
                "time_ratio": None if hit is None else hit[1] / max(own[1], 1e-12),
                "final_loss": curve.final_loss,
            }
        )
    return rows


def summarise_lm(curves: Sequence[LMCurve], ratios: Sequence[Mapping[str, Any]], best_lr: float) -> str:
    """The table: AdamW per lr (final loss), then per hylo solver the final loss and the ratios to AdamW's target."""
    header = f"{'run':<12} {'lr':>8} {'final val loss':>22} {'steps ratio':>22} {'time ratio':>22}"
    lines = [header, "-" * len(header)]
    for key in dict.fromkeys((c.name, c.lr) for c in curves):
        runs = [c for c in curves if (c.name, c.lr) == key]
        row = f"{key[0]:<12} {key[1]:>8g} {median_range([c.final_loss for c in runs], '.4f'):>22}"
        if key[0] == "adamw":
            row += f" {'(target)' if key[1] == best_lr else '':>22}"
        else:
            mine = [r for r in ratios if (r["run"], r["lr"]) == key]
            hits = [r for r in mine if r["step_ratio"] is not None]
            count = "" if len(hits) == len(mine) else f" ({len(hits)}/{len(mine)})"
            row += f" {median_range([r['step_ratio'] for r in hits], '.2f') + count:>22}"
            row += f" {median_range([r['time_ratio'] for r in hits], '.2f') + count:>22}"
        lines.append(row)
    return "\n".join(lines)


def lm_data(args: argparse.Namespace) -> DataSplits:
    """The stdlib corpus at ``--seq-len`` / ``--max-bytes``, its test set ``--eval-windows`` spread windows."""
    data = load_dataset("stdlib", DataOptions(seq_len=args.seq_len, max_bytes=args.max_bytes))
    if not isinstance(data.test, TokenWindows):
        raise TypeError(f"the stdlib corpus should give token windows, got {type(data.test).__name__}")
    return dataclasses.replace(data, test=data.test.spread(args.eval_windows))


def run_lm(args: argparse.Namespace) -> int:
    """AdamW over the lr grid, then AdamW + each hylo solver, every seed; print the table, optionally write CSVs."""
    data = lm_data(args)
    device: torch.device = args.device
    device_name = describe(device)
    print(f"device: {device_name}", flush=True)
    print(f"data: {data.info} (evaluating {len(data.test)} validation windows)", flush=True)
    curves: list[LMCurve] = []
    began = timing.now(device)

    several = len(args.rank_ratio) > 1

    def run(hylo_run: HyLoRun | None, lr: float) -> None:
        solver, ratio = (None, 0.1) if hylo_run is None else (hylo_run.solver, hylo_run.rank_ratio)
        for seed in args.seeds:
            result = train(lm_config(args, solver, lr, seed, ratio), data, device=device)
            name = result.name if hylo_run is None else hylo_run.label(result.name, several)
            points = [(e.step, e.total_time_s, e.test_loss) for e in result.log]
            curves.append(LMCurve(name, lr, seed, points))
            print(
                f"{name:<12} lr {lr:<8g} seed {seed}: final val loss {points[-1][2]:.4f} "
                f"({points[-1][2] / math.log(2):.3f} bits/byte) in {points[-1][1]:.1f} s",
                flush=True,
            )

    for lr in args.adamw_lrs:
        run(None, lr)
    best = best_adamw_lr(curves)
    for hylo_run in hylo_runs(args):
        run(hylo_run, best if args.lr is None else args.lr)
    ratios = lm_ratios(curves, best)
    print()
    print(summarise_lm(curves, ratios, best))
    print(
        f"adamw: the lr of {args.adamw_lrs} with the lowest median final validation loss ({best:g}) sets each "
        "seed's target; ratios are hylo / AdamW at the first evaluation at or below it (targets: steps <= 0.7, "
        "time <= 0.9)"
    )
    print(f"total {timing.now(device) - began:.0f} s")
    if args.out is not None:
        rows = [
            {"run": c.name, "lr": c.lr, "seed": c.seed, "step": step, "train_s": round(seconds, 4)}
            | {"val_loss": loss, "val_bpb": loss / math.log(2), "device": device_name}
            for c in curves
            for step, seconds, loss in c.points
        ]
        write_rows(args.out, rows)
        print(f"wrote {args.out}")
        if ratios:
            ratio_path = args.out.with_name(f"{args.out.stem}-ratios.csv")
            write_rows(ratio_path, [row | {"device": device_name} for row in ratios])
            print(f"wrote {ratio_path}")
    return 0


def _classification_misuse(args: argparse.Namespace) -> str | None:
    if len(args.iterations) != len(args.batch_sizes):
        return "--iterations needs one value per --batch-sizes entry"
    return None


def _lm_misuse(args: argparse.Namespace) -> str | None:
    if args.steps < args.eval_every:
        return f"--steps {args.steps} must be at least --eval-every {args.eval_every}"
    return None


@dataclass(frozen=True)
class Bench:
    """One ``--task`` of the benchmark: its run and its check of the flags."""

    run: Callable[[argparse.Namespace], int]
    misuse: Callable[[argparse.Namespace], str | None]


#: The benchmark of each ``--task``.
BENCHES = {
    "classification": Bench(run_classification, _classification_misuse),
    "lm": Bench(run_lm, _lm_misuse),
}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark of ``--task`` (exit status 0)."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    return BENCHES[args.task].run(args)


if __name__ == "__main__":
    raise SystemExit(main())
