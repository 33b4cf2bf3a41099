"""Time per update and per step of each solver on one nn.Linear(d, d) layer (CPU or GPU).

Example:
    python scripts/bench_solvers.py --dims 64 256 1024 4096 --batches 32 128 1024 --out bench_solvers.csv

"update" is a full ``pre.step()`` on an update step (capture → factors/rows → local
reduction → solve → precondition); "step" is ``pre.step()`` between updates (precondition
with the stored state only). The median of ``--repeats`` runs is reported.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

import torch

import hylo
from hylo_scripts.benchmarks import flags, timing
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.training.engine import write_rows


def time_solver(
    solver: str, d: int, n: int, rank_ratio: float, repeats: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds of an update step and of a non-update step."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(d, d).to(device)
    pre = hylo.HyLoPreconditioner(layer, solver=solver, update_freq=2, damping=1.0, rank_ratio=rank_ratio)
    x = torch.randn(n, d, device=device)
    target = torch.randn(n, d, device=device)

    def timed(fn: Callable[[], None]) -> float:
        layer.zero_grad()
        torch.nn.functional.mse_loss(layer(x), target).backward()
        start = timing.now(device)
        fn()
        return timing.now(device) - start

    update_times, step_times = [], []
    for _ in range(repeats):
        update_times.append(timed(pre.step))  # even step: update
        step_times.append(timed(pre.step))  # odd step: reuse
    pre.remove()
    return statistics.median(update_times), statistics.median(step_times)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the grid, print a table and optionally write a CSV."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 128, 1024])
    parser.add_argument("--solvers", nargs="+", default=["kfac", "sngd", "kid", "kis"])
    parser.add_argument("--rank-ratio", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    flags.add_device(parser)
    parser.add_argument("--out", default=None, help="CSV file to write")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    name = describe(device)
    rows = []
    print(f"device: {name}")
    print(f"{'solver':<6} {'d':>6} {'n':>6} {'update_ms':>11} {'step_ms':>9}")
    for d in args.dims:
        for n in args.batches:
            for solver in args.solvers:
                update_s, step_s = time_solver(solver, d, n, args.rank_ratio, args.repeats, device)
                rows.append(
                    {
                        "solver": solver,
                        "d": d,
                        "n": n,
                        "rank_ratio": args.rank_ratio,
                        "update_ms": 1e3 * update_s,
                        "step_ms": 1e3 * step_s,
                        "device": name,
                    }
                )
                print(f"{solver:<6} {d:>6} {n:>6} {1e3 * update_s:>11.2f} {1e3 * step_s:>9.2f}", flush=True)
    if args.out:
        write_rows(args.out, rows)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
