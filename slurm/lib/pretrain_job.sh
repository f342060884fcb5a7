# shellcheck shell=bash
# The body of slurm/pretrain_*.sh, sourced after they set their regime's defaults (RTD_* below).
# Runs inside the batch step of an sbatch job (or an salloc shell): checks the batch arithmetic,
# starts one training process per task with srun, and turns a preemption signal into a
# checkpoint, a requeue and, in the requeued job, a resume.
#
# Preemption, step by step:
#   1. Slurm sends SIGUSR1 to this shell ahead of the time limit (#SBATCH --signal=B:USR1@600),
#      or an operator does: scancel --signal=USR1 --batch JOBID.
#   2. The trap forwards it to srun, which forwards it to every task; each rank finishes its
#      current optimizer step, all save a checkpoint to RTD_SAVE, and exit 0
#      (pretrain.py --exit-signal-handler --exit-signal SIGUSR1).
#   3. This shell runs `scontrol requeue $SLURM_JOB_ID`: the job goes back to the queue with the
#      same id and output file (--open-mode=append). Slurm holds a requeued job for about two
#      minutes before it is eligible again (measured on 22.05: EligibleTime = requeue + 121 s).
#   4. The requeued job finds a checkpoint in RTD_SAVE and passes --load, which takes the newest
#      complete one (its completion record matches its files; `latest` is not trusted): training
#      continues at the step after it, with the same samples and masks as an uninterrupted run.
#      A directory holding checkpoints none of which is complete also gets --load, which then
#      stops with one line naming each and why, instead of a fresh start over the old run.
#   A signal sent straight to the tasks (--signal=USR1@N, without B:) also works: the tasks save
#   and exit 0 before the last step, and this shell requeues because the run is not finished.

rtd_die() { echo "error: $*" >&2; exit 1; }
rtd_log() { echo "[rtd-slurm $(date '+%F %T')] $*"; }

# ---------------------------------------------------------------------------------- inputs ----
: "${RTD_REPO:?set RTD_REPO to the rtd_scale checkout}"
: "${RTD_PRESET:?}" "${RTD_TRAIN_ITERS:?}" "${RTD_GLOBAL_BATCH:?}" "${RTD_MICRO_BATCH:?}"
: "${RTD_SEQ_LENGTH:?}" "${RTD_LR:?}" "${RTD_WARMUP_ITERS:?}"
: "${RTD_TP:=1}"
: "${RTD_SAVE:=$RTD_REPO/runs/$RTD_PRESET}"
: "${RTD_TENSORBOARD_DIR:=$RTD_SAVE/tensorboard}"
: "${RTD_SHARD_DIR:=$RTD_REPO/data/shards}"
: "${RTD_DATA_PATH:=}"
: "${RTD_TOKENIZER:=$RTD_REPO/data/spm.model}"
: "${RTD_DS_CONFIG:=$RTD_REPO/ds_configs/zero3.json}"
: "${RTD_SAVE_INTERVAL:=1000}"
: "${RTD_LOG_INTERVAL:=10}"
: "${RTD_SEED:=1234}"
: "${RTD_DEVICE:=gpu}"
: "${RTD_BF16:=1}"
: "${RTD_EXTRA_ARGS:=}"
: "${RTD_MAX_REQUEUES:=100}"
: "${RTD_VENV:=$RTD_REPO/.venv}"
: "${RTD_LAUNCHER:=srun}"
# The tokenizer size the regime needs; empty disables the check (other presets, small tests).
if [[ "$RTD_PRESET" == debertav3-* ]]; then : "${RTD_EXPECT_VOCAB=128100}"; fi
: "${RTD_EXPECT_VOCAB:=}"

rtd_positive_int() {  # NAME VALUE
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || rtd_die "$1=$2: expected a positive integer"
}

rtd_count() {  # NAME VALUE: a whole number, 0 included
  [[ "$2" =~ ^[0-9]+$ ]] || rtd_die "$1=$2: expected a whole number (0 or more)"
}

# ---------------------------------------------------------------------- batch arithmetic ----
# rtd_batch_arithmetic WORLD TP GLOBAL MICRO: prints "DP ACCUMULATION", or exits with an error
# that says which numbers would work. global = micro × accumulation × DP, DP = world / TP.
rtd_batch_arithmetic() {
  local world="$1" tp="$2" global="$3" micro="$4" dp ok="" m
  (( world % tp == 0 )) || rtd_die "$world tasks are not divisible by RTD_TP=$tp" \
    "(tensor-parallel size); launch a multiple of $tp tasks"
  dp=$(( world / tp ))
  if (( global % dp != 0 )); then
    rtd_die "global batch RTD_GLOBAL_BATCH=$global is not divisible by the data-parallel size" \
      "$dp (= $world tasks / TP $tp): no micro-batch and accumulation give exactly $global." \
      "Choose a node count whose task count / TP divides $global (for 8 GPUs per node and" \
      "TP 1: 1, 2, 4, 8, 16 … nodes), or change RTD_GLOBAL_BATCH"
  fi
  if (( (global / dp) % micro != 0 )); then
    for m in 1 2 4 8 16 32 64 128; do
      if (( (global / dp) % m == 0 )); then ok="$ok $m"; fi
    done
    rtd_die "RTD_MICRO_BATCH=$micro does not divide the $(( global / dp )) samples per" \
      "data-parallel rank per step (global $global / DP $dp); micro-batch sizes that do:$ok"
  fi
  echo "$dp $(( global / dp / micro ))"
}

rtd_latest_tag() {  # the checkpoint --load RTD_SAVE takes (the newest complete one), or nothing
  (cd "$RTD_REPO" && python -c 'import sys; from rtd_scale.training.checkpoint import newest_complete; print(newest_complete(sys.argv[1]) or "")' "$RTD_SAVE")
}

rtd_holds_run() {  # true when RTD_SAVE holds an earlier run's checkpoints, complete or not
  compgen -G "$RTD_SAVE/global_step*" >/dev/null || [ -f "$RTD_SAVE/latest" ]
}

rtd_is_final() {  # TAG: true when global_step<N> has N >= RTD_TRAIN_ITERS (training is done)
  [[ "$1" =~ ^global_step([0-9]+)$ ]] && (( BASH_REMATCH[1] >= RTD_TRAIN_ITERS ))
}

# --------------------------------------------------------------------------------- main ----
rtd_pretrain_main() {
  local world tp dp gas master_addr tag_at_start load_args=() data_paths=() srun_pid="" rc=0
  local preempted=0 signals=0 before
  # First thing: a SIGUSR1 before srun starts must not kill this shell (bash's default action).
  # A trapped signal interrupts `wait` (status > 128) while srun keeps running: count signals so
  # the loop below waits again and rc is srun's own status.
  trap 'preempted=1; signals=$((signals + 1)); rtd_log "SIGUSR1: forwarding to the tasks (save, then requeue)"; if [ -n "$srun_pid" ]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi' USR1
  : "${SLURM_JOB_ID:?not inside a Slurm job: submit with sbatch (or run inside salloc)}"
  rtd_positive_int RTD_TRAIN_ITERS "$RTD_TRAIN_ITERS"
  rtd_positive_int RTD_GLOBAL_BATCH "$RTD_GLOBAL_BATCH"
  rtd_positive_int RTD_MICRO_BATCH "$RTD_MICRO_BATCH"
  rtd_positive_int RTD_TP "$RTD_TP"
  rtd_count RTD_MAX_REQUEUES "$RTD_MAX_REQUEUES"  # else `-ge` fails and every stop requeues
  if [ -n "${RTD_MASTER_PORT:-}" ]; then
    if ! [[ "$RTD_MASTER_PORT" =~ ^[1-9][0-9]*$ ]] || (( RTD_MASTER_PORT > 65535 )); then
      rtd_die "RTD_MASTER_PORT=$RTD_MASTER_PORT: expected a TCP port, 1-65535"
    fi
  fi
  case "$RTD_DEVICE" in
    gpu) ;;
    cpu) export CUDA_VISIBLE_DEVICES="" ;;  # torch then sees no GPU: gloo on CPU
    *) rtd_die "RTD_DEVICE=$RTD_DEVICE: expected gpu or cpu" ;;
  esac

  if [ -f "$RTD_VENV/bin/activate" ]; then
    set +u
    # shellcheck disable=SC1091
    source "$RTD_VENV/bin/activate"
    set -u
  fi
  export PYTHONUNBUFFERED=1
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"

  world="${SLURM_NTASKS:?SLURM_NTASKS is not set: give the job --ntasks-per-node}"
  tp="$RTD_TP"
  read -r dp gas <<<"$(rtd_batch_arithmetic "$world" "$tp" "$RTD_GLOBAL_BATCH" "$RTD_MICRO_BATCH")"
  [ -n "$gas" ] || exit 1  # the error is already printed
  # megatron-core puts consecutive ranks in one TP group and Slurm numbers ranks node by node
  # (block distribution): TP groups stay inside a node only when TP divides the tasks per node
  local per_node="${SLURM_TASKS_PER_NODE:-$world}"
  per_node="${per_node%%[(,]*}"
  if [ "${SLURM_JOB_NUM_NODES:-1}" -gt 1 ] && (( per_node % tp != 0 )); then
    rtd_die "RTD_TP=$tp does not divide the $per_node tasks per node: tensor-parallel groups" \
      "would span nodes; use a TP size that divides --ntasks-per-node"
  fi
  export RTD_TP  # slurm/lib/rank_env.sh logs each rank's TP and DP coordinates
  case "$RTD_LAUNCHER" in
    srun|torchrun) ;;
    *) rtd_die "RTD_LAUNCHER=$RTD_LAUNCHER: expected srun (one task per rank) or torchrun (one per node)" ;;
  esac

  if [ -n "$RTD_DATA_PATH" ]; then
    read -r -a data_paths <<<"$RTD_DATA_PATH"
    local entry
    for entry in "${data_paths[@]}"; do  # a weight, or a dataset / shard prefix
      [[ "$entry" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] && continue
      [ -f "$entry.manifest.json" ] || [ -f "$entry.idx" ] || rtd_die "RTD_DATA_PATH: no dataset" \
        "'$entry' (neither $entry.manifest.json nor $entry.idx); entries are separated by spaces," \
        "so a path with a space must be linked to one without (ln -s), or use RTD_SHARD_DIR"
    done
  else
    local found
    # datasets of tools/preprocess_data.py (a manifest each), and single shards (merged, or
    # from Megatron-LM's own preprocessing)
    for found in "$RTD_SHARD_DIR"/*_text_document.manifest.json "$RTD_SHARD_DIR"/*_text_document.idx; do
      [ -e "$found" ] || continue
      found="${found%.manifest.json}"
      data_paths+=("${found%.idx}")
    done
    [ "${#data_paths[@]}" -gt 0 ] || rtd_die "no datasets in RTD_SHARD_DIR=$RTD_SHARD_DIR" \
      "(*_text_document.manifest.json or *_text_document.idx); run slurm/preprocess.sh first or set RTD_DATA_PATH"
  fi
  if [ -n "$RTD_EXPECT_VOCAB" ]; then
    local vocab
    [ -f "$RTD_TOKENIZER" ] || rtd_die "RTD_TOKENIZER=$RTD_TOKENIZER: no such file"
    vocab="$(cd "$RTD_REPO" && python -c 'import sys; from rtd_scale.data.tokenizer import Tokenizer; print(Tokenizer(sys.argv[1]).vocab_size)' "$RTD_TOKENIZER")"
    [ "$vocab" = "$RTD_EXPECT_VOCAB" ] || rtd_die "RTD_TOKENIZER=$RTD_TOKENIZER has $vocab" \
      "pieces; $RTD_PRESET's regime needs $RTD_EXPECT_VOCAB (tools/train_tokenizer.py" \
      "--vocab-size $RTD_EXPECT_VOCAB), or set RTD_EXPECT_VOCAB= to accept it"
  fi

  master_addr="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"  # one host per line
  export MASTER_ADDR="${master_addr%%$'\n'*}"  # the first (no pipe: no SIGPIPE under pipefail)
  export MASTER_PORT="${RTD_MASTER_PORT:-$(( 10000 + SLURM_JOB_ID % 20000 ))}"

  tag_at_start="$(rtd_latest_tag)"
  if rtd_is_final "$tag_at_start"; then
    rtd_log "$RTD_SAVE already holds the final checkpoint ($tag_at_start): nothing to do"
    return 0
  fi
  if [ -n "$tag_at_start" ] || rtd_holds_run; then
    load_args=(--load "$RTD_SAVE")
  fi

  local precision_args=()
  if [ "$RTD_BF16" = 1 ]; then precision_args=(--bf16); fi
  local extra_args=()
  read -r -a extra_args <<<"$RTD_EXTRA_ARGS"
  local cmd=(
    python -u "$RTD_REPO/rtd_scale/pretrain.py"
    --ds_config "$RTD_DS_CONFIG"
    --preset "$RTD_PRESET"
    --data-path "${data_paths[@]}"
    --tokenizer-model "$RTD_TOKENIZER"
    --save "$RTD_SAVE" ${load_args[@]+"${load_args[@]}"}
    --tensorboard-dir "$RTD_TENSORBOARD_DIR"
    --train-iters "$RTD_TRAIN_ITERS"
    --seq-length "$RTD_SEQ_LENGTH"
    --micro-batch-size "$RTD_MICRO_BATCH"
    --global-batch-size "$RTD_GLOBAL_BATCH"
    --tensor-model-parallel-size "$RTD_TP"
    --sharing gdes --rtd-lambda 50 --mask-prob 0.15
    --lr "$RTD_LR" --min-lr 0 --lr-warmup-iters "$RTD_WARMUP_ITERS"
    --lr-decay-iters "$RTD_TRAIN_ITERS"
    --weight-decay 0.01 --clip-grad 1.0
    --set optim.adam_beta1=0.9 --set optim.adam_beta2=0.98 --set optim.adam_eps=1e-6
    ${precision_args[@]+"${precision_args[@]}"}
    --log-interval "$RTD_LOG_INTERVAL" --save-interval "$RTD_SAVE_INTERVAL"
    --seed "$RTD_SEED"
    --exit-signal-handler --exit-signal SIGUSR1
    ${extra_args[@]+"${extra_args[@]}"}
  )

  rtd_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s)" \
    "$SLURM_JOB_NODELIST: $world tasks, master $MASTER_ADDR:$MASTER_PORT, device $RTD_DEVICE"
  rtd_log "batch: micro-batch $RTD_MICRO_BATCH × accumulation $gas × data-parallel $dp" \
    "= global $RTD_GLOBAL_BATCH (TP $tp)"
  if [ -n "$tag_at_start" ]; then
    rtd_log "resuming: the newest complete checkpoint in $RTD_SAVE is $tag_at_start"
  elif rtd_holds_run; then
    rtd_log "warning: $RTD_SAVE holds checkpoints but none is complete; --load says why"
  else
    rtd_log "starting fresh: no checkpoint in $RTD_SAVE"
  fi
  if [ "$RTD_LAUNCHER" = torchrun ]; then
    rtd_log "running: srun ... torchrun ... ${cmd[*]}"
  else
    rtd_log "running: srun ... ${cmd[*]}"
  fi

  if [ "$preempted" = 0 ]; then
    if [ "$RTD_LAUNCHER" = torchrun ]; then
      # Megatron-LM's habit: one torchrun per node, which starts the node's ranks and meets the
      # others at a c10d rendezvous on the first node. torchrun passes SIGUSR1 on to its workers
      # only when told to, and then gives them --shutdown-timeout seconds to save and exit.
      srun --kill-on-bad-exit=1 --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
        --ntasks-per-node=1 torchrun --nnodes="$SLURM_JOB_NUM_NODES" \
        --nproc-per-node="$(( world / SLURM_JOB_NUM_NODES ))" --rdzv-backend=c10d \
        --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
        --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=300 \
        --no-python "${cmd[@]}" &
    else
      srun --kill-on-bad-exit=1 bash "$RTD_REPO/slurm/lib/rank_env.sh" "${cmd[@]}" &
    fi
    srun_pid=$!
    while :; do
      before="$signals"
      set +e
      wait "$srun_pid"
      rc=$?
      set -e
      if [ "$signals" != "$before" ] && [ "$rc" -gt 128 ]; then continue; fi
      break
    done
  fi

  local tag
  tag="$(rtd_latest_tag)"
  if [ "$rc" = 0 ] && rtd_is_final "$tag"; then
    rtd_log "training finished: $RTD_SAVE/$tag"
    return 0
  fi
  # stopped early: by our trap (preempted), or by a signal sent to the tasks directly (exit 0)
  if [ "$preempted" = 1 ] || [ "$rc" = 0 ]; then
    if [ "${SLURM_RESTART_COUNT:-0}" -ge "$RTD_MAX_REQUEUES" ]; then
      rtd_die "stopped at ${tag:-no checkpoint} after ${SLURM_RESTART_COUNT:-0} requeues" \
        "(RTD_MAX_REQUEUES=$RTD_MAX_REQUEUES); resubmit to continue from $RTD_SAVE"
    fi
    [ "$rc" = 0 ] || rtd_log "warning: the tasks exited with status $rc after the signal;" \
      "requeueing from ${tag:-scratch}"
    rtd_log "stopped at ${tag:-no checkpoint} (was ${tag_at_start:-none}): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" || rtd_die "scontrol requeue $SLURM_JOB_ID failed;" \
      "resubmit the same command to continue from $RTD_SAVE"
    return 0
  fi
  rtd_die "training failed (srun exit status $rc); latest checkpoint: ${tag:-none}"
}
