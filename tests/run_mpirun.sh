#!/bin/sh
# Jobs started by Open MPI's mpirun (Debian's openmpi-bin), which docs/launching.md says work and which the
# launch environment reads (OMPI_COMM_WORLD_*): exit 77 (skipped) without mpirun.
#   run_mpirun.sh mlp MLP_TRAIN WORKDIR      mlp_train at world 2 ends bit for bit where the in-process run ends
#   run_mpirun.sh python CHECK_DDP WORKDIR    shardflow.torch's check_ddp.py at world 2 (PYTHONPATH from ctest)
set -eu
command -v mpirun > /dev/null || exit 77
mode=$1 prog=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
# As root (CI) Open MPI wants to be told; --oversubscribe: 2 ranks on however few cores.
mpi="mpirun --allow-run-as-root --oversubscribe -np 2 -x PYTHONPATH"
. "$(dirname "$0")/launcher_checks.sh"
launcher_checks "$mpi" "$mode" "$prog" "$dir"
