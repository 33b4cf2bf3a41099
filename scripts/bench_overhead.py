"""Wall time per training iteration: plain SGD against SGD + hylo, on a paper workload's shapes.

Example:
    python scripts/bench_overhead.py --model resnet32 --batch-size 128 --steps 30 --update-freq 10

Random inputs of the workload's shape (the data does not change the cost). Reports the mean
time of an iteration (forward, backward, preconditioner, optimizer) over ``--steps`` after
``--warmup`` iterations, averaged over update and non-update steps as they occur.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import hylo
from scripts.models import MODELS


def iteration_time(
    model_name: str, solver: str | None, batch: int, steps: int, warmup: int, update_freq: int, image: int | None
) -> float:
    """Mean seconds per iteration (solver None = plain SGD)."""
    spec = MODELS[model_name]
    torch.manual_seed(0)
    model = spec.build()
    x, y = spec.random_batch(batch, side=image or None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = None
    if solver is not None:
        pre = hylo.HyLoPreconditioner(model, solver=solver, update_freq=update_freq, damping=0.03)
    elapsed = 0.0
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if pre is not None:
            pre.step()
        optimizer.step()
        if i >= warmup:
            elapsed += time.perf_counter() - start
    return elapsed / steps


def main() -> None:
    """Print the per-iteration time of SGD and of each solver, and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=list(MODELS))
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=None, help="input side (default: the workload's)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--solvers", nargs="+", default=["hybrid", "kid", "kis", "sngd", "kfac"])
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    base = iteration_time(args.model, None, args.batch_size, args.steps, args.warmup, args.update_freq, args.image_size)
    print(f"{'optimizer':<12} {'ms/iter':>9} {'vs SGD':>7}")
    print(f"{'sgd':<12} {1e3 * base:>9.1f} {1.0:>7.2f}")
    for solver in args.solvers:
        t = iteration_time(
            args.model, solver, args.batch_size, args.steps, args.warmup, args.update_freq, args.image_size
        )
        print(f"{'sgd+' + solver:<12} {1e3 * t:>9.1f} {t / base:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
