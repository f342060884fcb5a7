#!/usr/bin/env bash
# DeBERTaV3-large RTD pretraining: the 160 GB / batch 8192 / 500k-step regime of arXiv 2111.09543.
#
#   sbatch slurm/pretrain_large.sh                 # 8 nodes × 8 GPUs, as the #SBATCH lines say
#   sbatch --nodes=16 slurm/pretrain_large.sh      # command-line options override #SBATCH lines
#
# The preset debertav3-large (rtd_scale/presets.py) holds the recipe: the model, embedding
# sharing, loss weight, masking, optimizer, learning-rate schedule and seed. Print it from the
# checkout:
#   python -c 'from rtd_scale.presets import preset; print(preset("debertav3-large").to_json())'
# The job passes pretrain.py --preset and the regime set below (steps, global batch, micro-batch,
# sequence length; TP), with ZeRO-3 (ds_configs/zero3.json) and bf16 compute; RTD_LR,
# RTD_WARMUP_ITERS and RTD_SEED override the preset only when set. The tokenizer must have the
# preset's vocabulary size (python -m rtd_scale.launch_env check-tokenizer, before training).
# Data: the 160 GB of DeBERTa (Wikipedia, BookCorpus, OpenWebText, CC-News, Stories) tokenized by
# slurm/preprocess.sh into RTD_SHARD_DIR; every *_text_document shard there is used.
#
# Gradient accumulation is derived: accumulation = RTD_GLOBAL_BATCH / (micro-batch ×
# data-parallel size), data-parallel size = tasks / RTD_TP (rtd_scale.batch.batch_layout, which
# pretrain.py and tools/estimate_cost.py use too; `python -m rtd_scale.launch_env
# batch-arithmetic TASKS TP GLOBAL MICRO` prints it). A node count for which that is not an
# integer stops the job with an error naming the node counts that work (with 8 GPUs per node and
# a global batch of 8192: 1, 2, 4, 8, 16 … nodes).
#
# Two phases (optional; BERT's 128-then-512 schedule): RTD_PHASE1_ITERS=450000 trains steps
# 1-450,000 at RTD_PHASE1_SEQ_LENGTH (128) tokens and RTD_PHASE1_GLOBAL_BATCH sequences, then
# the rest at RTD_SEQ_LENGTH and RTD_GLOBAL_BATCH in the same job; the learning-rate schedule
# spans all RTD_TRAIN_ITERS steps, and the optimizer state and step carry over. A requeued job
# resumes in the phase its checkpoint is in.
#
# Preemption: Slurm sends SIGUSR1 to the batch shell 10 minutes before the time limit (Slurm may
# send it up to a minute early); the ranks finish the current step, save a checkpoint to RTD_SAVE
# and exit, and the job requeues itself. A requeued (or resubmitted) job resumes from
# its newest complete checkpoint by itself. Try it by hand: scancel --signal=USR1 --batch JOBID.
# Elastic: a requeued job given fewer nodes (scontrol update JobId=J NumNodes=4-4 NumTasks=32
# NumCPUs=<new total> while it is held, or a new sbatch --nodes=4 with the same RTD_SAVE)
# continues from the same checkpoint at the new data-parallel size (converted at TP 1; the
# global batch must divide).
# Details: slurm/lib/pretrain_job.sh.
#
# Environment (all optional; relative paths are relative to the job's working directory):
#   RTD_PRESET         debertav3-large      model preset (rtd_scale/presets.py)
#   RTD_SHARD_DIR      <repo>/data/shards   where slurm/preprocess.sh wrote the shards
#   RTD_DATA_PATH      (all shards found)   shard prefixes, space-separated (so none may contain a
#                                           space: link it); overrides RTD_SHARD_DIR
#   RTD_TOKENIZER      <repo>/data/spm.model
#   RTD_EXPECT_VOCAB   (the preset's)       tokenizer size required; empty: no check
#   RTD_SAVE           <repo>/runs/<preset> checkpoints, config.json; the same on every requeue
#   RTD_TENSORBOARD_DIR <save>/tensorboard
#   RTD_TRAIN_ITERS    500000               optimizer steps
#   RTD_GLOBAL_BATCH   8192                 sequences per optimizer step
#   RTD_MICRO_BATCH    8                    sequences per GPU per forward
#   RTD_SEQ_LENGTH     512
#   RTD_LR             (the preset's)       peak learning rate (--lr)
#   RTD_WARMUP_ITERS   (the preset's)       warm-up steps (--lr-warmup-iters)
#   RTD_PHASE1_ITERS   (unset: one phase)   two phases: steps of phase 1, below RTD_TRAIN_ITERS
#   RTD_PHASE1_SEQ_LENGTH 128               phase 1's sequence length
#   RTD_PHASE1_GLOBAL_BATCH <global batch>  phase 1's sequences per step
#   RTD_PHASE1_MICRO_BATCH  <micro-batch>   phase 1's sequences per GPU per forward
#   RTD_TP             1                    tensor-parallel size; divides the tasks per node
#   RTD_SAVE_INTERVAL  1000                 steps between checkpoints (and one on preemption)
#   RTD_LOG_INTERVAL   10
#   RTD_SEED           (the preset's)       --seed
#   RTD_DEVICE         gpu                  cpu: hide GPUs, gloo (small tests)
#   RTD_BF16           1                    0: fp32
#   RTD_DS_CONFIG      <repo>/ds_configs/zero3.json
#   RTD_EXTRA_ARGS     (none)               more pretrain.py flags, space-separated
#   RTD_MASTER_PORT    10000 + job id mod 20000
#   RTD_LAUNCHER       srun                 srun: one task per rank; torchrun: one per node
#   RTD_MAX_REQUEUES   100                  stop requeueing after this many restarts (0: never)
#   RTD_MAX_RESTARTS   3                    new sruns in one allocation after a crash or a hang
#   RTD_MAX_FAILURES_AT_STEP 3              stop once one iteration failed this often in a row
#   RTD_RESTART_BACKOFF 10                  seconds before the first restart, doubled each time
#   RTD_VENV           <repo>/.venv         activated when present
#   RTD_REPO           (found)              the rtd_scale checkout
# A small test on one CPU node (what tests/e2e/test_slurm.py runs):
#   RTD_PRESET=tiny RTD_DEVICE=cpu RTD_BF16=0 RTD_EXPECT_VOCAB= RTD_TRAIN_ITERS=30 \
#   RTD_GLOBAL_BATCH=16 RTD_MICRO_BATCH=4 RTD_SEQ_LENGTH=64 RTD_WARMUP_ITERS=5 \
#   RTD_DATA_PATH=... RTD_TOKENIZER=... RTD_SAVE=... \
#   sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 slurm/pretrain_large.sh
#
#SBATCH --job-name=rtd-debertav3-large
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail

: "${RTD_PRESET:=debertav3-large}"
: "${RTD_TRAIN_ITERS:=500000}"
: "${RTD_GLOBAL_BATCH:=8192}"
: "${RTD_MICRO_BATCH:=8}"
: "${RTD_SEQ_LENGTH:=512}"

# Slurm runs a copy of this file from its spool directory: find the checkout through the job
# record (the path that was submitted), or from this file when run with bash inside salloc.
_self="${BASH_SOURCE[0]}"
if [ ! -f "$(dirname "$_self")/lib/pretrain_job.sh" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  _self="$(sed -n '/^ *Command=/{s/^ *Command=\([^ ]*\).*/\1/p;q;}' <<<"$(scontrol show job "$SLURM_JOB_ID")")"
fi
RTD_REPO="${RTD_REPO:-$(cd "$(dirname "$_self")/.." && pwd)}"
[ -f "$RTD_REPO/slurm/lib/pretrain_job.sh" ] || {
  echo "error: cannot find the rtd_scale checkout (looked in '$RTD_REPO'); set RTD_REPO" >&2; exit 1; }
# shellcheck source-path=SCRIPTDIR source=lib/pretrain_job.sh
source "$RTD_REPO/slurm/lib/pretrain_job.sh"
rtd_pretrain_main
