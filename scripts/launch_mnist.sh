#!/usr/bin/env bash
# Launch scripts/train.py with torchrun: one node by default, several with NNODES/NODE_RANK/MASTER.
#   bash scripts/launch_mnist.sh                        # 2 CPU processes (gloo) on this machine
#   NPROC=4 bash scripts/launch_mnist.sh --solver kid   # extra arguments go to train.py
#   NNODES=2 NODE_RANK=0 MASTER=node0:29500 NPROC=4 bash scripts/launch_mnist.sh   # on each node
# NODEFILE=hosts, or a Slurm allocation of several nodes, starts every node from here (ssh / srun);
# DRY_RUN=1 prints the command. See scripts/launch_common.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=launch_common.sh
. "$(dirname "${BASH_SOURCE[0]}")/launch_common.sh"
NPROC="${NPROC:-2}"
hylo_setup
hylo_launch "$HYLO_DIR/train.py" "$@"
