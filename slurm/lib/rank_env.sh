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
exec "$@"
