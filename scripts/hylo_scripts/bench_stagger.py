"""The slowest step and the mean with and without ``stagger_updates``, in one process, beside the plain optimizer
(docs/benchmarks.md, "Curvature updates").

Example:
    python scripts/bench_stagger.py --solver kfac --update-freq 10 --set kfac_method=inverse
    python scripts/bench_stagger.py --solver kfac_adam --update-freq 5 --set basis_refresh=power

Three runs from the same weights on the same random batch of ``--model`` (the workloads of ``bench_overhead.py``):
the plain optimizer (AdamW for a language model, else SGD with momentum 0.9), the optimizer with hylo
(``--solver``, ``--set`` options), and the same with ``stagger_updates=True``. After ``--warmup`` iterations of
each, ``--rounds`` rounds time ``--steps`` iterations of each in turn (alternating, so that a drift in the
machine's speed reaches all three alike; ``--steps`` a multiple of ``--update-freq`` makes each round whole update
cycles). Reported per run, in wall ms per iteration and against the plain optimizer's median: the mean (the
amortised cost), the median, and the slowest iteration (the spike an update step makes, which staggering spreads).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

import hylo
from hylo_scripts.argtypes import hylo_option
from hylo_scripts.bench_overhead import workload
from hylo_scripts.models import model_names

#: The runs, in the order they are timed in each round: the plain optimizer, hylo, hylo staggered.
RUNS = ("plain", "hylo", "staggered")


def timed_iterations(
    model_name: str,
    solver: str,
    update_freq: int,
    options: Mapping[str, Any],
    *,
    batch: int,
    image: int | None = None,
    model_options: Mapping[str, int] | None = None,
    steps: int = 40,
    warmup: int = 10,
    rounds: int = 3,
) -> dict[str, list[float]]:
    """Per run of :data:`RUNS`, the wall seconds of each timed iteration (``rounds`` × ``steps``, alternating)."""
    base, x, y, lm = workload(model_name, batch, image, None, model_options)

    def run(hylo_options: Mapping[str, Any] | None) -> Callable[[], float]:
        model = copy.deepcopy(base)
        pre = None
        if hylo_options is not None:
            pre = hylo.HyLoPreconditioner(model, solver=solver, update_freq=update_freq, **hylo_options)
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(model.parameters(), lr=1e-3)
            if lm
            else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        )

        def iteration() -> float:
            start = time.perf_counter()
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out.flatten(0, 1), y.flatten()) if lm else F.cross_entropy(out, y)
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            return time.perf_counter() - start

        return iteration

    hylo_options = {"damping": 0.03, **options}
    iterations = dict(
        zip(RUNS, (run(None), run(hylo_options), run({**hylo_options, "stagger_updates": True})), strict=True)
    )
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    for iteration in iterations.values():
        for _ in range(warmup):
            iteration()
    for _ in range(rounds):
        for name, iteration in iterations.items():
            times[name] += [iteration() for _ in range(steps)]
    return times


def table(times: Mapping[str, list[float]]) -> str:
    """Mean, median and slowest ms per iteration of each run, each against the plain run's median."""
    reference = statistics.median(times["plain"])
    lines = [f"{'run':<10} {'mean':>8} {'vs':>6} {'median':>8} {'vs':>6} {'slowest':>8} {'vs':>6}"]
    for name, seconds in times.items():
        cells = (statistics.fmean(seconds), statistics.median(seconds), max(seconds))
        lines.append(f"{name:<10}" + "".join(f" {1e3 * t:>8.1f} {t / reference:>6.2f}" for t in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the table of the three runs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer", choices=[*model_names(), *model_names("lm")])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=None, help="input side, a language model's T (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers (models that take it)")
    parser.add_argument("--width", type=int, default=128, help="the model's width (models that take it)")
    parser.add_argument("--solver", default="kfac")
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--set", nargs="+", type=hylo_option, default=[], metavar="KEY=VALUE", help="hylo options")
    parser.add_argument("--steps", type=int, default=40, help="timed iterations of each run per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="hylo leaves")
    torch.set_num_threads(args.threads)
    lm = args.model in model_names("lm")
    sizes = {"layers": args.layers, "width": args.width} if lm else None
    times = timed_iterations(
        args.model,
        args.solver,
        args.update_freq,
        dict(args.set),
        batch=args.batch_size,
        image=args.image_size or (64 if lm else None),
        model_options=sizes,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
    )
    print(
        f"device: cpu, threads {torch.get_num_threads()}, torch {torch.__version__}; {args.model}, {args.solver}, "
        f"update_freq {args.update_freq}, {dict(args.set)}; wall ms per iteration, vs the plain optimizer's median"
    )
    print(table(times))
