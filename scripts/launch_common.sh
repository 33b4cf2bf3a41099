# shellcheck shell=bash
# Shared by the launchers (scripts/train-*.sh, scripts/launch_mnist.sh): find the nodes, then start torchrun
# on each of them. A launcher sources this file, calls hylo_setup, builds its arguments with hylo_arg /
# hylo_list_arg into HYLO_ARGS and ends with hylo_launch SCRIPT "${HYLO_ARGS[@]}" "$@".
#
# Nodes, first match wins:
#   NODE_RANK set       launch this node only (by hand on every node): NNODES (default 1) nodes,
#                       rendezvous at MASTER=host:port (or MASTER_ADDR, MASTER_PORT);
#   NODEFILE=path       the hosts listed in the file, the first word of each line; blank lines, '#' comments
#                       and repeated hosts (PBS lists a host once per slot) are skipped; started by ssh;
#   Slurm               SLURM_JOB_NODELIST (or SLURM_NODELIST) expanded with `scontrol show hostnames`;
#                       started by srun when SLURM_JOB_ID is set and srun is on PATH, else by ssh;
#   otherwise           this host alone.
# NNODES (default: all the nodes found) takes the first NNODES of them. MASTER_ADDR defaults to the first
# node, MASTER_PORT to 29500 (MASTER=host:port sets both). NPROC, the processes per node, defaults to the
# GPUs `nvidia-smi -L` lists on this host (all nodes are taken to be alike), else 1.
#
# Commands: one node runs `torchrun --standalone`; several run torchrun once per node with a c10d rendezvous
# at MASTER_ADDR:MASTER_PORT (under srun: one task per node, --rdzv_id=$SLURM_JOB_ID). By ssh, every node
# runs "$PRELOAD cd $PWD && torchrun --nnodes=N --node_rank=i ..." in the background; the launcher waits for
# all and exits non-zero if any failed. PRELOAD is shell text run first on each remote node, e.g.
# 'module load cuda; source ~/venv/bin/activate' (a ';' is added when it ends without ';' or '&&'), so that
# torchrun is on PATH there; ssh mode expects the repository and the data at the same paths on every node
# (a shared file system), like srun. RDZV_ID names an ssh launch's rendezvous (default: unique per launch).
# DRY_RUN=1 prints the command(s), one shell-quoted line each, and exits 0 without running anything.
# Under sbatch the script is copied away from the repository; submit `sbatch --wrap 'bash scripts/...sh'`.

# shellcheck disable=SC2034  # HYLO_DIR: the launchers' folder, for the launchers that source this file
HYLO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HYLO_ARGS=()
HYLO_NODES=()
HYLO_PIDS=()

hylo_die() {
  printf '%s: %s\n' "${0##*/}" "$*" >&2
  exit 1
}

# Quote each argument for a POSIX shell (single quotes unless it is made of safe characters), space-separated.
hylo_quote() {
  local arg q="'" out=()
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
      out+=("$arg")
    else
      out+=("'${arg//$q/$q\\$q$q}'")
    fi
  done
  local IFS=' '
  printf '%s' "${out[*]}"
}

hylo_positive() { # NAME: the variable must hold a positive integer
  [[ ${!1} =~ ^[1-9][0-9]*$ ]] || hylo_die "$1 must be a positive integer, got '${!1}'"
}

# The GPUs nvidia-smi lists on this host, 1 without nvidia-smi or GPUs.
hylo_gpus() {
  local n=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    n="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')" || true
  fi
  if ((n > 0)); then echo "$n"; else echo 1; fi
}

# HYLO_NODES and HYLO_SOURCE (nodefile, slurm or local) from NODEFILE, Slurm or this host.
hylo_discover() {
  local list="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
  if [ -n "${NODEFILE:-}" ]; then
    if ! [ -f "$NODEFILE" ] || ! [ -r "$NODEFILE" ]; then hylo_die "NODEFILE=$NODEFILE is not a readable file"; fi
    local line host rest
    local -A seen=()
    while IFS= read -r line || [ -n "$line" ]; do
      read -r host rest <<<"${line%%#*}"
      if [ -n "$host" ] && [ -z "${seen[$host]:-}" ]; then
        seen[$host]=1
        HYLO_NODES+=("$host")
      fi
    done <"$NODEFILE"
    ((${#HYLO_NODES[@]} > 0)) || hylo_die "NODEFILE=$NODEFILE lists no host"
    HYLO_SOURCE=nodefile
  elif [ -n "$list" ]; then
    command -v scontrol >/dev/null 2>&1 || hylo_die "scontrol not found: cannot expand the Slurm node list '$list'"
    local hosts
    hosts="$(scontrol show hostnames "$list")" || hylo_die "scontrol show hostnames '$list' failed"
    mapfile -t HYLO_NODES <<<"$hosts"
    [ -n "${HYLO_NODES[0]}" ] || hylo_die "scontrol expanded '$list' to no host"
    HYLO_SOURCE=slurm
  else
    HYLO_NODES=("${HOSTNAME:-localhost}")
    HYLO_SOURCE=local
  fi
}

# Decide how to launch: HYLO_MODE (local, manual, slurm or ssh), HYLO_NODES (HYLO_FOUND found), NNODES, NPROC,
# MASTER_ADDR, MASTER_PORT.
hylo_setup() {
  if [ -n "${NODE_RANK:-}" ]; then
    NNODES="${NNODES:-1}"
    hylo_positive NNODES
    if ! [[ $NODE_RANK =~ ^(0|[1-9][0-9]*)$ ]] || ((NODE_RANK >= NNODES)); then
      hylo_die "NODE_RANK must be an integer in 0..$((NNODES - 1)), got '$NODE_RANK'"
    fi
    if ((NNODES == 1)); then HYLO_MODE=local; else HYLO_MODE=manual; fi
  else
    hylo_discover
    HYLO_FOUND=${#HYLO_NODES[@]}
    NNODES="${NNODES:-$HYLO_FOUND}"
    hylo_positive NNODES
    if ((NNODES > HYLO_FOUND)); then
      hylo_die "NNODES=$NNODES but $HYLO_FOUND node(s) found: list them in NODEFILE, run under Slurm," \
        "or launch each node by hand with NODE_RANK and MASTER"
    fi
    HYLO_NODES=("${HYLO_NODES[@]:0:NNODES}")
    if ((NNODES == 1)); then
      HYLO_MODE=local
    elif [ "$HYLO_SOURCE" = slurm ] && [ -n "${SLURM_JOB_ID:-}" ] && command -v srun >/dev/null 2>&1; then
      HYLO_MODE=slurm
    else
      HYLO_MODE=ssh
    fi
  fi
  NPROC="${NPROC:-$(hylo_gpus)}"
  hylo_positive NPROC
  if [ -n "${MASTER:-}" ]; then
    [[ $MASTER == ?*:?* ]] || hylo_die "MASTER must be host:port, got '$MASTER'"
    MASTER_ADDR="${MASTER%:*}"
    MASTER_PORT="${MASTER##*:}"
  fi
  MASTER_ADDR="${MASTER_ADDR:-${HYLO_NODES[0]:-}}"
  MASTER_PORT="${MASTER_PORT:-29500}"
  if [ "$HYLO_MODE" = manual ] && [ -z "$MASTER_ADDR" ]; then
    hylo_die "NODE_RANK=$NODE_RANK with NNODES=$NNODES needs MASTER=host:port (node 0's address)"
  fi
}

hylo_arg() { # FLAG VALUE: append FLAG VALUE to HYLO_ARGS; an empty VALUE leaves the flag out (the script's default)
  if [ -n "$2" ]; then HYLO_ARGS+=("$1" "$2"); fi
}

hylo_list_arg() { # FLAG "V1 V2 ...": append FLAG V1 V2 ...; an empty list leaves the flag out
  local words=()
  read -r -a words <<<"$2"
  if ((${#words[@]} > 0)); then HYLO_ARGS+=("$1" "${words[@]}"); fi
}

hylo_require_data_dir() { # DESCRIPTION: fail unless DATA_DIR is set (DESCRIPTION says what it must hold)
  [ -n "${DATA_DIR:-}" ] || hylo_die "DATA_DIR is not set: point it at $1 (DATA_DIR=/path bash $0)"
}

hylo_dry_run() {
  [ -n "${DRY_RUN:-}" ] && [ "$DRY_RUN" != 0 ]
}

hylo_exec() { # COMMAND...: print it (DRY_RUN: print only), else replace this shell by it
  if hylo_dry_run; then
    hylo_quote "$@"
    echo
    exit 0
  fi
  echo "+ $(hylo_quote "$@")" >&2
  exec "$@"
}

# ssh to every node, run its torchrun in the background, wait for all; exit with the first failure's status.
hylo_ssh() {
  local preload="${PRELOAD:-}" rdzv_id="${RDZV_ID:-hylo-${HOSTNAME:-host}-$$}" i node remote status=0 code
  preload="${preload%"${preload##*[![:space:]]}"}"
  case $preload in
  '' | *';' | *'&&') ;;
  *) preload+=';' ;;
  esac
  local cd_part
  cd_part="cd $(hylo_quote "$PWD")"
  trap 'if ((${#HYLO_PIDS[@]})); then kill "${HYLO_PIDS[@]}" 2>/dev/null || true; fi; exit 130' INT TERM
  for i in "${!HYLO_NODES[@]}"; do
    node="${HYLO_NODES[$i]}"
    remote="${preload:+$preload }$cd_part && $(hylo_quote torchrun --nnodes="$NNODES" --node_rank="$i" \
      --nproc_per_node="$NPROC" --rdzv_id="$rdzv_id" --rdzv_backend=c10d \
      --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" "$@")"
    if hylo_dry_run; then
      hylo_quote ssh "$node" "$remote"
      echo
    else
      echo "+ $(hylo_quote ssh "$node" "$remote")" >&2
      # shellcheck disable=SC2029  # $remote is built (and quoted) here to run there
      ssh "$node" "$remote" </dev/null &
      HYLO_PIDS+=("$!")
    fi
  done
  for i in "${!HYLO_PIDS[@]}"; do
    code=0
    wait "${HYLO_PIDS[$i]}" || code=$?
    if ((code != 0)); then
      echo "${0##*/}: node ${HYLO_NODES[$i]} (node_rank $i) failed with exit status $code" >&2
      if ((status == 0)); then status=$code; fi
    fi
  done
  exit "$status"
}

hylo_launch() { # SCRIPT ARGS...: start SCRIPT with ARGS on every node as hylo_setup decided
  local script="$1"
  shift
  case $HYLO_MODE in
  local)
    hylo_exec torchrun --standalone --nproc_per_node="$NPROC" "$script" "$@"
    ;;
  manual)
    hylo_exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC" \
      --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" "$script" "$@"
    ;;
  slurm)
    local subset=()
    if ((NNODES < HYLO_FOUND)); then subset=(--nodelist="$(IFS=,; echo "${HYLO_NODES[*]}")"); fi
    hylo_exec srun --nodes="$NNODES" --ntasks-per-node=1 "${subset[@]}" torchrun --nnodes="$NNODES" \
      --nproc_per_node="$NPROC" --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d \
      --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" "$script" "$@"
    ;;
  ssh)
    hylo_ssh "$script" "$@"
    ;;
  esac
}
