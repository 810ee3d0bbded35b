#!/usr/bin/env bash
# Installs the Debian packages shardflow builds against, and only the missing ones, so that
# `make demo` / `make test` work on a fresh Debian 12 machine and cost nothing on a prepared one.
set -euo pipefail

packages=(
  build-essential cmake ninja-build
  libcaf-dev libboost-dev libspdlog-dev doctest-dev libgloo-dev
  nlohmann-json3-dev libopenblas-dev libcli11-dev
  libisal-dev  # CRC-32 of checkpoints (ISA-L: carry-less multiply, 7x zlib)
  python3 python3-matplotlib
  python3-sklearn  # the demo's real data: scikit-learn's handwritten digits, converted at build time
  libtorch-dev     # the libtorch client's example and tests (shardflow/libtorch.hpp; CPU, 1.13)
  pybind11-dev python3-dev  # shardflow.torch, the Python module (runtime/python)
  python3-torch    # its tests, and the cross-checks against PyTorch (1.13, the same libtorch)
  fortunes         # gpt_train's English text (/usr/share/games/fortunes), converted at build time
  etcd-server etcd-client  # the store on etcd (--rdzv-backend etcd): its scenarios start a real cluster
  iproute2  # the two-host test: network namespaces and a veth link
  pkgconf   # the install test builds a consumer with pkg-config
  openmpi-bin  # jobs started by mpirun (tests/run_mpirun.sh)
  slurm-wlm munge  # jobs started by srun on a one-host cluster the test starts (tests/run_srun.sh)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "shardflow: installing missing packages: ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo_cmd=(sudo)
  else
    echo "shardflow: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
