#!/usr/bin/env bash
# The 3c1f CNN on Fashion-MNIST with the HyLo paper's hyperparameters, on this node or on all the nodes of a cluster:
#   DATA_DIR=/data/fashion-mnist bash scripts/train-3c1f-fashion-mnist.sh             # this node, NPROC = its GPUs
#   DATA_DIR=/data/fashion-mnist NODEFILE=hosts PRELOAD='. venv/bin/activate' bash scripts/train-3c1f-fashion-mnist.sh
#   sbatch -N 4 --gres=gpu:4 --wrap 'DATA_DIR=/data/fashion-mnist bash scripts/train-3c1f-fashion-mnist.sh'
#   DATA_DIR=/data/fashion-mnist DRY_RUN=1 bash scripts/train-3c1f-fashion-mnist.sh --solver kfac   # print, run nothing
# DATA_DIR (required): the folder of the four Fashion-MNIST IDX files (train-images-idx3-ubyte etc., raw or .gz).
# Defaults (below) that the environment overrides: LOG_DIR, SOLVER, BATCH_PER_GPU, EPOCHS, WARMUP_EPOCHS, LR,
# LR_SCHEDULE, LR_DECAY, MILESTONES, WEIGHT_DECAY, DAMPING, TARGET_DAMPING, DAMPING_DECAY_EPOCHS, FREQ, ADAPTIVE,
# CHECKPOINT_FREQ, COMPRESSION_RATIO; an empty value leaves its flag out (train.py's default applies). BATCH_PER_GPU is
# HyLo's per-GPU batch: --batch-size, the global batch, is BATCH_PER_GPU x NNODES x NPROC. Arguments given to this
# script are appended to train.py's (of a repeated flag, the last wins). Nodes (NODEFILE, Slurm, NNODES,
# NODE_RANK, MASTER), NPROC, PRELOAD, DRY_RUN: see scripts/launch_common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=launch_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
hylo_require_data_dir "the folder of the four Fashion-MNIST IDX files (train-images-idx3-ubyte etc., raw or .gz)"
hylo_setup
BATCH_PER_GPU="${BATCH_PER_GPU:-128}"
hylo_positive BATCH_PER_GPU
hylo_arg --data-dir "$DATA_DIR"
hylo_arg --log-dir "${LOG_DIR-runs/3c1f-fashion-mnist}"
hylo_arg --dataset fashion-mnist
hylo_arg --model 3c1f
hylo_arg --solver "${SOLVER-hybrid}"
hylo_arg --batch-size "$((BATCH_PER_GPU * NNODES * NPROC))"
hylo_arg --epochs "${EPOCHS-10}"
hylo_arg --warmup-epochs "${WARMUP_EPOCHS-0}"
hylo_arg --lr "${LR-0.003}"
hylo_arg --lr-schedule "${LR_SCHEDULE-step}"
hylo_arg --lr-decay "${LR_DECAY-0.1}"
hylo_list_arg --milestone "${MILESTONES-30 45}"
hylo_arg --weight-decay "${WEIGHT_DECAY-0.001}"
hylo_arg --damping "${DAMPING-0.3}"
hylo_arg --target-damping "${TARGET_DAMPING-0.3}"
hylo_arg --damping-decay-epochs "${DAMPING_DECAY_EPOCHS-10}"
hylo_arg --freq "${FREQ-100}"
hylo_list_arg --adaptive "${ADAPTIVE-0 10 10}"
hylo_arg --checkpoint-freq "${CHECKPOINT_FREQ-10}"
hylo_arg --compression-ratio "${COMPRESSION_RATIO-1}"
hylo_launch "$HYLO_DIR/train.py" "${HYLO_ARGS[@]}" "$@"
