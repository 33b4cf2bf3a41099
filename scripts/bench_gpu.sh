#!/usr/bin/env bash
# The GPU results page (docs/gpu.md): its benchmarks on one CUDA device, each one's output in DIR/NAME.txt.
#
#   bash scripts/bench_gpu.sh runs/gpu                          # all of them, ~8 minutes on an H100
#   bash scripts/bench_gpu.sh runs/gpu overhead-resnet32        # some of them, by name
#
# KAISA's rows need kfac-pytorch importable (pip install from its repository); without it they say so.
# Each benchmark is stopped after its LIMIT seconds (a short GPU lease must hold the whole page): a stopped one's
# file ends with "exit 124" and keeps the rows it printed.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: bench_gpu.sh DIR [NAME ...]}
shift
mkdir -p "$dir"
py=${PYTHON:-python3}
solvers=(hybrid kid kis kfac kfac_adam kaisa sngd)

declare -A LIMIT=([overhead-resnet32]=100 [overhead-lm]=80 [overhead-resnet50]=150 [accuracy-mnist5k]=90 [accuracy-lm]=120)
declare -A COMMAND=(
    [overhead-resnet32]="scripts/bench_overhead.py --device cuda --model resnet32 --batch-size 128 --steps 30 --warmup 5 --update-freq 10 --solvers ${solvers[*]}"
    [overhead-lm]="scripts/bench_overhead.py --device cuda --model transformer --layers 2 --width 128 --image-size 64 --batch-size 32 --optimizer adamw --steps 40 --warmup 10 --solvers kfac kfac_adam hybrid kaisa --set kfac_method=inverse"
    [overhead-resnet50]="scripts/bench_overhead.py --device cuda --model resnet50 --batch-size 64 --autocast bf16 --steps 20 --warmup 2 --update-freq 10 --solvers ${solvers[*]}"
    [accuracy-mnist5k]="scripts/bench_accuracy.py --device cuda --batch-sizes 500 --iterations 120 --solvers hybrid kfac kfac_adam --seeds 0 1"
    [accuracy-lm]="scripts/bench_accuracy.py --device cuda --task lm --solvers hybrid kfac kfac_adam --seeds 0"
)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(overhead-resnet32 overhead-lm overhead-resnet50 accuracy-mnist5k accuracy-lm)
for name in "${names[@]}"; do
    [ -n "${COMMAND[$name]:-}" ] || { echo "bench_gpu.sh: no benchmark named $name" >&2; exit 2; }
    out="$dir/$name.txt"
    echo "\$ python ${COMMAND[$name]}" >"$out"
    # shellcheck disable=SC2086  # the command's words
    PYTHONUNBUFFERED=1 timeout "${LIMIT[$name]}" "$py" ${COMMAND[$name]} >>"$out" 2>&1
    echo "exit $?" >>"$out"
done
