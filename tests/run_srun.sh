#!/bin/bash
# Jobs started by Slurm's srun (Debian's slurm-wlm and munge), which docs/launching.md says work and which
# the launch environment reads (SLURM_PROCID, SLURM_NTASKS, ...). The script starts a private
# one-host cluster in WORKDIR (its own munged socket and key, slurmctld and slurmd on ports of their
# own, state and logs there), runs the job with srun -n 2, and stops the daemons however it ends.
# Exit 77 (skipped) when not root or without Slurm's and munge's programs.
#   run_srun.sh mlp MLP_TRAIN WORKDIR      mlp_train at world 2 ends bit for bit where the in-process run ends
#   run_srun.sh python CHECK_DDP WORKDIR    shardflow.torch's check_ddp.py at world 2 (PYTHONPATH from ctest)
set -euo pipefail
for p in slurmctld slurmd srun sinfo munged; do command -v $p > /dev/null || exit 77; done
[ "$(id -u)" = 0 ] || exit 77
mode=$1 prog=$2 dir=$3
rm -rf "$dir" && mkdir -p "$dir"/{state,spool,log}
pids=()
# On a failure, what Slurm knew: the queue, the node's state and reason, the daemons' last words
# (a CI run once timed out here with nothing to go on).
diagnose() {
  echo "run_srun: failed; Slurm's view (logs in $dir/log):" >&2
  timeout 10 squeue -a -o '%i %T %r' >&2 2> /dev/null || true
  timeout 10 sinfo -N -o '%N %t %E' >&2 2> /dev/null || true
  for f in "$dir"/log/*; do echo "--- $f" >&2; tail -n 15 "$f" >&2; done
}
# The daemons get 5 s to stop, then SIGKILL: a slurmd stuck with a job step's processes must not
# hold the test until ctest's timeout, which would hide the diagnosis above (two local runs on
# 2026-11-28 ended in ctest's bare "Timeout" here; the job itself has 120 s).
cleanup() {
  local rc=$?
  [ $rc = 0 ] || [ $rc = 77 ] || diagnose
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2> /dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null || true; done
  wait 2> /dev/null || true
}
trap cleanup EXIT
dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge.key"
munged --force --foreground --socket="$dir/munge.sock" --key-file="$dir/munge.key" --pid-file="$dir/munged.pid" \
  --log-file="$dir/log/munged.log" --seed-file="$dir/munged.seed" > "$dir/log/munged.out" 2>&1 & pids+=($!)
host=$(hostname -s)
base=$((20000 + RANDOM % 12000))  # below the kernel's ephemeral range (32768-), where outgoing connections take ports
cat > "$dir/slurm.conf" <<CONF
ClusterName=shardflowtest
SlurmctldHost=$host
AuthType=auth/munge
AuthInfo=socket=$dir/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmctldPort=$base
SlurmdPort=$((base + 1))
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmUser=root
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
export SLURM_CONF="$dir/slurm.conf"
sleep 1
slurmctld -D -i > "$dir/log/slurmctld.out" 2>&1 & pids+=($!)
slurmd -D > "$dir/log/slurmd.out" 2>&1 & pids+=($!)
for _ in $(seq 60); do
  sinfo -h -o %t 2> /dev/null | grep -q idle && break
  sleep 0.5
done
sinfo -h -o %t | grep -q idle || { echo "run_srun: the test cluster did not come up (logs in $dir/log)" >&2; exit 1; }
srun="srun -n 2 --overcommit --time=5"
. "$(dirname "$0")/launcher_checks.sh"
launcher_checks "$srun" "$mode" "$prog" "$dir"
