"""hylo on a model sharded with FSDP2's ``fully_shard``, against the same model under DDP.

docs/distributed.md, "FSDP2" explains what changes. Build the preconditioner on the sharded model
(after ``fully_shard``) and call ``step()`` between ``backward()`` and ``optimizer.step()``, as under
DDP. This script trains a small MLP (four Linear layers) on random data under DDP and then under
``fully_shard`` (each Linear and the root), for each solver, and prints per step the wall time
(forward, backward, ``pre.step()``, ``optimizer.step()``), the time of ``pre.step()`` alone and
the bytes hylo sent (``pre.comm.bytes_sent``; FSDP's and DDP's own traffic is not counted), on
update steps and in between.

Run it on 2 CPU processes: ``torchrun --nproc-per-node 2 examples/fsdp2.py``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import hylo


def make_model(width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
        nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 10),
    )  # fmt: skip


def wrap(model: nn.Sequential, how: str) -> nn.Module:
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def run(how: str, solver: str, args: argparse.Namespace) -> dict[str, float]:
    """Mean per-step figures after ``args.warmup`` steps: ms per step, ms in pre.step(), bytes per step."""
    net = wrap(make_model(args.width), how)
    pre = hylo.HyLoPreconditioner(net, solver=solver, update_freq=args.update_freq, damping=1e-3)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    local = args.batch // dist.get_world_size()
    xs = torch.randn(args.steps, local, args.width, generator=gen)
    ys = torch.randint(0, 10, (args.steps, local), generator=gen)
    totals = {"step_ms": 0.0, "pre_ms": 0.0, "update_bytes": 0.0, "between_bytes": 0.0}
    updates = between = 0
    for i in range(args.steps):
        dist.barrier()
        begin = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(xs[i]), ys[i]).backward()
        sent, mark = pre.comm.bytes_sent, time.perf_counter()
        pre.step()
        pre_ms = (time.perf_counter() - mark) * 1e3
        opt.step()
        step_ms = (time.perf_counter() - begin) * 1e3
        if i < args.warmup:
            continue
        totals["step_ms"] += step_ms
        totals["pre_ms"] += pre_ms
        if i % args.update_freq == 0:
            totals["update_bytes"] += pre.comm.bytes_sent - sent
            updates += 1
        else:
            totals["between_bytes"] += pre.comm.bytes_sent - sent
            between += 1
    pre.remove()
    measured = args.steps - args.warmup
    return {
        "step_ms": totals["step_ms"] / measured,
        "pre_ms": totals["pre_ms"] / measured,
        "update_bytes": totals["update_bytes"] / max(updates, 1),
        "between_bytes": totals["between_bytes"] / max(between, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--update-freq", type=int, default=10)
    parser.add_argument("--solvers", nargs="+", default=["sngd", "kfac"])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, width {args.width}, global batch {args.batch}, update_freq "
              f"{args.update_freq}: mean over {args.steps - args.warmup} steps, rank 0")  # fmt: skip
        print(f"{'wrapper':<8} {'solver':<6} {'ms/step':>8} {'pre.step ms':>12} {'B/update':>10} {'B/other step':>13}")
    for solver in args.solvers:
        for how in ("ddp", "fsdp2"):
            row = run(how, solver, args)
            if dist.get_rank() == 0:
                print(
                    f"{how:<8} {solver:<6} {row['step_ms']:>8.2f} {row['pre_ms']:>12.2f} "
                    f"{row['update_bytes']:>10.0f} {row['between_bytes']:>13.0f}"
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
