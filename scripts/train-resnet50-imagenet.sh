#!/usr/bin/env bash
# ResNet-50 on ImageNet with the HyLo paper's hyperparameters, on this node or on all the nodes of a cluster:
#   DATA_DIR=/data/imagenet bash scripts/train-resnet50-imagenet.sh             # this node, NPROC = its GPUs
#   DATA_DIR=/data/imagenet NODEFILE=hosts PRELOAD='. venv/bin/activate' bash scripts/train-resnet50-imagenet.sh
#   sbatch -N 4 --gres=gpu:4 --wrap 'DATA_DIR=/data/imagenet bash scripts/train-resnet50-imagenet.sh'
#   DATA_DIR=/data/imagenet DRY_RUN=1 bash scripts/train-resnet50-imagenet.sh --solver kfac   # print, run nothing
# DATA_DIR (required): the ImageNet folder of train/<class>/*.JPEG and val/<class>/*.JPEG.
# Defaults (below) that the environment overrides: LOG_DIR, SOLVER, BATCH_PER_GPU, EPOCHS, WARMUP_EPOCHS, LR,
# LR_SCHEDULE, LR_DECAY, MILESTONES, WEIGHT_DECAY, DAMPING, TARGET_DAMPING, DAMPING_DECAY_EPOCHS, FREQ, ADAPTIVE,
# CHECKPOINT_FREQ, LABEL_SMOOTHING; an empty value leaves its flag out (train.py's default applies). BATCH_PER_GPU is
# HyLo's per-GPU batch: --batch-size, the global batch, is BATCH_PER_GPU x NNODES x NPROC. Arguments given to this
# script are appended to train.py's (of a repeated flag, the last wins). Nodes (NODEFILE, Slurm, NNODES,
# NODE_RANK, MASTER), NPROC, PRELOAD, DRY_RUN: see scripts/launch_common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=launch_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
hylo_require_data_dir "the ImageNet folder of train/<class>/*.JPEG and val/<class>/*.JPEG"
hylo_setup
BATCH_PER_GPU="${BATCH_PER_GPU:-80}"
hylo_positive BATCH_PER_GPU
hylo_arg --data-dir "$DATA_DIR"
hylo_arg --log-dir "${LOG_DIR-runs/resnet50-imagenet}"
hylo_arg --dataset imagenet
hylo_arg --model resnet50
hylo_arg --solver "${SOLVER-hybrid}"
hylo_arg --batch-size "$((BATCH_PER_GPU * NNODES * NPROC))"
hylo_arg --epochs "${EPOCHS-55}"
hylo_arg --warmup-epochs "${WARMUP_EPOCHS-5}"
hylo_arg --lr "${LR-4}"
hylo_arg --lr-schedule "${LR_SCHEDULE-step}"
hylo_arg --lr-decay "${LR_DECAY-0.1}"
hylo_list_arg --milestone "${MILESTONES-25 35 40 45 50}"
hylo_arg --weight-decay "${WEIGHT_DECAY-0.000025}"
hylo_arg --damping "${DAMPING-4}"
hylo_arg --target-damping "${TARGET_DAMPING-0.04}"
hylo_arg --damping-decay-epochs "${DAMPING_DECAY_EPOCHS-50}"
hylo_arg --freq "${FREQ-200}"
hylo_list_arg --adaptive "${ADAPTIVE-10 35 40}"
hylo_arg --checkpoint-freq "${CHECKPOINT_FREQ-5}"
hylo_arg --label-smoothing "${LABEL_SMOOTHING-0.1}"
hylo_launch "$HYLO_DIR/train.py" "${HYLO_ARGS[@]}" "$@"
