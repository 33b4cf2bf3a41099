"""Wall time per training iteration: plain SGD against SGD + hylo, on a paper workload's shapes.

Example:
    python scripts/bench_overhead.py --model resnet32 --batch-size 128 --steps 30 --update-freq 10
    python scripts/bench_overhead.py --model resnet32 --solvers hybrid kfac --profile
    python scripts/bench_overhead.py --model transformer --vocab 32000 --layers 2 --width 128 --image-size 64 \
        --batch-size 32 --optimizer adamw --threads 2 --solvers hybrid kfac

Random inputs of the workload's shape (the data does not change the cost): images, or uniform
tokens of ``--vocab`` (a language model's vocabulary, a classifier's classes). Reports the mean
time of an iteration (forward, backward, preconditioner, optimizer) over ``--steps`` after
``--warmup`` iterations, averaged over update and non-update steps as they occur, and the median
(a step between updates when updates are fewer than half the steps), and apart: the mean of the
update steps and the median of the other steps, each against the plain optimizer's median
iteration (the update step is when hylo captures and solves; the others only apply the stored
state; under ``stagger_updates`` the steps at offset 0), and the slowest iteration. ``--steps`` a multiple of ``--update-freq`` makes the mean the cost amortized over whole
update cycles. ``--device`` runs it on a GPU (default: cuda when available), each iteration
timed between two device synchronisations; the device is printed with the table. ``--model
llama`` is a small Hugging Face ``LlamaForCausalLM`` (needs ``transformers``; 4 layers of width
256, 4 heads, MLP 688, random weights, ``--vocab`` default 1,024, ``--image-size`` its context,
default 128). ``--set KEY=VALUE`` passes
hylo options (Python literals: ``--set "skip_layers=('head',)"``); a solver whose construction
refuses the model (e.g. ``kfac`` over ``kfac_max_state_mb``) is reported as refused. ``kaisa`` among
``--solvers`` times KAISA (kfac-pytorch's ``KFACPreconditioner``, when installed: its factors and
inverses every ``--update-freq`` steps, damping 0.003) in the same loop. ``--autocast bf16`` runs the
forward under ``torch.autocast`` in bf16. On CUDA each row also gives the run's peak allocated memory
(``torch.cuda.max_memory_allocated``: model, optimizer, activations and preconditioner), in MB. Under
``torchrun`` every rank runs the same batch under DDP, or with ``--shard`` each block and the model
``fully_shard``-ed (FSDP2), and rank 0 reports its own times.

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
import contextlib
import csv
import io
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import hylo
from hylo_scripts.benchmarks.flags import default_device, hylo_option
from hylo_scripts.benchmarks.flags import device as device_type
from hylo_scripts.benchmarks.peers import kaisa_preconditioner
from hylo_scripts.benchmarks.timing import now
from hylo_scripts.models.registry import MODELS, build_model, model_names
from hylo_scripts.training.hylo_options import ADAPTIVE
from hylo_scripts.training.optimizers import adapted_optimizer
from hylo_scripts.training.process import distributed, rank_and_world

#: The name among ``--solvers`` that times KAISA instead of a hylo solver.
KAISA = "kaisa"
#: ``--autocast``'s choices: the forward's autocast dtype.
AUTOCAST = {"off": None, "bf16": torch.bfloat16}

#: ``--model llama``: the Hugging Face decoder of :func:`hylo_scripts.benchmarks.bench_compile.build` (vocabulary, context).
LLAMA_DEFAULTS = (1024, 128)


def workload(
    model_name: str, batch: int, image: int | None, classes: int | None, model_options: Mapping[str, int] | None
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, bool]:
    """The model (from seed 0), a random batch and its targets, and whether it is a language model."""
    torch.manual_seed(0)
    if model_name == "llama":
        from hylo_scripts.benchmarks.bench_compile import build

        vocab, context = classes or LLAMA_DEFAULTS[0], image or LLAMA_DEFAULTS[1]
        tokens = torch.randint(0, vocab, (batch, context + 1))
        return build("llama", vocab, context), tokens[:, :-1], tokens[:, 1:], True
    spec = MODELS[model_name]
    side = image or None
    model = build_model(model_name, spec.shape(side), classes, **(model_options or {}))
    x, y = spec.random_batch(batch, side=side)
    if classes is not None:  # labels (or tokens) of the model's own classes
        x = torch.randint(0, classes, x.shape) if spec.task == "lm" else x
        y = torch.randint(0, classes, y.shape) if y.dtype == torch.long else y
    return model, x, y, spec.task == "lm"


def placed(model: torch.nn.Module, shard: bool) -> torch.nn.Module:
    """The model as it trains here: with ``shard``, each block (the entries of its ``ModuleList``s, else each layer
    with parameters) and then the model ``fully_shard``-ed (FSDP2); else, in a process group of P > 1 ranks,
    wrapped in DDP; else itself."""
    if shard:
        blocks = [block for m in model.modules() if isinstance(m, torch.nn.ModuleList) for block in m]
        leaves = [m for m in model.modules() if m is not model and not list(m.children()) and list(m.parameters())]
        for module in blocks or leaves:
            fully_shard(module)
        fully_shard(model)
        return model
    if rank_and_world()[1] > 1:
        return DistributedDataParallel(model)
    return model


def iteration_time(
    model_name: str,
    solver: str | None,
    batch: int,
    steps: int,
    warmup: int,
    update_freq: int,
    image: int | None,
    profile_dir: str | os.PathLike[str] | None = None,
    *,
    classes: int | None = None,
    model_options: Mapping[str, int] | None = None,
    optimizer: str = "sgd",
    options: Mapping[str, Any] | None = None,
    times: list[float] | None = None,
    updates: list[bool] | None = None,
    device: torch.device | None = None,
    cpu_time: bool = False,
    autocast: torch.dtype | None = None,
    shard: bool = False,
) -> float:
    """Mean seconds per iteration (solver None = the plain optimizer); ``profile_dir`` turns on hylo's
    profiling. ``classes``: the model's classes (a language model's vocabulary); ``model_options``: its
    size options; ``optimizer``: ``"sgd"`` (momentum 0.9) or ``"adamw"``; ``options``: more hylo options;
    ``times``, if given, receives every timed iteration's seconds, and ``updates`` whether each was an update
    step (an iteration whose ``step()`` was hylo's ``k``-th with ``k`` a multiple of ``update_freq``; all False for
    the plain optimizer); ``device``: where it runs (default CPU), each iteration timed between two
    synchronisations of it; ``cpu_time``: the process's CPU seconds instead of wall seconds (CPU only: a figure
    that another process's load on the machine disturbs less); ``autocast``: the forward's autocast dtype (None:
    off); ``shard``: FSDP2 (:func:`placed`; in a process group of P > 1 ranks the model is wrapped in DDP
    otherwise). ``solver`` :data:`KAISA` steps KAISA's preconditioner instead of hylo's."""
    if cpu_time and device is not None and device.type != "cpu":
        raise ValueError("cpu_time measures the process's CPU seconds: it needs device cpu")
    if profile_dir is not None and solver is None:
        raise ValueError("profile_dir profiles hylo: it needs a solver")
    device = device or torch.device("cpu")
    model, x, y, lm = workload(model_name, batch, image, classes, model_options)
    model, x, y = placed(model.to(device), shard), x.to(device), y.to(device)
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer must be 'sgd' or 'adamw', got {optimizer!r}")

    def base(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.01, momentum=0.9)
        return torch.optim.AdamW(params, lr=1e-3)

    pre: Any = None
    if solver is not None and solver != KAISA:
        pre = hylo.HyLoPreconditioner(
            model,
            **{
                "solver": solver,
                "update_freq": update_freq,
                "damping": 0.03,
                "profile_dir": profile_dir,
                **(options or {}),
            },
        )
    opt: torch.optim.Optimizer = base(list(model.parameters()))
    if pre is not None and solver in ADAPTIVE:  # its layers take SGD without momentum (docs/usage.md)
        opt = adapted_optimizer(model, pre.parameters(), 1e-3, 0.0, base)
    if solver == KAISA:
        pre = kaisa_preconditioner(model, opt, update_freq)
    timed = [] if times is None else times
    kinds = [] if updates is None else updates
    try:
        for i in range(warmup + steps):
            start = time.process_time() if cpu_time else now(device)
            opt.zero_grad()
            with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                out = model(x)
                loss = (
                    torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
                    if lm
                    else torch.nn.functional.cross_entropy(out, y)
                )
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            if i >= warmup:
                timed.append((time.process_time() if cpu_time else now(device)) - start)
                kinds.append(pre is not None and i % update_freq == 0)
    finally:
        if isinstance(pre, hylo.HyLoPreconditioner):
            pre.remove()
    return sum(timed[-steps:]) / steps


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
    model_name: str,
    solver: str,
    batch: int,
    steps: int,
    warmup: int,
    update_freq: int,
    image: int | None,
    **workload: Any,
) -> tuple[float, dict[str, float], float]:
    """:func:`iteration_time` of ``solver`` (``workload``: its keyword arguments) with hylo's profiling into a
    fresh temporary directory, and :func:`phase_breakdown` of its timed steps."""
    with tempfile.TemporaryDirectory(prefix="hylo-bench-profile-") as directory:
        t = iteration_time(
            model_name, solver, batch, steps, warmup, update_freq, image, profile_dir=directory, **workload
        )
        rank = rank_and_world()[0]  # each rank profiles into its own directory, its own file
        phases, apply_ms = phase_breakdown(os.path.join(directory, f"steps-r{rank}.csv"), skip=warmup)
        return t, phases, apply_ms


def _row(label: str, times: list[float], updates: list[bool], base_mean: float, base_median: float) -> str:
    """One table row: mean and median ms per iteration, the update steps' mean, the other steps' median and the
    slowest iteration, each with its ratio to the plain optimizer's mean or median."""
    mean, median = statistics.fmean(times), statistics.median(times)
    update = [t for t, u in zip(times, updates, strict=True) if u]
    other = [t for t, u in zip(times, updates, strict=True) if not u]
    cells = [(mean, base_mean), (median, base_median)]
    cells += [(statistics.fmean(update), base_median) if update else (float("nan"), base_median)]
    cells += [(statistics.median(other), base_median) if other else (float("nan"), base_median)]
    cells += [(max(times), base_median)]
    return f"{label:<14}" + "".join(f" {1e3 * t:>9.1f} {t / ref:>6.2f}" for t, ref in cells)


def main() -> None:
    """Print the per-iteration time of the plain optimizer and of each solver, and the ratios (with
    ``--profile``, profiled too)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet32", choices=[*model_names(), *model_names("lm"), "llama"])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument(
        "--image-size", type=int, default=None, help="input side, a language model's T (default: the workload's)"
    )
    parser.add_argument(
        "--vocab", type=int, default=None, help="a language model's vocabulary (a classifier's classes)"
    )
    for size in ("layers", "width", "heads"):
        parser.add_argument(f"--{size}", type=int, default=None, help=f"the model's {size} (models that take it)")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adamw"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument(
        "--solvers",
        nargs="+",
        default=["hybrid", "kid", "kis", "sngd", "kfac"],
        help=f"hylo solvers, and {KAISA!r} for KAISA (kfac-pytorch, if installed)",
    )
    parser.add_argument("--autocast", default="off", choices=list(AUTOCAST), help="the forward's autocast dtype")
    parser.add_argument("--set", nargs="+", type=hylo_option, default=[], metavar="KEY=VALUE", help="hylo options")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--device", type=device_type, default=default_device(), help="cpu or cuda[:N]")
    parser.add_argument(
        "--cpu-time", action="store_true", help="time the process's CPU seconds, not wall seconds (a loaded machine)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also time each solver with hylo's profiling on (profile_dir)"
    )
    parser.add_argument(
        "--shard", action="store_true", help="under torchrun: fully_shard each block and the model (FSDP2), not DDP"
    )
    args = parser.parse_args()
    if args.cpu_time and args.device.type != "cpu":
        parser.error("--cpu-time measures the process's CPU seconds: it needs --device cpu")
    if args.model == "llama":
        try:
            import transformers  # noqa: F401
        except ImportError:
            parser.error("--model llama needs the transformers package (pip install transformers)")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    with distributed("gloo" if args.device.type == "cpu" else "auto") as device:
        rank, world = rank_and_world()
        if world > 1 and args.device.type != "cpu":  # under torchrun: this rank's device
            args.device = device
        with contextlib.redirect_stdout(sys.stdout if rank == 0 else io.StringIO()):  # rank 0 reports its times
            _report(args)


def _report(args: argparse.Namespace) -> None:
    """Time the plain optimizer and every solver and print the table."""
    shape = (args.batch_size, args.steps, args.warmup, args.update_freq, args.image_size)
    sizes = {k: getattr(args, k) for k in ("layers", "width", "heads") if getattr(args, k) is not None}
    workload: dict[str, Any] = {
        "classes": args.vocab,
        "model_options": sizes,
        "optimizer": args.optimizer,
        "options": dict(args.set),
        "device": args.device,
        "cpu_time": args.cpu_time,
        "autocast": AUTOCAST[args.autocast],
        "shard": args.shard,
    }
    cuda = args.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(args.device)
    base_times: list[float] = []
    base_kinds: list[bool] = []
    base = iteration_time(args.model, None, *shape, times=base_times, updates=base_kinds, **workload)
    base_median = statistics.median(base_times)

    def peak() -> str:
        """The peak allocated MB since the last call (CUDA), and a reset for the next run."""
        if not cuda:
            return ""
        mb = torch.cuda.max_memory_allocated(args.device) / 2**20
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(args.device)
        return f" {mb:>8.0f}"

    name = args.optimizer
    where = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    clock = "process CPU" if args.cpu_time else "wall"
    print(
        f"device: {args.device} ({where}), threads {torch.get_num_threads()}, torch {torch.__version__}"
        + (f" (CUDA {torch.version.cuda})" if cuda else "")
        + f"; autocast {args.autocast}; {clock} ms per iteration, vs {name}"
    )
    header = f"{'optimizer':<14} {'mean':>9} {'vs':>6} {'median':>9} {'vs':>6} {'update':>9} {'vs':>6} {'other':>9} {'vs':>6}"
    header += f" {'slowest':>9} {'vs':>6}"
    header += f" {'peak MB':>8}" if cuda else ""
    if args.profile:
        header += f" {'profiled':>9} {'vs ' + name:>9} {'prof/plain':>10}"
    print(header)
    print(_row(name, base_times, base_kinds, base, base_median) + peak())
    breakdowns: dict[str, tuple[dict[str, float], float]] = {}
    for solver in args.solvers:
        times: list[float] = []
        kinds: list[bool] = []
        try:
            t = iteration_time(args.model, solver, *shape, times=times, updates=kinds, **workload)
        except ValueError as err:
            print(f"{name + '+' + solver:<14} refused: {str(err)[:200]}", flush=True)
            peak()
            continue
        except ImportError as err:  # KAISA not installed
            print(f"{name + '+' + solver:<14} not installed: {err}", flush=True)
            continue
        line = _row(name + "+" + solver, times, kinds, base, base_median) + peak()
        if args.profile and solver != KAISA:
            p, phases, apply_ms = profiled_iteration_time(args.model, solver, *shape, **workload)
            breakdowns[solver] = (phases, apply_ms)
            line += f" {1e3 * p:>9.1f} {p / base:>9.2f} {p / t:>10.2f}"
        print(line, flush=True)
    print("mean: all timed iterations (vs the plain mean); median, update (their mean), other (their median), slowest")
    print(
        f"(the longest): vs the plain median; {args.steps} timed iterations after {args.warmup}, update_freq {args.update_freq}"
    )
    if breakdowns:
        print("\nms in hylo's step() per update step, by phase (steps-r0.csv), and per other step:")
        print(f"{'solver':<8}" + "".join(f" {phase:>9}" for phase in (*BREAKDOWN, "step", "apply")))
        for solver, (phases, apply_ms) in breakdowns.items():
            values = [*(phases[phase] for phase in (*BREAKDOWN, "step")), apply_ms]
            print(f"{solver:<8}" + "".join(f" {value:>9.1f}" for value in values))


if __name__ == "__main__":
    main()
