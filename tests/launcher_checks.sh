# The checks tests/run_mpirun.sh and tests/run_srun.sh run under their launcher (sourced):
#   launcher_checks "LAUNCHER -n 2 ..." mlp|python PROG DIR
# The launched job has 120 s, under ctest's 180: a launcher that never starts the ranks (a Slurm job
# left queued) then fails with the caller's diagnosis instead of ctest's bare "Timeout".
launcher_checks() {
  local launch=$1 mode=$2 prog=$3 dir=$4 name
  name=${launch%% *}
  case $mode in
    mlp)
      local args="--sizes 16,32,4 --steps 20 --world-size 2 --zero-stage 1 --optimizer adamw --quiet"
      "$prog" $args --save "$dir/in_process.safetensors" > "$dir/in_process.log"
      timeout -k 5 120 $launch "$prog" $args --save "$dir/$name.safetensors" > "$dir/$name.log"
      cmp "$dir/in_process.safetensors" "$dir/$name.safetensors"
      echo "$name mlp_train: the same bytes as the in-process run" ;;
    python)
      /usr/bin/python3 -c 'import torch' 2> /dev/null || exit 77
      timeout -k 5 120 $launch /usr/bin/python3 "$prog" "$dir/store" ;;
  esac
}
