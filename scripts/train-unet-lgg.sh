#!/usr/bin/env bash
# U-Net on the LGG MRI slices with the HyLo paper's hyperparameters, on this node or on all the nodes of a cluster:
#   DATA_DIR=/data/lgg bash scripts/train-unet-lgg.sh             # this node, NPROC = its GPUs
#   DATA_DIR=/data/lgg NODEFILE=hosts PRELOAD='. venv/bin/activate' bash scripts/train-unet-lgg.sh
#   sbatch -N 4 --gres=gpu:4 --wrap 'DATA_DIR=/data/lgg bash scripts/train-unet-lgg.sh'
#   DATA_DIR=/data/lgg DRY_RUN=1 bash scripts/train-unet-lgg.sh --solver kfac   # print, run nothing
# DATA_DIR (required): the LGG set's kaggle_3m folder (or its parent): <case>/<case>_<k>.tif and <case>_<k>_mask.tif.
# Defaults (below) that the environment overrides: LOG_DIR, SOLVER, BATCH_PER_GPU, EPOCHS, WARMUP_EPOCHS, LR,
# LR_SCHEDULE, LR_DECAY, MILESTONES, WEIGHT_DECAY, DAMPING, TARGET_DAMPING, DAMPING_DECAY_EPOCHS, FREQ, ADAPTIVE,
# CHECKPOINT_FREQ; an empty value leaves its flag out (train_segmentation.py's default applies). BATCH_PER_GPU is
# HyLo's per-GPU batch: --batch-size, the global batch, is BATCH_PER_GPU x NNODES x NPROC. Arguments given to this
# script are appended to train_segmentation.py's (of a repeated flag, the last wins). Nodes (NODEFILE, Slurm, NNODES,
# NODE_RANK, MASTER), NPROC, PRELOAD, DRY_RUN: see scripts/launch_common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=launch_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
hylo_require_data_dir "the LGG set's kaggle_3m folder (or its parent): <case>/<case>_<k>.tif and <case>_<k>_mask.tif"
hylo_setup
BATCH_PER_GPU="${BATCH_PER_GPU:-16}"
hylo_positive BATCH_PER_GPU
hylo_arg --data-dir "$DATA_DIR"
hylo_arg --log-dir "${LOG_DIR-runs/unet-lgg}"
hylo_arg --dataset lgg
hylo_arg --model unet
hylo_arg --solver "${SOLVER-hybrid}"
hylo_arg --batch-size "$((BATCH_PER_GPU * NNODES * NPROC))"
hylo_arg --epochs "${EPOCHS-50}"
hylo_arg --warmup-epochs "${WARMUP_EPOCHS-10}"
hylo_arg --lr "${LR-0.0008}"
hylo_arg --lr-schedule "${LR_SCHEDULE-step}"
hylo_arg --lr-decay "${LR_DECAY-1}"
hylo_list_arg --milestone "${MILESTONES-}" # none: the rate stays flat after the warmup
hylo_arg --weight-decay "${WEIGHT_DECAY-0.0001}"
hylo_arg --damping "${DAMPING-0.03}"
hylo_arg --target-damping "${TARGET_DAMPING-0.03}"
hylo_arg --damping-decay-epochs "${DAMPING_DECAY_EPOCHS-100}"
hylo_arg --freq "${FREQ-200}"
hylo_list_arg --adaptive "${ADAPTIVE-10 50 100}"
hylo_arg --checkpoint-freq "${CHECKPOINT_FREQ-10}"
hylo_launch "$HYLO_DIR/train_segmentation.py" "${HYLO_ARGS[@]}" "$@"
