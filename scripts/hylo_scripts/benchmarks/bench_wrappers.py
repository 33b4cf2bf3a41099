"""What each wrapper a training script may use costs with hylo: the plain optimizer against optimizer + hylo.

Examples:
    python scripts/bench_wrappers.py --model transformer --batch-size 32 --steps 30
    python scripts/bench_wrappers.py --model resnet20 --batch-size 64 --wrappers none ddp fsdp2

For every wrapper (``none``; ``autocast``: bf16 autocast of the forward and loss; ``scaler``: the
same with a ``GradScaler``, ``step()`` after ``unscale_``; ``checkpoint``: activation checkpointing
of every block; ``compile``: ``torch.compile`` of the model before hylo is attached; ``ddp`` and
``fsdp2``: ``DistributedDataParallel`` and per-block plus root ``fully_shard`` on ``--world`` gloo
ranks of one thread each) the plain optimizer and optimizer + hylo (``--solver``, default the
default ``hybrid``) each train ``--steps`` iterations in a fresh process from the same weights on
the same random batch. Reported: the median ms per iteration after ``--warmup`` iterations
(update and other steps as they occur), hylo's time over the plain one's, the slowest timed iteration of each
(under DDP every rank waits for the slowest rank's update), and rank 0's peak resident set size (``ru_maxrss``).
``--set KEY=VALUE`` passes hylo options (``--set stagger_updates=True``). The language model (``transformer``) trains with AdamW, the
image models with SGD and momentum. A wrapper this torch build cannot run is reported as such.
``--device cuda`` runs on the GPU (autocast and the scaler on CUDA), the distributed wrappers on
NCCL with rank r on ``cuda:r`` (refused when the machine has fewer GPUs than ``--world``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import tempfile
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hylo
from hylo_scripts.benchmarks import flags, timing
from hylo_scripts.benchmarks.bench_memory import peak_rss_mb
from hylo_scripts.benchmarks.devices import backend, describe, rank_device, ranks_problem
from hylo_scripts.models.registry import MODELS, build_model
from hylo_scripts.training.process import run_child

WRAPPERS = ("none", "autocast", "scaler", "checkpoint", "compile", "ddp", "fsdp2")
#: Wrappers that run on ``--world`` ranks.
DISTRIBUTED = ("ddp", "fsdp2")
#: The models this benchmark knows the blocks of (what ``checkpoint`` and ``fsdp2`` wrap).
MODEL_CHOICES = ("transformer", "resnet20", "resnet32", "cnn")
#: Seconds a child may run before the benchmark gives up on it.
CHILD_TIMEOUT = 1200.0


@dataclasses.dataclass(frozen=True)
class WrapperRun:
    """One child: a model and batch, a wrapper, plain (``solver=None``) or with a hylo solver."""

    model: str
    wrapper: str
    solver: str | None
    batch: int
    steps: int = 30
    warmup: int = 5
    update_freq: int = 10
    world: int = 2
    threads: int = 2
    #: The transformer's size (the LM bench: 2 blocks of width 128, context 64).
    layers: int = 2
    width: int = 128
    context: int = 64
    #: Where it runs (a distributed wrapper's rank r on ``cuda:r`` on CUDA).
    device: str = "cpu"
    #: More hylo options (JSON values: they travel to the child process as JSON).
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def device_of(self, rank: int) -> torch.device:
        """The device of rank ``rank`` (of the one process of a wrapper that is not distributed)."""
        device = torch.device(self.device)
        return rank_device(device, rank) if self.wrapper in DISTRIBUTED else device


class Checkpointed(nn.Module):
    """Runs ``inner`` under activation checkpointing (non-reentrant), the way training scripts wrap blocks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False)


def blocks_of(model: nn.Module) -> nn.ModuleList | nn.Sequential:
    """The repeated blocks of a benchmark model (the transformer's decoder blocks, a ResNet's residual
    blocks, the CNN's layers)."""
    found = getattr(model, "blocks", None) or getattr(model, "layers", None) or model
    assert isinstance(found, (nn.ModuleList, nn.Sequential)), type(found)
    return found


def build(run: WrapperRun) -> tuple[nn.Module, Tensor, Tensor]:
    """The model (from seed 0) and one random batch of ``run``'s shape."""
    spec = MODELS[run.model]
    torch.manual_seed(0)
    if run.model == "transformer":
        model = build_model(run.model, (run.context,), layers=run.layers, width=run.width, heads=4)
        x, y = spec.random_batch(run.batch, side=run.context)
    else:
        model = build_model(run.model)
        x, y = spec.random_batch(run.batch)
    return model, x, y


def wrap(model: nn.Module, wrapper: str) -> nn.Module:
    """``model`` under ``wrapper`` (the process group is up for the distributed ones)."""
    if wrapper == "checkpoint":
        blocks = blocks_of(model)
        for i, block in enumerate(list(blocks)):
            blocks[i] = Checkpointed(block)
    elif wrapper == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    elif wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in blocks_of(model):
            fully_shard(block)
        fully_shard(model)
    return model


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    out = model(x)
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten() if out.dim() > 2 else y)


def train(run: WrapperRun, rank: int = 0) -> dict[str, Any]:
    """Train ``run.steps`` iterations in this process (rank ``rank``); its times and peak memory."""
    torch.set_num_threads(run.threads)
    warnings.filterwarnings("ignore", message="hylo leaves")
    device = run.device_of(rank)
    model, x, y = build(run)
    if run.wrapper in DISTRIBUTED:
        share = run.batch // run.world
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    model, x, y = model.to(device), x.to(device), y.to(device)
    model = wrap(model, run.wrapper)
    if run.wrapper == "compile":
        compiled = torch.compile(model)
        assert isinstance(compiled, nn.Module)
        model = compiled
        _loss(model, x, y).backward()  # compiled code runs before hylo is attached (the order users hit)
        model.zero_grad(set_to_none=True)
    optimizer: torch.optim.Optimizer
    if run.model == "transformer":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pre = None
    if run.solver is not None:
        pre = hylo.HyLoPreconditioner(model, solver=run.solver, update_freq=run.update_freq, **run.options)
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext
    if run.wrapper in ("autocast", "scaler"):

        def autocast() -> AbstractContextManager[Any]:
            return torch.autocast(device.type, dtype=torch.bfloat16)

    scaler = torch.amp.GradScaler(device.type) if run.wrapper == "scaler" else None
    times = []
    for _ in range(run.warmup + run.steps):
        start = timing.now(device)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = _loss(model, x, y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            loss.backward()
        if pre is not None:
            pre.step()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        times.append(timing.now(device) - start)
    if pre is not None:
        pre.remove()
    timed = times[run.warmup :]
    return {"ms_per_iter": 1e3 * statistics.median(timed), "slowest_ms": 1e3 * max(timed), "peak_rss_mb": peak_rss_mb()}


def _rank_main(rank: int, run: WrapperRun, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = run.device_of(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's and fully_shard's device of this rank
    dist.init_process_group(backend(device), rank=rank, world_size=run.world)
    try:
        result = train(run, rank)
        dist.barrier()
        if rank == 0:
            with open(out, "w") as handle:
                json.dump(result, handle)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child(run: WrapperRun) -> dict[str, Any]:
    """``run`` in this process, or on ``run.world`` spawned ranks for the distributed wrappers (rank 0's figures)."""
    if run.wrapper not in DISTRIBUTED:
        return train(run)
    with tempfile.TemporaryDirectory(prefix="hylo-bench-wrappers-") as directory:
        out = os.path.join(directory, "rank0.json")
        mp.spawn(_rank_main, args=(dataclasses.replace(run, threads=1), _free_port(), out), nprocs=run.world)
        with open(out) as handle:
            return dict(json.load(handle))


def run_in_process(run: WrapperRun, timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
    """:func:`child` in a fresh Python process; ``RuntimeError`` with its stderr's tail if it fails."""
    what = f"{run.wrapper} ({run.solver or 'plain'}) on {run.model}"
    return run_child("hylo_scripts.benchmarks.bench_wrappers", dataclasses.asdict(run), what, timeout)


def measure(base: WrapperRun, solver: str, wrappers: Sequence[str]) -> list[dict[str, Any]]:
    """Per wrapper: the plain and the hylo child's figures, or the first error's message."""
    rows = []
    for wrapper in wrappers:
        row: dict[str, Any] = {"wrapper": wrapper}
        try:
            plain = run_in_process(dataclasses.replace(base, wrapper=wrapper, solver=None))
            with_hylo = run_in_process(dataclasses.replace(base, wrapper=wrapper, solver=solver))
        except RuntimeError as err:
            row["error"] = str(err).splitlines()[-1]
        else:
            row.update(
                plain_ms=plain["ms_per_iter"],
                hylo_ms=with_hylo["ms_per_iter"],
                ratio=with_hylo["ms_per_iter"] / plain["ms_per_iter"],
                plain_slowest=plain["slowest_ms"],
                hylo_slowest=with_hylo["slowest_ms"],
                plain_mb=plain["peak_rss_mb"],
                hylo_mb=with_hylo["peak_rss_mb"],
            )
        rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]], solver: str) -> str:
    """The rows as an aligned text table."""
    lines = [
        f"{'wrapper':<11} {'plain ms':>9} {'+' + solver + ' ms':>12} {'ratio':>6} {'slowest':>8} {'+hylo':>8} "
        f"{'plain MB':>9} {'hylo MB':>8}"
    ]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['wrapper']:<11} not run: {row['error']}")
            continue
        lines.append(
            f"{row['wrapper']:<11} {row['plain_ms']:>9.1f} {row['hylo_ms']:>12.1f} {row['ratio']:>6.2f} "
            f"{row['plain_slowest']:>8.1f} {row['hylo_slowest']:>8.1f} {row['plain_mb']:>9.0f} {row['hylo_mb']:>8.0f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print each wrapper's plain and hylo ms/iter, slowest iteration and peak memory."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="transformer", choices=MODEL_CHOICES)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--world", type=int, default=2, help="ranks of the ddp and fsdp2 runs")
    parser.add_argument("--threads", type=int, default=2, help="threads of a one-process run")
    parser.add_argument("--solver", default="hybrid")
    parser.add_argument("--wrappers", nargs="+", default=list(WRAPPERS), choices=WRAPPERS)
    parser.add_argument(
        "--set", nargs="+", type=flags.hylo_option, default=[], metavar="KEY=VALUE", help="hylo options"
    )
    flags.add_device(parser, "cpu or cuda[:N] (default: cuda if any); ddp/fsdp2 on CUDA: NCCL, rank r on cuda:r")
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(WrapperRun(**json.loads(args.child)))))
        return
    if args.batch_size % args.world:
        parser.error(f"--batch-size {args.batch_size} must be divisible by --world {args.world}")
    problem = ranks_problem(args.device, args.world) if set(args.wrappers) & set(DISTRIBUTED) else None
    if problem is not None:
        parser.error(f"{problem} (the {' and '.join(w for w in args.wrappers if w in DISTRIBUTED)} runs)")
    base = WrapperRun(
        args.model,
        "none",
        None,
        args.batch_size,
        args.steps,
        args.warmup,
        args.update_freq,
        args.world,
        args.threads,
        device=str(args.device),
        options=dict(args.set),
    )
    print(f"device: {describe(args.device)}", flush=True)
    print(format_table(measure(base, args.solver, args.wrappers), args.solver))


if __name__ == "__main__":
    main()
