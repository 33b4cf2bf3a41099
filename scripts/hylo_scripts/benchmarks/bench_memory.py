"""Peak memory of a training process: plain SGD against SGD + hylo, each run in its own process.

Examples:
    python scripts/bench_memory.py --model resnet32 --batch-size 128 --steps 20 --repeats 2
    python scripts/bench_memory.py --model resnet32 --solvers sgd hybrid kfac --profile-update
    python scripts/bench_memory.py --model resnet50 --batch-size 8 --image-size 128 --steps 12 \\
        --solvers sgd hybrid kfac --profile-update

Every (solver, repeat) runs ``--steps`` training iterations (SGD with momentum, random inputs of
the workload's shape, ``update_freq`` as given) in a fresh Python process, so each peak is that
run's alone: the peak resident set size (``getrusage``'s ``ru_maxrss``, the number
``/usr/bin/time -f %M`` prints) and, on CUDA, ``torch.cuda.max_memory_allocated``. For hylo runs it
also reports what the preconditioner holds after the last step (``memory_breakdown()``: its
states and bookkeeping) and the most its hooks kept for a ``step()`` (``captured``, read after
the backward of each update step).

``--profile-update`` then runs one more iteration that is an update step under torch's profiler
with ``profile_memory=True`` and replays its allocation events: per phase (forward, backward,
hylo.step, optimizer.step), the transient peak — the most bytes allocated above what was live
when the phase began — and the iteration's own peak above its start.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import resource
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

import hylo
from hylo_scripts.benchmarks import flags, timing
from hylo_scripts.benchmarks.devices import describe
from hylo_scripts.models.registry import MODELS, build_model, model_names
from hylo_scripts.training.process import run_child

#: The phases of a profiled iteration, in order (record_function names).
PHASES = ("forward", "backward", "hylo.step", "optimizer.step")
SOLVERS = ("sgd", "hybrid", "kfac", "sngd", "kid", "kis")
#: Seconds a child may run before the benchmark gives up on it.
CHILD_TIMEOUT = 1800.0
CSV_COLUMNS = (
    "model",
    "batch",
    "image",
    "solver",
    "repeat",
    "peak_rss_mb",
    "baseline_rss_mb",
    "cuda_peak_mb",
    "ms_per_iter",
    "state_mb",
    "bookkeeping_mb",
    "captured_mb",
    "tensors",
    *(f"transient_{phase}_mb" for phase in PHASES),
    "transient_iteration_mb",
    "device",
)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One child run: a model at a batch size, with plain SGD (``solver="sgd"``) or a hylo solver."""

    model: str
    solver: str
    batch: int
    image: int | None = None
    steps: int = 20
    update_freq: int = 10
    damping: float = 0.03
    threads: int = 2
    device: str = "cpu"
    max_unfold_mb: float | None = None
    profile_update: bool = False


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def replay_peaks(
    allocations: Sequence[tuple[int, int]], phases: Sequence[tuple[str, int, int]]
) -> tuple[dict[str, int], int]:
    """Transient peaks from allocation events: per phase, the most bytes live above the phase's start.

    ``allocations`` are (time, signed bytes) events, ``phases`` (name, start, end) intervals on the
    same clock. Returns the peak of each phase and that of the whole span from the first phase's
    start to the last one's end, all relative to the live bytes at their start (never negative).
    """
    events = sorted(allocations)
    peaks: dict[str, int] = {}
    for name, start, end in [*phases, ("iteration", min(p[1] for p in phases), max(p[2] for p in phases))]:
        live, peak = 0, 0
        for when, nbytes in events:
            if start <= when <= end:
                live += nbytes
                peak = max(peak, live)
        peaks[name] = peak
    iteration = peaks.pop("iteration")
    return peaks, iteration


def _profiled_iteration(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    pre: hylo.HyLoPreconditioner | None,
    device: torch.device,
) -> tuple[dict[str, float], float]:
    """One iteration under the profiler; its transient peaks per phase and overall, in MiB."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        optimizer.zero_grad(set_to_none=True)
        with record_function("forward"):
            loss = F.cross_entropy(model(x), y)
        with record_function("backward"):
            loss.backward()
        with record_function("hylo.step"):
            if pre is not None:
                pre.step()
        with record_function("optimizer.step"):
            optimizer.step()
        timing.synchronize(device)
    events = prof.profiler.kineto_results.events()
    kind = torch._C._autograd.DeviceType.CUDA if device.type == "cuda" else torch._C._autograd.DeviceType.CPU
    allocations = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type() == kind]
    phases = [(e.name(), e.start_ns(), e.end_ns()) for e in events if e.name() in PHASES]
    found = {name for name, _, _ in phases}
    if found != set(PHASES):
        raise RuntimeError(f"the profiler recorded the phases {sorted(found)}, expected {list(PHASES)}")
    peaks, iteration = replay_peaks(allocations, phases)
    return {name: peaks[name] / 2**20 for name in PHASES}, iteration / 2**20


def child_run(config: RunConfig) -> dict[str, Any]:
    """Train ``config.steps`` iterations in this process and report its memory (see the module docstring)."""
    torch.set_num_threads(config.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    device = torch.device(config.device)
    spec = MODELS[config.model]
    torch.manual_seed(0)
    model = build_model(config.model, spec.shape(config.image)).to(device)
    x, y = (t.to(device) for t in spec.random_batch(config.batch, side=config.image))
    baseline = peak_rss_mb()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = None
    if config.solver != "sgd":
        options: dict[str, Any] = {
            "solver": config.solver,
            "update_freq": config.update_freq,
            "damping": config.damping,
        }
        if config.max_unfold_mb is not None:
            options["max_unfold_mb"] = config.max_unfold_mb
        pre = hylo.HyLoPreconditioner(model, **options)
    captured = 0
    times = []
    for _ in range(config.steps):
        start = timing.now(device)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if pre is not None:
            if pre.steps % config.update_freq == 0:  # an update step: what the hooks kept for step()
                paused = timing.now(device)
                captured = max(captured, sum(pre.memory_breakdown().captured.values()))
                start += timing.now(device) - paused
            pre.step()
        optimizer.step()
        times.append(timing.now(device) - start)
    timed = times[2:] if len(times) > 2 else times
    result: dict[str, Any] = {
        "device": describe(device),
        "peak_rss_mb": peak_rss_mb(),
        "baseline_rss_mb": baseline,
        "cuda_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "ms_per_iter": 1e3 * sum(timed) / len(timed),
    }
    if pre is not None:
        held = pre.memory_breakdown()
        result.update(
            state_mb=sum(held.state.values()) / 2**20,
            bookkeeping_mb=held.bookkeeping / 2**20,
            captured_mb=captured / 2**20,
            tensors=held.tensors,
        )
    if config.profile_update:
        while pre is not None and pre.steps % config.update_freq != 0:  # run up to the next update step
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            pre.step()
            optimizer.step()
        phases, iteration = _profiled_iteration(model, x, y, optimizer, pre, device)
        result.update({f"transient_{name}_mb": mb for name, mb in phases.items()}, transient_iteration_mb=iteration)
    return result


def run_in_process(config: RunConfig, timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
    """:func:`child_run` in a fresh Python process; ``RuntimeError`` with its stderr's tail if it fails."""
    what = f"{config.solver} on {config.model}"
    return run_child("hylo_scripts.benchmarks.bench_memory", dataclasses.asdict(config), what, timeout)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def format_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """The runs by solver: peak RSS of each repeat, ratios to SGD, time per iteration, what hylo holds."""
    base = results.get("sgd")
    base_rss = _mean([r["peak_rss_mb"] for r in base]) if base else None
    base_ms = _mean([r["ms_per_iter"] for r in base]) if base else None
    profiled = any("transient_iteration_mb" in r for runs in results.values() for r in runs)
    header = f"{'run':<12} {'peak RSS MB':>17} {'vs SGD':>7} {'ms/iter':>8} {'vs SGD':>7} {'state MB':>9} {'captured MB':>11}"
    if profiled:
        header += "".join(f" {phase + ' MB':>18}" for phase in PHASES) + f" {'iteration MB':>12}"
    lines = [header]
    for solver, runs in results.items():
        rss = [r["peak_rss_mb"] for r in runs]
        ms = _mean([r["ms_per_iter"] for r in runs])
        line = f"{solver if solver == 'sgd' else 'sgd+' + solver:<12} {' / '.join(f'{v:,.0f}' for v in rss):>17}"
        line += f" {_mean(rss) / base_rss:>7.2f}" if base_rss else f" {'':>7}"
        line += f" {ms:>8.1f}" + (f" {ms / base_ms:>7.2f}" if base_ms else f" {'':>7}")
        line += f" {_mean([r.get('state_mb', 0.0) for r in runs]):>9.1f} {_mean([r.get('captured_mb', 0.0) for r in runs]):>11.1f}"
        if profiled:
            line += "".join(f" {_mean([r[f'transient_{p}_mb'] for r in runs]):>18.1f}" for p in PHASES)
            line += f" {_mean([r['transient_iteration_mb'] for r in runs]):>12.1f}"
        lines.append(line)
    return "\n".join(lines)


def write_csv(
    path: str | os.PathLike[str], configs: Sequence[RunConfig], results: dict[str, list[dict[str, Any]]]
) -> None:
    """One row per run (empty cells where a value does not apply)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, CSV_COLUMNS)
        writer.writeheader()
        by_solver = {config.solver: config for config in configs}
        for solver, runs in results.items():
            config = by_solver[solver]
            for repeat, run in enumerate(runs):
                row = {"model": config.model, "batch": config.batch, "image": config.image or "", "solver": solver}
                row.update(repeat=repeat, **{k: "" if v is None else v for k, v in run.items() if k in CSV_COLUMNS})
                writer.writerow(row)


def main(argv: Sequence[str] | None = None) -> None:
    """Run every configuration in its own process and print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="resnet32", choices=model_names())
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=None, help="input side (default: the workload's)")
    parser.add_argument("--steps", type=int, default=20, help="training iterations per run")
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--damping", type=float, default=0.03)
    parser.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=SOLVERS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration, each in its own process")
    flags.add_device(parser)
    parser.add_argument("--max-unfold-mb", type=float, default=None, help="hylo's max_unfold_mb (default: its own)")
    parser.add_argument("--profile-update", action="store_true", help="profile one update iteration's allocations")
    parser.add_argument("--csv", default=None, help="write one row per run here")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child_run(RunConfig(**json.loads(args.child)))))
        return
    if args.steps < 1 or args.repeats < 1 or args.batch_size < 1 or args.update_freq < 1:
        parser.error("--steps, --repeats, --batch-size and --update-freq must be at least 1")
    configs = [
        RunConfig(
            args.model,
            solver,
            args.batch_size,
            args.image_size,
            args.steps,
            args.update_freq,
            args.damping,
            args.threads,
            str(args.device),
            args.max_unfold_mb,
            args.profile_update,
        )
        for solver in args.solvers
    ]
    print(f"device: {describe(args.device)}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {}
    for config in configs:
        try:
            results[config.solver] = [run_in_process(config) for _ in range(args.repeats)]
        except RuntimeError as err:
            sys.exit(f"bench_memory: {err}")
        print(f"{config.solver}: done", file=sys.stderr, flush=True)
    print(format_table(results))
    if args.csv:
        write_csv(args.csv, configs, results)


if __name__ == "__main__":
    main()
