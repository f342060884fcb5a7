# shellcheck shell=bash
# The body of slurm/pretrain_*.sh, sourced after they set their regime's defaults (RTD_* below).
# Runs inside the batch step of an sbatch job (or an salloc shell): checks the tokenizer against
# the preset and the batch arithmetic (`python -m rtd_scale.launch_env check-tokenizer` and
# `batch-arithmetic`: rtd_scale.batch.batch_layout), starts one training process per task with
# srun, and turns a preemption signal into a checkpoint, a requeue and, in the requeued job, a
# resume.
#
# pretrain.py gets --preset and the regime (steps, global batch, micro-batch, sequence length,
# TP). The preset RTD_PRESET (rtd_scale/presets.py) holds the recipe; print it from the checkout:
#   python -c 'from rtd_scale.presets import preset; print(preset("NAME").to_json())'
# RTD_LR, RTD_WARMUP_ITERS and RTD_SEED become --lr, --lr-warmup-iters and --seed only when set:
# unset, the preset's values hold.
#
# Two phases (BERT's schedule, arXiv 1810.04805 §A.2), with RTD_PHASE1_ITERS set: steps
# 1..RTD_PHASE1_ITERS at RTD_PHASE1_SEQ_LENGTH tokens and RTD_PHASE1_GLOBAL_BATCH sequences
# (RTD_PHASE1_MICRO_BATCH per forward), then the rest to RTD_TRAIN_ITERS at RTD_SEQ_LENGTH and
# RTD_GLOBAL_BATCH. The learning-rate schedule spans the whole run in both phases
# (--lr-decay-iters RTD_TRAIN_ITERS); phase 2 is a --load of phase 1's last checkpoint, which
# keeps the optimizer state and the step and continues at the same fraction of the data. The
# phase is chosen from the newest complete checkpoint's step, so a requeued job resumes in
# whichever phase it stopped in, and the job that finishes phase 1 goes straight on to phase 2.
#
# Elastic requeue: the batch arithmetic is redone at every start, so a requeued job given
# fewer (or more) nodes (`scontrol update JobId=… NumNodes=1-1 NumTasks=… NumCPUs=…` while it
# waits, or a new sbatch with the same RTD_SAVE) continues from the same checkpoint at the new
# data-parallel size (pretrain.py --load converts the checkpoint at TP 1 and PP 1; see
# docs/resume.md#resume-at-another-size), as long as the global batch still divides.
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
# Stopping: SIGTERM, SIGINT or SIGHUP to this shell (kill, scancel --signal=TERM --batch) saves
# the same way, then the job ends: no requeue, no restart, one line naming the checkpoint, exit
# status 128 + the signal's number. A run whose tasks stopped on a signal sent to them is never
# restarted either (rtd_scale/restarts.py: "stopped").
#
# Failures (rtd_scale/restarts.py decides; docs/troubleshooting.md#unattended-runs):
#   - each rank runs inside slurm/lib/rank_env.sh, which copies its output to
#     RTD_SAVE/logs/rank<R>.log and records its exit status in rank<R>.exit;
#   - a step that fails is classified: a user-input error (pretrain.py's exit status 2 after its
#     `error:` line) stops the job with one line, no restart; a hang (the ranks' heartbeat,
#     --ft-rank-section-timeouts, found a rank that stopped finishing steps: its stack file and
#     line are in RTD_SAVE/hangs/) or a crash (a signal, an exception, a collective error) is
#     restarted: a new srun in the same allocation from the newest complete checkpoint, after
#     RTD_RESTART_BACKOFF seconds doubled each time, up to RTD_MAX_RESTARTS times; then the job
#     requeues itself (RTD_MAX_REQUEUES). Each restart is one line here, one line in
#     RTD_SAVE/restarts.jsonl and one TensorBoard event (restarts/*) in the restarted run;
#   - the same iteration failing RTD_MAX_FAILURES_AT_STEP times in a row (a crash loop) stops
#     the job with one line naming the iteration and the failing rank's log.

rtd_die() { echo "error: $*" >&2; exit 1; }
rtd_log() { echo "[rtd-slurm $(date '+%F %T')] $*"; }

# ---------------------------------------------------------------------------------- inputs ----
: "${RTD_REPO:?set RTD_REPO to the rtd_scale checkout}"
# shellcheck source=slurm/lib/wait.sh
source "$RTD_REPO/slurm/lib/wait.sh"
: "${RTD_PRESET:?}" "${RTD_TRAIN_ITERS:?}" "${RTD_GLOBAL_BATCH:?}" "${RTD_MICRO_BATCH:?}"
: "${RTD_SEQ_LENGTH:?}"
# RTD_LR, RTD_WARMUP_ITERS, RTD_SEED: unset (or empty), the preset's (recipe_args below)
: "${RTD_TP:=1}"
: "${RTD_SAVE:=$RTD_REPO/runs/$RTD_PRESET}"
: "${RTD_TENSORBOARD_DIR:=$RTD_SAVE/tensorboard}"
: "${RTD_SHARD_DIR:=$RTD_REPO/data/shards}"
: "${RTD_DATA_PATH:=}"
: "${RTD_TOKENIZER:=$RTD_REPO/data/spm.model}"
: "${RTD_DS_CONFIG:=$RTD_REPO/ds_configs/zero3.json}"
: "${RTD_SAVE_INTERVAL:=1000}"
: "${RTD_LOG_INTERVAL:=10}"
: "${RTD_DEVICE:=gpu}"
: "${RTD_BF16:=1}"
: "${RTD_EXTRA_ARGS:=}"
: "${RTD_MAX_REQUEUES:=100}"
: "${RTD_MAX_RESTARTS:=3}"
: "${RTD_MAX_FAILURES_AT_STEP:=3}"
: "${RTD_RESTART_BACKOFF:=10}"
: "${RTD_VENV:=$RTD_REPO/.venv}"
: "${RTD_LAUNCHER:=srun}"
: "${RTD_PHASE1_ITERS:=}"  # unset: one phase
: "${RTD_PHASE1_SEQ_LENGTH:=128}"
: "${RTD_PHASE1_GLOBAL_BATCH:=$RTD_GLOBAL_BATCH}"
: "${RTD_PHASE1_MICRO_BATCH:=$RTD_MICRO_BATCH}"
# RTD_EXPECT_VOCAB, the tokenizer's size: unset, the preset's model.vocab_size; a number, that;
# empty, no check (small tests on small tokenizers). Left unset here: unset and empty differ.

rtd_positive_int() {  # NAME VALUE
  [[ "$2" =~ ^[1-9][0-9]*$ ]] || rtd_die "$1=$2: expected a positive integer"
}

rtd_count() {  # NAME VALUE: a whole number, 0 included
  [[ "$2" =~ ^[0-9]+$ ]] || rtd_die "$1=$2: expected a whole number (0 or more)"
}

rtd_python() {  # python with the checkout importable, in the job's working directory (where
  # relative RTD_* paths point)
  PYTHONPATH="$RTD_REPO${PYTHONPATH:+:$PYTHONPATH}" python "$@"
}

# ---------------------------------------------------------------------- batch arithmetic ----
# rtd_batch_arithmetic WORLD TP GLOBAL MICRO [TASKS_PER_NODE]: prints "DP ACCUMULATION", or one
# error line (which numbers would work) on stderr and status 1. global = micro × accumulation ×
# DP, DP = world / TP; TP must divide the tasks per node. rtd_scale.batch.batch_layout, the
# arithmetic pretrain.py and tools/estimate_cost.py apply too.
rtd_batch_arithmetic() {
  rtd_python -m rtd_scale.launch_env batch-arithmetic "$@"
}

rtd_latest_tag() {  # the checkpoint --load RTD_SAVE takes (the newest complete one), or nothing
  rtd_python -c 'import sys; from rtd_scale.training.checkpoint.choose import newest_complete; print(newest_complete(sys.argv[1]) or "")' "$RTD_SAVE"
}

rtd_holds_run() {  # true when RTD_SAVE holds an earlier run's checkpoints, complete or not
  compgen -G "$RTD_SAVE/global_step*" >/dev/null || [ -f "$RTD_SAVE/latest" ]
}

rtd_step_of() {  # TAG: N of global_step<N>; 0 for no checkpoint
  if [[ "$1" =~ ^global_step([0-9]+)$ ]]; then echo "${BASH_REMATCH[1]}"; else echo 0; fi
}

rtd_is_final() {  # TAG: true when global_step<N> has N >= RTD_TRAIN_ITERS (training is done)
  (( $(rtd_step_of "$1") >= RTD_TRAIN_ITERS ))
}

# --------------------------------------------------------------------------------- main ----
rtd_pretrain_main() {
  local world tp dp gas master_addr tag_at_start data_paths=() srun_pid="" rc=0
  local preempted=0 signals=0 before per_node
  # First thing: a SIGUSR1 before srun starts must not kill this shell (bash's default action).
  # A trapped signal interrupts `wait` (status > 128) while srun keeps running: count signals so
  # the loop below waits again and rc is srun's own status.
  trap 'preempted=1; signals=$((signals + 1)); rtd_log "SIGUSR1: forwarding to the tasks (save, then requeue)"; if [ -n "$srun_pid" ]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi' USR1
  # A stop (SIGTERM from kill or scancel --batch, Ctrl-C's SIGINT under salloc, SIGHUP) is the
  # same save as a preemption, passed on as SIGUSR1 (the tasks' --exit-signal), but no requeue
  # and no restart: one line names the checkpoint, and this shell exits 128 + the signal.
  local stopped_by=""
  # shellcheck disable=SC2317  # invoked by the traps below
  rtd_stop_trap() {  # SIGNAL: the name of the stop signal this shell got
    stopped_by="${stopped_by:-$1}"
    signals=$((signals + 1))
    rtd_log "SIG$1: stopping: the tasks save after their current step (no requeue)"
    if [ -n "$srun_pid" ]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi
  }
  trap 'rtd_stop_trap TERM' TERM
  trap 'rtd_stop_trap INT' INT
  trap 'rtd_stop_trap HUP' HUP
  : "${SLURM_JOB_ID:?not inside a Slurm job: submit with sbatch (or run inside salloc)}"
  rtd_positive_int RTD_TRAIN_ITERS "$RTD_TRAIN_ITERS"
  rtd_positive_int RTD_GLOBAL_BATCH "$RTD_GLOBAL_BATCH"
  rtd_positive_int RTD_MICRO_BATCH "$RTD_MICRO_BATCH"
  rtd_positive_int RTD_SEQ_LENGTH "$RTD_SEQ_LENGTH"
  rtd_positive_int RTD_TP "$RTD_TP"
  rtd_count RTD_MAX_REQUEUES "$RTD_MAX_REQUEUES"  # else `-ge` fails and every stop requeues
  rtd_count RTD_MAX_RESTARTS "$RTD_MAX_RESTARTS"
  rtd_count RTD_MAX_FAILURES_AT_STEP "$RTD_MAX_FAILURES_AT_STEP"
  rtd_count RTD_RESTART_BACKOFF "$RTD_RESTART_BACKOFF"
  if [ -n "$RTD_PHASE1_ITERS" ]; then
    rtd_positive_int RTD_PHASE1_ITERS "$RTD_PHASE1_ITERS"
    (( RTD_PHASE1_ITERS < RTD_TRAIN_ITERS )) || rtd_die "RTD_PHASE1_ITERS=$RTD_PHASE1_ITERS" \
      "must be below RTD_TRAIN_ITERS=$RTD_TRAIN_ITERS (phase 2 trains the steps after it);" \
      "unset it for one phase"
    rtd_positive_int RTD_PHASE1_SEQ_LENGTH "$RTD_PHASE1_SEQ_LENGTH"
    rtd_positive_int RTD_PHASE1_GLOBAL_BATCH "$RTD_PHASE1_GLOBAL_BATCH"
    rtd_positive_int RTD_PHASE1_MICRO_BATCH "$RTD_PHASE1_MICRO_BATCH"
  fi
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

  # Redone at every start: a requeued job may have been given another node count. Its
  # SLURM_NTASKS is then the submission's (Slurm keeps the job's first environment; measured on
  # 22.05), while SLURM_TASKS_PER_NODE ("2(x3),1") describes this allocation: count from that,
  # and tell srun, which would otherwise ask for the old number of tasks.
  world="${SLURM_NTASKS:?SLURM_NTASKS is not set: give the job --ntasks-per-node}"
  if [ -n "${SLURM_TASKS_PER_NODE:-}" ]; then
    local group allocated=0 resized=""
    for group in ${SLURM_TASKS_PER_NODE//,/ }; do
      if [[ "$group" =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
        allocated=$(( allocated + BASH_REMATCH[1] * BASH_REMATCH[2] ))
      elif [[ "$group" =~ ^[0-9]+$ ]]; then
        allocated=$(( allocated + group ))
      fi
    done
    if (( allocated > 0 && allocated != world )); then
      resized="this allocation holds $allocated tasks (SLURM_TASKS_PER_NODE=$SLURM_TASKS_PER_NODE),"
      resized+=" not the submission's SLURM_NTASKS=$world: the job was resized; using $allocated"
      world="$allocated"
      export SLURM_NTASKS="$world" SLURM_NPROCS="$world"
    fi
  fi
  tp="$RTD_TP"
  per_node="${SLURM_TASKS_PER_NODE:-$world}"
  per_node="${per_node%%[(,]*}"
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
  if [ -n "${RTD_EXPECT_VOCAB-preset}" ]; then  # set and empty: no check
    local expect=()
    if [ -n "${RTD_EXPECT_VOCAB:-}" ]; then expect=(--vocab-size "$RTD_EXPECT_VOCAB"); fi
    rtd_python -m rtd_scale.launch_env check-tokenizer "$RTD_PRESET" "$RTD_TOKENIZER" \
      ${expect[@]+"${expect[@]}"} || exit 1  # the error is already printed
  fi

  tag_at_start="$(rtd_latest_tag)"
  if rtd_is_final "$tag_at_start"; then
    rtd_log "$RTD_SAVE already holds the final checkpoint ($tag_at_start): nothing to do"
    return 0
  fi
  # Both phases' arithmetic before anything starts (phase 1's while it is still to train), so a
  # layout that cannot do phase 2 stops now, not after phase 1
  local dp1="" gas1=""
  if [ -n "$RTD_PHASE1_ITERS" ] && (( $(rtd_step_of "$tag_at_start") < RTD_PHASE1_ITERS )); then
    read -r dp1 gas1 <<<"$(rtd_batch_arithmetic "$world" "$tp" "$RTD_PHASE1_GLOBAL_BATCH" \
      "$RTD_PHASE1_MICRO_BATCH" "$per_node" --phase1)"
    [ -n "$gas1" ] || exit 1  # the error is already printed
  fi
  read -r dp gas <<<"$(rtd_batch_arithmetic "$world" "$tp" "$RTD_GLOBAL_BATCH" "$RTD_MICRO_BATCH" "$per_node")"
  [ -n "$gas" ] || exit 1

  master_addr="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"  # one host per line
  export MASTER_ADDR="${master_addr%%$'\n'*}"  # the first (no pipe: no SIGPIPE under pipefail)
  export MASTER_PORT="${RTD_MASTER_PORT:-$(( 10000 + SLURM_JOB_ID % 20000 ))}"

  rtd_log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NUM_NODES node(s)" \
    "$SLURM_JOB_NODELIST: $world tasks, master $MASTER_ADDR:$MASTER_PORT, device $RTD_DEVICE"
  if [ -n "${resized:-}" ]; then rtd_log "$resized"; fi

  local precision_args=() recipe_args=()  # recipe_args: only what is set overrides the preset
  if [ "$RTD_BF16" = 1 ]; then precision_args=(--bf16); fi
  if [ -n "${RTD_LR:-}" ]; then recipe_args+=(--lr "$RTD_LR"); fi
  if [ -n "${RTD_WARMUP_ITERS:-}" ]; then recipe_args+=(--lr-warmup-iters "$RTD_WARMUP_ITERS"); fi
  if [ -n "${RTD_SEED:-}" ]; then recipe_args+=(--seed "$RTD_SEED"); fi
  local extra_args=()
  read -r -a extra_args <<<"$RTD_EXTRA_ARGS"
  local tag="$tag_at_start" step phase iters seq global micro pdp pgas load_args cmd
  local restarts=0 started decision action number wait_s line requeue_left port="$MASTER_PORT"
  export RTD_RANK_LOG_DIR="$RTD_SAVE/logs"  # rank_env.sh: each rank's log and exit status
  # a job requeued after its restarts ran out: its first run writes that restart's event
  RTD_RESTART="$(rtd_python -m rtd_scale.restarts requeued "$RTD_SAVE")"
  if [ -n "$RTD_RESTART" ]; then export RTD_RESTART; else unset RTD_RESTART; fi
  while :; do
    step="$(rtd_step_of "$tag")"
    if [ -n "$RTD_PHASE1_ITERS" ] && (( step < RTD_PHASE1_ITERS )); then
      phase=1 iters="$RTD_PHASE1_ITERS" seq="$RTD_PHASE1_SEQ_LENGTH" pdp="$dp1" pgas="$gas1"
      global="$RTD_PHASE1_GLOBAL_BATCH" micro="$RTD_PHASE1_MICRO_BATCH"
    else
      phase=2 iters="$RTD_TRAIN_ITERS" seq="$RTD_SEQ_LENGTH" pdp="$dp" pgas="$gas"
      global="$RTD_GLOBAL_BATCH" micro="$RTD_MICRO_BATCH"
    fi
    load_args=()
    if [ -n "$tag" ] || rtd_holds_run; then
      load_args=(--load "$RTD_SAVE")
    fi
    # The preset holds the recipe; these are the regime, the recipe variables that are set, and
    # the job's plumbing. The schedule's length is the whole run's, in phase 1 too:
    # --lr-decay-iters RTD_TRAIN_ITERS.
    cmd=(
      python -u "$RTD_REPO/rtd_scale/pretrain.py"
      --ds_config "$RTD_DS_CONFIG"
      --preset "$RTD_PRESET"
      --data-path "${data_paths[@]}"
      --tokenizer-model "$RTD_TOKENIZER"
      --save "$RTD_SAVE" ${load_args[@]+"${load_args[@]}"}
      --tensorboard-dir "$RTD_TENSORBOARD_DIR"
      --train-iters "$iters"
      --lr-decay-iters "$RTD_TRAIN_ITERS"
      --seq-length "$seq"
      --micro-batch-size "$micro"
      --global-batch-size "$global"
      --tensor-model-parallel-size "$RTD_TP"
      ${recipe_args[@]+"${recipe_args[@]}"}
      ${precision_args[@]+"${precision_args[@]}"}
      --log-interval "$RTD_LOG_INTERVAL" --save-interval "$RTD_SAVE_INTERVAL"
      --exit-signal-handler --exit-signal SIGUSR1
      ${extra_args[@]+"${extra_args[@]}"}
    )

    if [ -n "$RTD_PHASE1_ITERS" ]; then
      if [ "$phase" = 1 ]; then
        rtd_log "phase 1 of 2: steps $(( step + 1 ))-$RTD_PHASE1_ITERS at sequence length $seq," \
          "global batch $global (RTD_PHASE1_*); the learning-rate schedule spans all" \
          "$RTD_TRAIN_ITERS steps"
      else
        rtd_log "phase 2 of 2: steps $(( step + 1 ))-$RTD_TRAIN_ITERS at sequence length $seq," \
          "global batch $global"
      fi
    fi
    rtd_log "batch: micro-batch $micro × accumulation $pgas × data-parallel $pdp" \
      "= global $global (TP $tp)"
    if [ -n "$tag" ]; then
      rtd_log "resuming: the newest complete checkpoint in $RTD_SAVE is $tag"
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

    if [ "$preempted" = 0 ] && [ -z "$stopped_by" ]; then
      # a restart gets its own port: the failed step's rendezvous may still hold the old one
      export MASTER_PORT=$(( port + restarts ))
      mkdir -p "$RTD_RANK_LOG_DIR"
      rm -f "$RTD_RANK_LOG_DIR"/rank*.exit
      started="$(date +%s.%N)"
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
      rtd_wait "$srun_pid"
      srun_pid=""
    fi

    tag="$(rtd_latest_tag)"
    if [ "$rc" != 0 ] && [ "$preempted" = 0 ] && [ -z "$stopped_by" ]; then
      # a failed step: rtd_scale/restarts.py says why (a user error, a hang, a crash) and what
      # follows, and appends the record the restarted run turns into its TensorBoard event
      requeue_left=()
      if [ "${SLURM_RESTART_COUNT:-0}" -lt "$RTD_MAX_REQUEUES" ]; then requeue_left=(--requeue-left); fi
      decision="$(rtd_python -m rtd_scale.restarts after-failure --save "$RTD_SAVE" \
        --status "$rc" --started "$started" --restarts-done "$restarts" \
        --max-restarts "$RTD_MAX_RESTARTS" --max-same "$RTD_MAX_FAILURES_AT_STEP" \
        --backoff "$RTD_RESTART_BACKOFF" ${requeue_left[@]+"${requeue_left[@]}"})" || \
        rtd_die "training failed (srun exit status $rc); latest checkpoint: ${tag:-none}"
      read -r action number wait_s <<<"${decision%%$'\n'*}"
      line="${decision#*$'\n'}"
      case "$action" in
        restart)
          rtd_log "$line"
          sleep "$wait_s"
          restarts=$(( restarts + 1 ))
          export RTD_RESTART="$number"  # the restarted run writes this restart's event
          tag="$(rtd_latest_tag)"
          continue ;;
        requeue)
          rtd_log "$line"
          scontrol requeue "$SLURM_JOB_ID" || rtd_die "scontrol requeue $SLURM_JOB_ID failed;" \
            "resubmit the same command to continue from $RTD_SAVE"
          return 0 ;;
        *)
          echo "$line" >&2
          exit 1 ;;
      esac
    fi
    # phase 1 done (not stopped early): the same job goes on to phase 2
    if [ "$phase" = 1 ] && [ "$rc" = 0 ] && [ "$preempted" = 0 ] && [ -z "$stopped_by" ] && \
        (( $(rtd_step_of "$tag") >= RTD_PHASE1_ITERS )); then
      rtd_log "phase 1 finished: $RTD_SAVE/$tag"
      continue
    fi
    break
  done

  if [ "$rc" = 0 ] && rtd_is_final "$tag"; then
    rtd_log "training finished: $RTD_SAVE/$tag"
    return 0
  fi
  if [ -n "$stopped_by" ]; then
    [ "$rc" = 0 ] || rtd_log "warning: the tasks exited with status $rc after the signal"
    local where="none in $RTD_SAVE"
    if [ -n "$tag" ]; then where="$RTD_SAVE/$tag"; fi
    rtd_log "stopped by SIG$stopped_by: the newest complete checkpoint is $where; resume" \
      "with: the same sbatch command (it passes --load $RTD_SAVE)"
    exit $(( 128 + $(kill -l "$stopped_by") ))
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
