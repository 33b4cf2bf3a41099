"""The cost of a step with hylo against the plain optimizer's, in one process, interleaved: the mean (amortised over
whole update cycles), the update steps' and the steps' between them, and the slowest step, with and without
``stagger_updates`` and for any variants of the options (docs/benchmarks.md, "Curvature updates").

Example:
    python scripts/bench_stagger.py --solver kfac --update-freq 10 --set kfac_method=inverse
    python scripts/bench_stagger.py --solver kfac_adam --update-freq 3 --set basis_refresh=power --no-staggered \\
        --variant sampled factor_sample=0.25

Runs from the same weights on the same random batch of ``--model`` (the workloads of ``bench_overhead.py``): the
plain optimizer (AdamW for a language model, else SGD with momentum 0.9), the optimizer with hylo (``--solver``,
``--set`` options), the same with ``stagger_updates=True`` (unless ``--no-staggered``), and each ``--variant NAME
KEY=VALUE ...`` (hylo with these options on top of ``--set``). After ``--warmup`` iterations of each, ``--rounds``
rounds time ``--steps`` iterations of each in turn (alternating, so that a drift in the machine's speed reaches
every run alike; ``--warmup`` and ``--steps`` multiples of ``--update-freq`` make each round whole update cycles).
Reported per run, in wall ms per iteration and against the plain optimizer's mean: the mean (the amortised cost;
also as the median and range over rounds of the round's mean over the plain run's), the mean of the update steps
(iterations where the step count is a multiple of ``--update-freq``, also for a variant that sets another
``update_freq``) and of the steps between them, and the slowest iteration (the spike an update step makes, which staggering spreads).
``--device cuda`` runs them on a GPU (default: cuda when available), each iteration timed between two device
synchronisations; the first line names the device.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

import hylo
from hylo_scripts.benchmarks import timing
from hylo_scripts.benchmarks.bench_overhead import workload
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.benchmarks.flags import add_device, add_variant_flag, hylo_option, parse_variants
from hylo_scripts.models.registry import model_names

#: The runs before any variant, in the order they are timed in each round: the plain optimizer, hylo, hylo staggered.
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
    staggered: bool = True,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    device: torch.device | None = None,
) -> dict[str, list[float]]:
    """Per run (:data:`RUNS`, without ``"staggered"`` unless ``staggered``, then each of ``variants``: hylo with its
    options on top of ``options``), the wall seconds of each timed iteration (``rounds`` × ``steps``, alternating),
    on ``device`` (default CPU), each timed between two synchronisations of it."""
    device = device or torch.device("cpu")
    base, x, y, lm = workload(model_name, batch, image, None, model_options)
    base, x, y = base.to(device), x.to(device), y.to(device)

    def run(hylo_options: Mapping[str, Any] | None) -> Callable[[], float]:
        model = copy.deepcopy(base)
        pre = None
        if hylo_options is not None:
            pre = hylo.HyLoPreconditioner(model, **{"solver": solver, "update_freq": update_freq, **hylo_options})
        opt: torch.optim.Optimizer = (
            torch.optim.AdamW(model.parameters(), lr=1e-3)
            if lm
            else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        )

        def iteration() -> float:
            start = timing.now(device)
            opt.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out.flatten(0, 1), y.flatten()) if lm else F.cross_entropy(out, y)
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            return timing.now(device) - start

        return iteration

    hylo_options = {"damping": 0.03, **options}
    runs: dict[str, Mapping[str, Any] | None] = {"plain": None, "hylo": hylo_options}
    if staggered:
        runs["staggered"] = {**hylo_options, "stagger_updates": True}
    for name, extra in (variants or {}).items():
        if name in runs:
            raise ValueError(f"variant {name!r}: the name of a run already timed ({', '.join(runs)})")
        runs[name] = {**hylo_options, **extra}
    iterations = {name: run(run_options) for name, run_options in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for iteration in iterations.values():
        for _ in range(warmup):
            iteration()
    for _ in range(rounds):
        for name, iteration in iterations.items():
            times[name] += [iteration() for _ in range(steps)]
    return times


def table(times: Mapping[str, list[float]], *, update_freq: int, warmup: int, rounds: int) -> str:
    """Per run, ms per iteration and against the plain run's mean: the mean, the median [range] over rounds of the
    round's mean over the plain run's, the update steps' mean, the steps' between them and the slowest."""
    plain = times["plain"]
    reference = statistics.fmean(plain)
    per_round = len(plain) // rounds
    lines = [
        f"{'run':<12} {'mean':>8} {'vs':>6} {'rounds':>11} {'update':>8} {'vs':>6} {'between':>8} {'vs':>6} "
        f"{'slowest':>8} {'vs':>6}"
    ]
    for name, seconds in times.items():
        ratios = [
            statistics.fmean(seconds[r * per_round : (r + 1) * per_round])
            / statistics.fmean(plain[r * per_round : (r + 1) * per_round])
            for r in range(rounds)
        ]
        update = [t for k, t in enumerate(seconds) if (warmup + k % per_round) % update_freq == 0]
        between = [t for k, t in enumerate(seconds) if (warmup + k % per_round) % update_freq != 0]
        cells = (statistics.fmean(update), statistics.fmean(between or update), max(seconds))
        lines.append(
            f"{name:<12} {1e3 * statistics.fmean(seconds):>8.1f} {statistics.fmean(seconds) / reference:>6.2f} "
            f"{statistics.median(ratios):>4.2f} [{min(ratios):.2f}–{max(ratios):.2f}]"
            + "".join(f" {1e3 * t:>8.1f} {t / reference:>6.2f}" for t in cells)
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the table of the runs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="transformer", choices=[*model_names(), *model_names("lm")])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=None, help="input side, a language model's T (default 64)")
    parser.add_argument("--layers", type=int, default=2, help="the model's layers (models that take it)")
    parser.add_argument("--width", type=int, default=128, help="the model's width (models that take it)")
    parser.add_argument("--solver", default="kfac")
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--set", nargs="+", type=hylo_option, default=[], metavar="KEY=VALUE", help="hylo options")
    add_variant_flag(parser, "another hylo run: a name, then options on top of --set (repeatable)")
    parser.add_argument("--no-staggered", action="store_true", help="leave out the run with stagger_updates=True")
    parser.add_argument("--steps", type=int, default=40, help="timed iterations of each run per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    add_device(parser)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="hylo leaves")
    torch.set_num_threads(args.threads)
    lm = args.model in model_names("lm")
    sizes = {"layers": args.layers, "width": args.width} if lm else None
    variants = parse_variants(args.variant)
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
        staggered=not args.no_staggered,
        variants=variants,
        device=args.device,
    )
    print(
        f"device: {describe(args.device)}, threads {torch.get_num_threads()}, torch {torch.__version__}; {args.model}, "
        f"{args.solver}, update_freq {args.update_freq}, {dict(args.set)}; variants {variants}; wall ms per iteration, "
        "vs the plain optimizer's mean"
    )
    print(table(times, update_freq=args.update_freq, warmup=args.warmup, rounds=args.rounds))
