#!/bin/sh
# Jobs started by Open MPI's mpirun (Debian's openmpi-bin), which the README says work and which the
# launch environment reads (OMPI_COMM_WORLD_*): exit 77 (skipped) without mpirun.
#   run_mpirun.sh mlp MLP_TRAIN WORKDIR      mlp_train at world 2 ends bit for bit where the in-process run ends
#   run_mpirun.sh python CHECK_DDP WORKDIR    shardflow.torch's check_ddp.py at world 2 (PYTHONPATH from ctest)
set -eu
command -v mpirun > /dev/null || exit 77
mode=$1 prog=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"
# As root (CI) Open MPI wants to be told; --oversubscribe: 2 ranks on however few cores.
mpi="mpirun --allow-run-as-root --oversubscribe -np 2"
case $mode in
  mlp)
    args="--sizes 16,32,4 --steps 20 --world-size 2 --zero-stage 1 --optimizer adamw --quiet"
    "$prog" $args --save "$dir/in_process.safetensors" > "$dir/in_process.log"
    $mpi "$prog" $args --save "$dir/mpirun.safetensors" > "$dir/mpirun.log"
    cmp "$dir/in_process.safetensors" "$dir/mpirun.safetensors"
    echo "mpirun -np 2 mlp_train: the same bytes as the in-process run" ;;
  python)
    /usr/bin/python3 -c 'import torch' 2> /dev/null || exit 77
    $mpi -x PYTHONPATH /usr/bin/python3 "$prog" "$dir/store" ;;
esac
