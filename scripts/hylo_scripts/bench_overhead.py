"""Wall time per training iteration: plain SGD against SGD + hylo, on a paper workload's shapes.

Example:
    python scripts/bench_overhead.py --model resnet32 --batch-size 128 --steps 30 --update-freq 10
    python scripts/bench_overhead.py --model resnet32 --solvers hybrid kfac --profile

Random inputs of the workload's shape (the data does not change the cost). Reports the mean
time of an iteration (forward, backward, preconditioner, optimizer) over ``--steps`` after
``--warmup`` iterations, averaged over update and non-update steps as they occur.

``--profile`` measures the cost of hylo's profiling itself: each solver is run a second time
with ``profile_dir`` set (a fresh temporary directory per run, deleted afterwards; no
studies), so that hylo times every phase and layer and writes its CSV files as a
``--profiling`` training run does. Its row then also has the profiled ms/iter, that time
against plain SGD, and ``prof/plain``, the profiled time over the unprofiled one (the
overhead factor of profiling; 1.00 is none). The files' final flush at ``close()`` falls
outside the timed iterations; the flushes at update steps are inside. On a busy or small
machine differences of a few percent are within the run-to-run noise.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
import time
import warnings

import torch

import hylo
from hylo_scripts.models import MODELS, build_model, model_names


def iteration_time(
    model_name: str,
    solver: str | None,
    batch: int,
    steps: int,
    warmup: int,
    update_freq: int,
    image: int | None,
    profile_dir: str | os.PathLike[str] | None = None,
) -> float:
    """Mean seconds per iteration (solver None = plain SGD); ``profile_dir`` turns on hylo's profiling."""
    if profile_dir is not None and solver is None:
        raise ValueError("profile_dir profiles hylo: it needs a solver")
    spec = MODELS[model_name]
    side = image or None
    torch.manual_seed(0)
    model = build_model(model_name, spec.shape(side))
    x, y = spec.random_batch(batch, side=side)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = None
    if solver is not None:
        pre = hylo.HyLoPreconditioner(
            model, solver=solver, update_freq=update_freq, damping=0.03, profile_dir=profile_dir
        )
    elapsed = 0.0
    try:
        for i in range(warmup + steps):
            start = time.perf_counter()
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if pre is not None:
                pre.step()
            optimizer.step()
            if i >= warmup:
                elapsed += time.perf_counter() - start
    finally:
        if pre is not None:
            pre.remove()
    return elapsed / steps


#: The columns of steps-r0.csv the phase table reports, in order.
BREAKDOWN = ("check", "decide", "capture", "reduce", "gather", "solve", "broadcast", "precondition")


def phase_breakdown(steps_csv: str | os.PathLike[str], skip: int = 0) -> tuple[dict[str, float], float]:
    """Mean ms per phase over the update steps of a ``steps-r{rank}.csv`` (its first ``skip`` steps
    left out), and the mean ms of the other steps."""
    with open(steps_csv, newline="") as handle:
        rows = [row for row in csv.DictReader(handle) if int(row["step"]) >= skip]
    updates = [row for row in rows if row["kind"] == "update"]
    applies = [float(row["step_ms"]) for row in rows if row["kind"] == "apply"]
    if not updates:
        raise ValueError(f"{steps_csv} has no update step after step {skip}")
    means = {phase: sum(float(row[f"{phase}_ms"]) for row in updates) / len(updates) for phase in BREAKDOWN}
    means["step"] = sum(float(row["step_ms"]) for row in updates) / len(updates)
    return means, sum(applies) / len(applies) if applies else float("nan")


def profiled_iteration_time(
    model_name: str, solver: str, batch: int, steps: int, warmup: int, update_freq: int, image: int | None
) -> tuple[float, dict[str, float], float]:
    """:func:`iteration_time` of ``solver`` with hylo's profiling into a fresh temporary directory, and
    :func:`phase_breakdown` of its timed steps."""
    with tempfile.TemporaryDirectory(prefix="hylo-bench-profile-") as directory:
        t = iteration_time(model_name, solver, batch, steps, warmup, update_freq, image, profile_dir=directory)
        phases, apply_ms = phase_breakdown(os.path.join(directory, "steps-r0.csv"), skip=warmup)
        return t, phases, apply_ms


def main() -> None:
    """Print the per-iteration time of SGD and of each solver, and the ratio (with ``--profile``, profiled too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=model_names())
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=None, help="input side (default: the workload's)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--solvers", nargs="+", default=["hybrid", "kid", "kis", "sngd", "kfac"])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--profile", action="store_true", help="also time each solver with hylo's profiling on (profile_dir)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    shape = (args.batch_size, args.steps, args.warmup, args.update_freq, args.image_size)
    base = iteration_time(args.model, None, *shape)
    header = f"{'optimizer':<12} {'ms/iter':>9} {'vs SGD':>7}"
    if args.profile:
        header += f" {'profiled':>9} {'vs SGD':>7} {'prof/plain':>10}"
    print(header)
    print(f"{'sgd':<12} {1e3 * base:>9.1f} {1.0:>7.2f}")
    breakdowns: dict[str, tuple[dict[str, float], float]] = {}
    for solver in args.solvers:
        t = iteration_time(args.model, solver, *shape)
        line = f"{'sgd+' + solver:<12} {1e3 * t:>9.1f} {t / base:>7.2f}"
        if args.profile:
            p, phases, apply_ms = profiled_iteration_time(args.model, solver, *shape)
            breakdowns[solver] = (phases, apply_ms)
            line += f" {1e3 * p:>9.1f} {p / base:>7.2f} {p / t:>10.2f}"
        print(line, flush=True)
    if breakdowns:
        print("\nms in hylo's step() per update step, by phase (steps-r0.csv), and per other step:")
        print(f"{'solver':<8}" + "".join(f" {phase:>9}" for phase in (*BREAKDOWN, "step", "apply")))
        for solver, (phases, apply_ms) in breakdowns.items():
            values = [*(phases[phase] for phase in (*BREAKDOWN, "step")), apply_ms]
            print(f"{solver:<8}" + "".join(f" {value:>9.1f}" for value in values))


if __name__ == "__main__":
    main()
