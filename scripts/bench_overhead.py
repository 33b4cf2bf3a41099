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
import os
import tempfile
import time
import warnings

import torch

import hylo
from scripts.models import MODELS


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
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.random_batch(batch, side=image or None)
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


def profiled_iteration_time(
    model_name: str, solver: str, batch: int, steps: int, warmup: int, update_freq: int, image: int | None
) -> float:
    """:func:`iteration_time` of ``solver`` with hylo's profiling into a fresh temporary directory."""
    with tempfile.TemporaryDirectory(prefix="hylo-bench-profile-") as directory:
        return iteration_time(model_name, solver, batch, steps, warmup, update_freq, image, profile_dir=directory)


def main() -> None:
    """Print the per-iteration time of SGD and of each solver, and the ratio (with ``--profile``, profiled too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=list(MODELS))
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
    for solver in args.solvers:
        t = iteration_time(args.model, solver, *shape)
        line = f"{'sgd+' + solver:<12} {1e3 * t:>9.1f} {t / base:>7.2f}"
        if args.profile:
            p = profiled_iteration_time(args.model, solver, *shape)
            line += f" {1e3 * p:>9.1f} {p / base:>7.2f} {p / t:>10.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
