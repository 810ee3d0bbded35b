#!/bin/sh
# Installs the build tree into a scratch prefix and builds an outside project against it, once
# through find_package(shardflow) and once through pkg-config, then runs both at world 2.
#   run.sh BUILD_DIR SCRATCH_DIR
set -eu
build=$1
work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
mkdir -p "$work"
# Runs a step quietly; on failure shows what it printed.
quiet() {
  log=$1
  shift
  "$@" > "$work/$log" 2>&1 || { cat "$work/$log"; echo "run.sh: failed: $*"; exit 1; }
}
quiet install.log cmake --install "$build" --prefix "$work/prefix"
# Only the public headers are installed: an internal one must not leak.
test -f "$work/prefix/include/shardflow/shardflow.hpp"
test ! -e "$work/prefix/include/shardflow/runtime.hpp"
test -f "$work/prefix/lib/cmake/shardflow/shardflowConfig.cmake"
test -f "$work/prefix/lib/cmake/shardflow/shardflowConfigVersion.cmake"
test -x "$work/prefix/bin/shardflow"

# A sanitized build (make sanitize) installs an instrumented library: its consumer must load the
# sanitizer's runtime too.
san=$(sed -n 's/^SHARDFLOW_SANITIZE:STRING=//p' "$build/CMakeCache.txt")
san_flags=${san:+-fsanitize=$san}
quiet configure.log cmake -S "$here" -B "$work/cmake" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS="$san_flags"
quiet build.log cmake --build "$work/cmake"
"$work/cmake/consumer"
# shardflow::actor is defined where CAF is installed (it is, wherever the library was built).
test -x "$work/cmake/actor_consumer"
"$work/cmake/actor_consumer"

if command -v pkg-config > /dev/null; then
  export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig"
  # shellcheck disable=SC2046
  quiet pkg-config.log c++ -std=c++20 -O1 $san_flags "$here/consumer.cpp" $(pkg-config --cflags --libs shardflow) -o "$work/consumer_pc"
  LD_LIBRARY_PATH="$work/prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$work/consumer_pc"
else
  echo "run.sh: no pkg-config here: the .pc file was installed but not tried"
fi

# shardflow.torch, where the build has it: installed at the prefix's lib/python3.X/dist-packages,
# a directory Debian's python3 searches when the prefix is /usr/local (make install's default), it
# imports from the installed tree alone (its _C finds the installed library through its RPATH) and
# trains a step at world 2 under the installed launcher.
pydir=$(sed -n 's/^SHARDFLOW_PYTHON_INSTALL_DIR:STRING=//p' "$build/CMakeCache.txt")
if [ -n "$pydir" ] && [ -d "$build/python/shardflow" ]; then
  test -f "$work/prefix/$pydir/shardflow/torch.py"
  /usr/bin/python3 -c "import sys; assert '/usr/local/$pydir' in sys.path, ('/usr/local/$pydir', sys.path)"
  if /usr/bin/python3 -c 'import torch' 2> /dev/null; then
    cat > "$work/step.py" <<'PY'
import torch
import shardflow.torch as sft
assert sft.__file__.startswith(__import__("os").environ["PREFIX_PY"]), sft.__file__
rank, world = sft.init(timeout=60)
model = sft.DistributedDataParallel(torch.nn.Linear(4, 2), zero_stage=1, optimizer="adamw")
model(torch.randn(8, 4)).square().mean().backward()
model.step()
assert world == 2 and model.optimizer_steps == 1
PY
    PREFIX_PY="$work/prefix/$pydir" PYTHONPATH="$work/prefix/$pydir" quiet python.log "$work/prefix/bin/shardflow" run --nproc-per-node 2 -- /usr/bin/python3 "$work/step.py"
    # tools/torch_build: the module and gpt_train built apart, against the installed library and a
    # torch named by Torch_DIR (docs/cuda.md: how a GPU machine's own torch gets them); here
    # Debian's torch and python3 stand in for that machine's.
    torch_dir=$(sed -n 's/^Torch_DIR:PATH=//p' "$build/CMakeCache.txt")
    # Built without optimization (CMAKE_BUILD_TYPE None): what is checked is that they build and load
    # against the install, and -O3 of the torch headers cost CI a minute (gpt_train alone 90 s).
    quiet torch_build_configure.log cmake -S "$here/../../tools/torch_build" -B "$work/torch_build" -G Ninja -DCMAKE_BUILD_TYPE=None \
      -Dshardflow_DIR="$work/prefix/lib/cmake/shardflow" -DTorch_DIR="$torch_dir" -DPython_EXECUTABLE=/usr/bin/python3
    quiet torch_build.log cmake --build "$work/torch_build"
    test -x "$work/torch_build/gpt_train"
    PREFIX_PY="$work/torch_build/python" PYTHONPATH="$work/torch_build/python" quiet python_torch_build.log \
      "$work/prefix/bin/shardflow" run --nproc-per-node 2 -- /usr/bin/python3 "$work/step.py"
  fi
fi
