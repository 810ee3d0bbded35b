#!/bin/sh
# Packs what a GPU machine without Debian's packages needs into .gpu/ (git-ignored), for the
# `device` tool to carry: libshardflow installed (headers, CMake package, launcher), the Debian
# libraries it and the CUDA test binaries load (CAF, Gloo, spdlog, OpenBLAS, ...; not glibc,
# libstdc++, CUDA or NCCL, which the machine has), CLI11's headers, the CUDA suites, mlp_train with
# its GPU module, bench_optim_cuda and the fortunes corpus. scripts/gpu/run.sh uses it there.
# OLD_BUILD, another tree's build (its targets shardflow and shardflow_cli at least), is installed
# beside it in .gpu/old/ for run.sh's `ab` step: both libraries' GPT steps alternated on one GPU.
#   scripts/gpu/pack.sh [BUILD_DIR [OLD_BUILD]]   (default build/; built with CUDA, `make build`)
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
build=${1:-build}
rm -rf .gpu
mkdir -p .gpu/lib .gpu/bin .gpu/include .gpu/data
cmake --install "$build" --prefix .gpu/prefix >/dev/null
rm -rf .gpu/prefix/lib/python3*  # the module is built there, for that machine's Python and torch
if [ -n "${2:-}" ]; then
  cmake --install "$2" --prefix .gpu/old/prefix >/dev/null
  rm -rf .gpu/old/prefix/lib/python3*
fi
bins="$build/tests/test_cuda $build/tests/test_cuda_comm $build/examples/mlp_train $build/examples/libshardflow_mlp_cuda.so $build/bench/bench_optim_cuda"
cp $bins .gpu/bin/
for f in .gpu/prefix/lib/libshardflow.so $bins; do ldd "$f"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u |
  grep -v -E '/(libc|libm|libstdc\+\+|libgcc_s|libpthread|libdl|librt)\.so|cuda|nccl|cublas|libshardflow' |
  while read -r lib; do cp -L "$lib" .gpu/lib/; done
tar -C .gpu -cJf .gpu/lib.tar.xz lib  # OpenBLAS alone is 36 MB; the carry limit is 64 MiB
rm -rf .gpu/lib
cp -r /usr/include/CLI .gpu/include/
cp "$build/data/fortunes.safetensors" .gpu/data/
du -sh .gpu
