"""Bytes moved per update, per layer and in total: K-FAC against the low-rank path (KID / KIS).

Analytic counts from the layer shapes of ResNet-32 (CIFAR-10) and ResNet-50 (ImageNet) for
P = 1…64 ranks, and, with ``--measure``, the same counts measured on gloo with real
preconditioners at small P (``--measure-ranks``), compared layer by layer.

Metric: payload bytes that all ranks put into collectives during one update step, with
``strategy="inverse"`` (float32; n local rows, r = max(1, ⌊ρ·n⌋), m = P·r):

- KID:   P·(r·(d_a + d_g) + r² + 2)·4 + m²·4   (all-gather of skeleton rows, W_p, [n, r]; broadcast of M)
- KIS:   P·(r·(d_a + d_g) + 2)·4 + m²·4        (all-gather of sampled rows, [n, r]; broadcast of M)
- K-FAC: P·(d_a² + d_g²)·4 + (d_a² + d_a + d_g² + d_g)·4   (all-reduce of A, G; broadcast of eigenbases)

Second metric, ``recv/rank``: bytes each rank receives with the usual ring algorithms
(all-gather: (P−1)·s of the others' payloads s; all-reduce: 2(P−1)/P·S; broadcast: S on the
P−1 non-source ranks, averaged over ranks). This is the volume that grows with P on the
low-rank path (every rank receives all P·r rows) and stays ~3·(d_a² + d_g²) for K-FAC.

With one rank nothing is sent. ``--device cuda`` measures on NCCL instead, rank r on ``cuda:r``
(refused when the machine has fewer GPUs than ``--measure-ranks``' largest P); the analytic counts
have no device. Example:
    python scripts/bench_comm.py --ranks 1 2 4 8 16 32 64 --local-batch 32 --rank-ratio 0.1 --measure
"""

from __future__ import annotations

import argparse
import math
import socket
import warnings
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hylo
from hylo_scripts.benchmarks import flags
from hylo_scripts.benchmarks.devices import backend, describe, rank_device, ranks_problem
from hylo_scripts.models.registry import MODELS, build_model, model_names
from hylo_scripts.training.engine import write_rows

FLOAT_BYTES = 4


def layer_shapes(model_name: str) -> list[tuple[str, int, int]]:
    """(name, d_a, d_g) of every layer hylo registers in the model."""
    with warnings.catch_warnings():  # BatchNorm layers are left alone, as expected here
        warnings.filterwarnings("ignore", message="hylo leaves")
        pre = hylo.HyLoPreconditioner(build_model(model_name))
    shapes = [(info.name, info.d_a, info.d_g) for info in pre.layer_info()]
    pre.remove()
    return shapes


def analytic_bytes(solver: str, d_a: int, d_g: int, world: int, local_batch: int, rank_ratio: float) -> int:
    """Payload bytes of one layer's update over all ranks (see module docstring)."""
    if world == 1:
        return 0
    if solver == "kfac":
        return FLOAT_BYTES * (world * (d_a**2 + d_g**2) + d_a**2 + d_a + d_g**2 + d_g)
    r = max(1, math.floor(rank_ratio * local_batch))
    m = world * r
    per_rank = r * (d_a + d_g) + 2 + (r * r if solver == "kid" else 0)
    return FLOAT_BYTES * (world * per_rank + m * m)


def received_bytes_per_rank(solver: str, d_a: int, d_g: int, world: int, local_batch: int, rank_ratio: float) -> float:
    """Bytes one rank receives for one layer's update with ring collectives (see module docstring)."""
    if world == 1:
        return 0.0
    share = (world - 1) / world
    if solver == "kfac":
        return FLOAT_BYTES * (2 * share * (d_a**2 + d_g**2) + share * (d_a**2 + d_a + d_g**2 + d_g))
    r = max(1, math.floor(rank_ratio * local_batch))
    per_rank = r * (d_a + d_g) + 2 + (r * r if solver == "kid" else 0)
    return FLOAT_BYTES * ((world - 1) * per_rank + share * (world * r) ** 2)


def _measure_worker(
    rank: int,
    world: int,
    port: int,
    model_name: str,
    solver: str,
    local_batch: int,
    rank_ratio: float,
    queue: Any,
    device: torch.device,
) -> None:
    torch.set_num_threads(1)
    mine = rank_device(device, rank)
    if mine.type == "cuda":
        torch.cuda.set_device(mine)
    dist.init_process_group(
        backend(device),
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=600),
    )
    try:
        spec = MODELS[model_name]
        # the bytes do not depend on the image side: at most 32 keeps ResNet-50 cheap
        side = min(32, spec.input_shape[-1])
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            build_model(model_name, spec.shape(side)).to(mine), device_ids=[mine.index] if mine.type == "cuda" else None
        )
        with warnings.catch_warnings():  # BatchNorm layers are left alone, as expected here
            warnings.filterwarnings("ignore", message="hylo leaves")
            pre = hylo.HyLoPreconditioner(model, solver=solver, update_freq=1, rank_ratio=rank_ratio)
        torch.manual_seed(rank + 1)
        x, y = (t.to(mine) for t in spec.random_batch(local_batch, side=side))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        pre.step()
        queue.put((rank, dict(pre.comm.bytes_by_tag)))
    finally:
        dist.destroy_process_group()


def measure(
    model_name: str,
    solver: str,
    world: int,
    local_batch: int,
    rank_ratio: float,
    device: torch.device | None = None,
) -> dict[str, int]:
    """Tagged bytes per layer summed over ranks, from one real update on ``world`` processes: gloo on CPU,
    NCCL with rank r on ``cuda:r`` when ``device`` (default CPU) is CUDA (see :func:`hylo_scripts.benchmarks.devices.ranks_problem`)."""
    device = device or torch.device("cpu")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=_measure_worker,
            args=(r, world, port, model_name, solver, local_batch, rank_ratio, queue, device),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    totals: dict[str, int] = {}
    for _ in range(world):
        _, counts = queue.get(timeout=1800)
        for name, nbytes in counts.items():
            totals[name] = totals.get(name, 0) + nbytes
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"measurement worker exited with {p.exitcode}")
    return totals


def main(argv: Sequence[str] | None = None) -> None:
    """Print the analytic table (and measured checks), optionally write CSVs."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["resnet32", "resnet50"], choices=model_names())
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--local-batch", type=int, default=32)
    parser.add_argument("--rank-ratio", type=float, default=0.1)
    parser.add_argument(
        "--measure", action="store_true", help="check the counts on gloo (NCCL on CUDA) at --measure-ranks"
    )
    parser.add_argument("--measure-ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--measure-solvers", nargs="+", default=["kid", "kis", "kfac"])
    parser.add_argument("--out", default=None, help="CSV of per-layer analytic bytes")
    flags.add_device(parser, "where --measure runs: cpu (gloo) or cuda (NCCL, one GPU per rank; default: cuda if any)")
    args = parser.parse_args(argv)
    problem = ranks_problem(args.device, max(args.measure_ranks)) if args.measure else None
    if problem is not None:
        parser.error(problem)

    rows = []
    print("payload = bytes put into collectives by all ranks; recv/rank = bytes one rank receives (ring)")
    print(
        f"{'model':<9} {'P':>3} {'kfac MB':>10} {'kid MB':>9} {'kis MB':>9} {'kfac/kid':>9} {'kfac/kis':>9}"
        f" {'kfac recv/rank MB':>18} {'kid recv/rank MB':>17} {'ratio':>7}"
    )
    for model_name in args.models:
        shapes = layer_shapes(model_name)
        for world in args.ranks:
            totals = {}
            for solver in ("kfac", "kid", "kis"):
                per_layer = [
                    analytic_bytes(solver, d_a, d_g, world, args.local_batch, args.rank_ratio) for _, d_a, d_g in shapes
                ]
                totals[solver] = sum(per_layer)
                rows += [
                    {
                        "model": model_name,
                        "ranks": world,
                        "solver": solver,
                        "layer": name,
                        "d_a": d_a,
                        "d_g": d_g,
                        "bytes": b,
                    }
                    for (name, d_a, d_g), b in zip(shapes, per_layer, strict=True)
                ]
            recv = {
                solver: sum(
                    received_bytes_per_rank(solver, d_a, d_g, world, args.local_batch, args.rank_ratio)
                    for _, d_a, d_g in shapes
                )
                for solver in ("kfac", "kid")
            }

            def ratio(num: float, den: float) -> float:
                return num / den if den else float("nan")

            print(
                f"{model_name:<9} {world:>3} {totals['kfac'] / 2**20:>10.2f} {totals['kid'] / 2**20:>9.2f} "
                f"{totals['kis'] / 2**20:>9.2f} {ratio(totals['kfac'], totals['kid']):>9.1f} "
                f"{ratio(totals['kfac'], totals['kis']):>9.1f} {recv['kfac'] / 2**20:>18.2f} "
                f"{recv['kid'] / 2**20:>17.2f} {ratio(recv['kfac'], recv['kid']):>7.1f}"
            )
    if args.out:
        write_rows(args.out, rows)
        print(f"wrote {args.out}")
    if args.measure:
        print(f"\nmeasured on {backend(args.device)} vs analytic (per-layer bytes summed over ranks)")
        print(f"device: {describe(args.device)}" + (", rank r on cuda:r" if args.device.type == "cuda" else ""))
        for model_name in args.models:
            shapes = layer_shapes(model_name)
            for world in args.measure_ranks:
                for solver in args.measure_solvers:
                    measured = measure(model_name, solver, world, args.local_batch, args.rank_ratio, args.device)
                    expected = {
                        name: analytic_bytes(solver, d_a, d_g, world, args.local_batch, args.rank_ratio)
                        for name, d_a, d_g in shapes
                    }
                    mismatched = [n for n in expected if measured.get(n, 0) != expected[n]]
                    print(
                        f"{model_name:<9} P={world} {solver:<5} measured {sum(measured.values()):>12} B, "
                        f"analytic {sum(expected.values()):>12} B, layers differing: {len(mismatched)}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
