#!/bin/bash
# On a GPU machine without Debian's packages (the `device` tool's: a pip torch with CUDA, nvcc,
# CMake), from the repository root, after scripts/gpu/pack.sh filled .gpu/ where the full build
# runs: builds shardflow.torch and gpt_train against the machine's torch (tools/torch_build), then
# checks and measures. Everything it prints goes to $OUT/run.log; JSONs and traces to
# $OUT/results.tar.gz.
#   scripts/gpu/run.sh [all | build | check | bench | bench-fp32 | bench-bf16 | gpt | threads | suites | ab] ...
#   (default: all, in that order; bench is both bench-fp32 and bench-bf16; ab only when named, and
#   it needs pack.sh to have been given an OLD_BUILD: AB_ROUNDS (3) rounds of AB_PRECISIONS ("bf16
#   fp32"), AB_STEPS (25) steps a process, then a torch.profiler trace of this library's bf16 steps
#   unless AB_PROFILE=0)
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT" /tmp/sf/results
exec > >(tee -a "$OUT/run.log") 2>&1
steps=${*:-all}
for w in $steps; do
  case $w in all | build | check | bench | bench-fp32 | bench-bf16 | gpt | threads | suites | ab) ;;
    *) echo "run.sh: unknown step '$w' (all, build, check, bench, bench-fp32, bench-bf16, gpt, threads, suites, ab)"; exit 2 ;;
  esac
done
if [[ " $steps " == *" ab "* ]]; then  # refused before the device time goes into the build
  [ -d .gpu/old/prefix ] || { echo "run.sh: ab needs a second library: scripts/gpu/pack.sh BUILD OLD_BUILD"; exit 2; }
  for prec in ${AB_PRECISIONS:-bf16 fp32}; do
    [[ $prec == bf16 || $prec == fp32 ]] || { echo "run.sh: AB_PRECISIONS: '$prec' is neither bf16 nor fp32"; exit 2; }
  done
  [[ ${AB_ROUNDS:-3} =~ ^[1-9][0-9]*$ && ${AB_STEPS:-25} =~ ^[1-9][0-9]*$ ]] ||
    { echo "run.sh: AB_ROUNDS and AB_STEPS are positive counts (got '${AB_ROUNDS:-}', '${AB_STEPS:-}')"; exit 2; }
  [[ ${AB_PROFILE:-1} == 0 || ${AB_PROFILE:-1} == 1 ]] || { echo "run.sh: AB_PROFILE is 0 or 1 (got '$AB_PROFILE')"; exit 2; }
fi
want() { for w in "$@"; do [[ " $steps " == *" all "* || " $steps " == *" $w "* ]] && return 0; done; return 1; }
stamp() { echo; echo "=== $(date +%T) $*"; }

stamp "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
python3 -c 'import sysconfig, os; i = sysconfig.get_paths()["include"]; print("Python.h:", os.path.exists(os.path.join(i, "Python.h")), i)'
cmake --version | head -1; g++ --version | head -1; nvcc --version | tail -1
tar -C /tmp/sf -xJf .gpu/lib.tar.xz
nccl=$(find /usr/local /opt /usr/lib -name 'libnccl.so.2' 2>/dev/null | head -1)
cudart=$(find /usr/local/cuda*/ /opt -name 'libcudart.so.13' 2>/dev/null | head -1)
echo "libnccl: $nccl  libcudart: $cudart"
export LD_LIBRARY_PATH="$root/.gpu/prefix/lib:/tmp/sf/lib:$(dirname "$nccl"):$(dirname "$cudart"):${LD_LIBRARY_PATH:-}"
export PYTHONPATH="$root/build-torch/python" PYTHONUNBUFFERED=1
sf="$root/.gpu/prefix/bin/shardflow"
data="$root/.gpu/data/fortunes.safetensors"

if want build; then
  stamp "build: tools/torch_build against this torch"
  torch_dir=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch
  pybind=$(python3 -m pybind11 --cmakedir)
  configure() {  # $1: the build folder, $2: the installed prefix it builds against
    timeout 300 cmake -S tools/torch_build -B "$1" -G Ninja -Dshardflow_DIR="$2/lib/cmake/shardflow" -DTorch_DIR="$torch_dir" \
      -Dpybind11_DIR="$pybind" -DPython_EXECUTABLE="$(command -v python3)" -DCLI11_INCLUDE_DIR="$root/.gpu/include" -DSHARDFLOW_TEXT="$data" \
      -DCMAKE_CUDA_ARCHITECTURES=90 2>&1 | grep -v -E '^-- (Looking|Performing|Detecting|Check)' | tail -25
  }
  configure build-torch "$root/.gpu/prefix"
  [ -d .gpu/old/prefix ] && configure build-torch-old "$root/.gpu/old/prefix" >/dev/null
  old_build=
  [ -d .gpu/old/prefix ] && { timeout 400 cmake --build build-torch-old -j 8 >/tmp/sf/build-old.log 2>&1 & old_build=$!; }
  timeout 400 cmake --build build-torch -j 16 2>&1 | grep -E 'error|Error|warning: |Linking' | head -60
  [ -n "$old_build" ] && wait "$old_build"  # a bare wait would wait for the tee above too
  [ -d .gpu/old/prefix ] && { grep -E 'error|Error' /tmp/sf/build-old.log | head -20; ls -la build-torch-old/python/shardflow/_C*; }
  ls -la build-torch/gpt_train build-torch/python/shardflow/ 2>&1
fi

if want check; then
  stamp "check: shardflow.torch on CUDA tensors, alone (ranks as threads on the GPU, world 1)"
  timeout 180 python3 tests/python/check_cuda.py; echo "exit $?"
  stamp "check: the same under shardflow run --nproc-per-node 1 (NCCL)"
  timeout 180 "$sf" run --nproc-per-node 1 -- python3 tests/python/check_cuda.py; echo "exit $?"
fi

if want bench bench-fp32; then
  stamp "bench: GPT-2 small shape, context 256, batch 32: PyTorch + fused AdamW vs shardflow ZeRO-1/2, fp32"
  timeout 240 python3 bench/gpu_gpt.py --data "$data" --out /tmp/sf/results/gpu_gpt_fp32.json --trace /tmp/sf/results/trace_fp32; echo "exit $?"
fi
if want bench bench-bf16; then
  stamp "bench: the same with bf16 autocast (fp32 masters)"
  timeout 200 python3 bench/gpu_gpt.py --data "$data" --bf16 --out /tmp/sf/results/gpu_gpt_bf16.json --profile /tmp/sf/results/profile_bf16; echo "exit $?"
fi

if want gpt; then
  g=build-torch/gpt_train
  shape="--layers 12 --d-model 768 --heads 12 --context 256 --batch 32 --steps 25 --warmup 5 --eval-windows 64 --sample-chars 80 --log-every 5"
  stamp "gpt: gpt_train --device cuda, world 1, the GPT-2 small shape on the corpus's 114 characters"
  timeout 120 $g --device cuda $shape --zero-stage 1 --stats-json /tmp/sf/results/gpt_train_w1.json; echo "exit $?"
  stamp "gpt: PyTorch + fused AdamW on the same model and batches (bench/gpu_gpt.py --vocab 114 --configs torch,zero1)"
  timeout 150 python3 bench/gpu_gpt.py --data "$data" --vocab 114 --configs torch,zero1 --steps 25 --rounds 2 --out /tmp/sf/results/gpu_gpt_vocab114.json; echo "exit $?"
  stamp "gpt: gpt_train --device cuda --dtype bf16, world 1"
  timeout 120 $g --device cuda --dtype bf16 $shape --zero-stage 2; echo "exit $?"
  stamp "gpt: NCCL at world 1 under the launcher"
  timeout 120 "$sf" run --nproc-per-node 1 -- $g --device cuda --layers 6 --d-model 384 --heads 6 --steps 20 --sample-chars 0; echo "exit $?"
fi

if want threads; then
  g=build-torch/gpt_train
  shape="--layers 12 --d-model 768 --heads 12 --context 256 --batch 32 --steps 25 --warmup 5 --eval-windows 64 --sample-chars 0 --log-every 5"
  stamp "threads: two ranks as threads on one GPU, ZeRO-1, traced"
  timeout 150 $g --device cuda --world-size 2 $shape --zero-stage 1 --trace /tmp/sf/results/gpt_train_w2_trace.json; echo "exit $?"
  stamp "threads: the same at ZeRO-2 is refused by name (Note [Ranks as threads on one GPU])"
  timeout 60 $g --device cuda --world-size 2 ${shape/--steps 25/--steps 2} --zero-stage 2; echo "exit $? (1 expected)"
fi

if want suites; then
  stamp "suites: test_cuda, test_cuda_comm (built on the VM)"
  timeout 150 .gpu/bin/test_cuda 2>&1 | tail -4
  timeout 300 .gpu/bin/test_cuda_comm 2>&1 | tail -6
fi

# Processes alternated, old library then this one, each with PyTorch side by side in the same
# process: the ratio to PyTorch per process, and old against new across processes (A B A B).
if [[ " $steps " == *" ab "* ]]; then
  libs="/tmp/sf/lib:$(dirname "$nccl"):$(dirname "$cudart")"
  with_lib() {  # $1: old or new; the rest: a command run against that library and its module
    local pre=.gpu/prefix py=build-torch/python
    [ "$1" = old ] && pre=.gpu/old/prefix py=build-torch-old/python
    LD_LIBRARY_PATH=$root/$pre/lib:$libs PYTHONPATH=$root/$py "${@:2}"
  }
  for b in old new; do
    echo "$b: $(with_lib $b python3 -c 'import shardflow.torch; print(*sorted({l.split()[-1] for l in open("/proc/self/maps") if "libshardflow.so" in l}))')"
  done
  for r in $(seq "${AB_ROUNDS:-3}"); do
    for prec in ${AB_PRECISIONS:-bf16 fp32}; do
      flag=; [ $prec = bf16 ] && flag=--bf16
      for b in old new; do
        stamp "ab: round $r, $prec, the $b library"
        with_lib $b timeout 150 python3 bench/gpu_gpt.py --data "$data" $flag --rounds 1 --steps "${AB_STEPS:-25}" --warmup 5 \
          --out /tmp/sf/results/ab_${prec}_${b}_r$r.json | tail -3
      done
    done
  done
  if [ "${AB_PROFILE:-1}" = 1 ] && ! want bench-bf16; then  # bench-bf16 writes its own profile
    stamp "ab: a torch.profiler trace of this library's bf16 steps"
    timeout 120 python3 bench/gpu_gpt.py --data "$data" --bf16 --rounds 1 --steps 8 --configs torch,zero1 --out /tmp/sf/results/profile_run.json \
      --profile /tmp/sf/results/profile_bf16 | tail -2
  fi
fi

stamp "results"
(cd /tmp/sf/results && for f in $(find . -name '*.json'); do gzip -f "$f"; done; tar czf "$OUT/results.tar.gz" .; ls -laR . | head -40)
