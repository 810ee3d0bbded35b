#!/usr/bin/env bash
# The libtorch example's step time at world 2 next to Python's DDP on the same model, data, batches
# and threads (one torch thread per rank, two ranks on this host), A B A B: each round runs every
# contender once, in turn; the table gives each one's median step per round and the median over
# rounds, and the ratio to Python DDP + AdamW. Results: bench/RESULTS.md, "libtorch client".
#
#   bench/bench_libtorch.sh [BUILD_DIR] [ROUNDS] [STEPS]
set -euo pipefail
build=${1:-build}
rounds=${2:-5}
steps=${3:-300}
here=$(cd "$(dirname "$0")" && pwd)
data=$build/data/digits.safetensors
run=("$build/bin/shardflow" run --nproc_per_node 2 --)
exe=$build/examples/torch_digits
[ -x "$exe" ] || { echo "bench_libtorch: $exe not built (libtorch-dev missing?)" >&2; exit 1; }
/usr/bin/python3 -c "import torch" 2>/dev/null || { echo "bench_libtorch: python3-torch is not installed (apt-get install python3-torch)" >&2; exit 1; }

declare -A cmd
cmd[python_ddp]="/usr/bin/python3 $here/peers/torch_ddp_digits.py $data --steps $steps"
cmd[python_ddp_zero]="/usr/bin/python3 $here/peers/torch_ddp_digits.py $data --steps $steps --zero"
cmd[sf_ddp_torch_optim_gloo]="${run[*]} $exe --steps $steps --zero-stage 0 --own-optimizer --backend gloo"
cmd[sf_zero2_gloo]="${run[*]} $exe --steps $steps --zero-stage 2 --backend gloo"
cmd[sf_zero1_gloo]="${run[*]} $exe --steps $steps --zero-stage 1 --backend gloo"
cmd[sf_zero2_shm]="${run[*]} $exe --steps $steps --zero-stage 2 --backend shm"
cmd[sf_zero1_shm]="${run[*]} $exe --steps $steps --zero-stage 1 --backend shm"
order=(python_ddp sf_ddp_torch_optim_gloo sf_zero1_gloo sf_zero2_gloo sf_zero1_shm sf_zero2_shm python_ddp_zero)

declare -A all
for ((r = 1; r <= rounds; r++)); do
  for name in "${order[@]}"; do
    ms=$(${cmd[$name]} 2>/dev/null | grep -o 'median step [0-9.]*' | awk '{print $3}')
    all[$name]="${all[$name]:-} $ms"
  done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR] = $1} END {print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }
base=$(echo "${all[python_ddp]}" | median)
printf "%-26s %-40s %9s %9s\n" contender "median step per round (ms)" median "vs python_ddp"
for name in "${order[@]}"; do
  m=$(echo "${all[$name]}" | median)
  printf "%-26s %-40s %9.3f %9.2fx\n" "$name" "${all[$name]}" "$m" "$(echo "$m / $base" | bc -l)"
done
