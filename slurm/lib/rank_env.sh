#!/usr/bin/env bash
# One training process per Slurm task (run by srun, once per task): the rank variables
# torch.distributed reads, taken from Slurm's own, then exec the command.
#
#   srun bash slurm/lib/rank_env.sh python -u rtd_scale/pretrain.py ...
#
# RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID (the GPU index on
# the node when each task sees all of its GPUs; a task bound to one GPU uses the one it sees:
# rtd_scale/distributed.py, cuda_device_index). MASTER_ADDR and MASTER_PORT are exported by the
# batch script (the first host of the job and a port derived from the job id). Setting all five
# by hand is what keeps DeepSpeed's MPI discovery from replacing MASTER_ADDR with an address
# from `hostname -I`.
set -euo pipefail

: "${SLURM_PROCID:?not inside a Slurm job step: run through srun}"
: "${MASTER_ADDR:?MASTER_ADDR is not set: the batch script exports it}"
: "${MASTER_PORT:?MASTER_PORT is not set: the batch script exports it}"
export RANK="$SLURM_PROCID"
export WORLD_SIZE="${SLURM_STEP_NUM_TASKS:-$SLURM_NTASKS}"
export LOCAL_RANK="$SLURM_LOCALID"
# Where each rank sits, one line per rank in the job log. The coordinates follow megatron-core's
# rank order (parallel_state.initialize_model_parallel, "tp-cp-ep-dp-pp", PP 1 as the Slurm
# scripts run): consecutive ranks form a TP group, so a TP size that divides the tasks per node
# keeps every TP group inside one node. pretrain_job.sh exports RTD_TP to the step.
tp="${RTD_TP:-1}"
echo "[rank_env] host $(hostname) node ${SLURM_NODEID:-0}: RANK $RANK LOCAL_RANK $LOCAL_RANK" \
  "of WORLD_SIZE $WORLD_SIZE; TP rank $(( RANK % tp )) DP rank $(( RANK / tp )) (TP $tp);" \
  "master $MASTER_ADDR:$MASTER_PORT"
if [ -z "${RTD_RANK_LOG_DIR:-}" ]; then exec "$@"; fi

# With RTD_RANK_LOG_DIR (pretrain_job.sh sets <save>/logs), this shell stays as the rank's
# watcher: the rank's output also goes to rank<RANK>.log there (appended, a header per start),
# and its exit status with the time to rank<RANK>.exit, which rtd_scale/restarts.py reads to
# name the rank that failed first and tell a user error (status 2) from a crash. Slurm signals
# every process of the task (SIGUSR1 to save, SIGTERM at the end): the command handles them,
# this shell and tee only wait (tee ignores them, so a save still has its stdout).
mkdir -p "$RTD_RANK_LOG_DIR"
log="$RTD_RANK_LOG_DIR/rank$RANK.log"
echo "=== $(date '+%F %T') job ${SLURM_JOB_ID:-?} step ${SLURM_STEP_ID:-?} restart" \
  "${RTD_RESTART:-0}: rank $RANK on $(hostname)" >>"$log"
signals=0
trap 'signals=$((signals + 1))' TERM INT HUP USR1 USR2
"$@" > >(trap '' TERM INT HUP USR1 USR2; exec tee -a "$log") 2>&1 &
child=$!
# shellcheck source=slurm/lib/wait.sh
source "$(dirname "${BASH_SOURCE[0]}")/wait.sh"
rc=0
rtd_wait "$child"
printf '%s %s\n' "$rc" "$(date +%s.%N)" >"$RTD_RANK_LOG_DIR/rank$RANK.exit"
exit "$rc"
