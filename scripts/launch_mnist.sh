#!/usr/bin/env bash
# Launch scripts/train.py with torchrun: one node by default, several with NNODES/NODE_RANK/MASTER.
#   bash scripts/launch_mnist.sh                        # 2 CPU processes (gloo) on this machine
#   NPROC=4 bash scripts/launch_mnist.sh --solver kid   # extra arguments go to train.py
#   NNODES=2 NODE_RANK=0 MASTER=node0:29500 NPROC=4 bash scripts/launch_mnist.sh   # on each node
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nproc="${NPROC:-2}"
nnodes="${NNODES:-1}"
if [ "$nnodes" = 1 ]; then
  exec torchrun --standalone --nproc_per_node="$nproc" "$here/train.py" "$@"
fi
exec torchrun --nnodes="$nnodes" --node_rank="${NODE_RANK:?set NODE_RANK}" --nproc_per_node="$nproc" \
  --rdzv_backend=c10d --rdzv_endpoint="${MASTER:?set MASTER=host:port}" "$here/train.py" "$@"
