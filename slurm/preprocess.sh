#!/usr/bin/env bash
# Tokenize a corpus into megatron-core shards: a Slurm array job, one task per input file.
#
#   ls /data/raw/*.jsonl > inputs.txt              # one input file per line (.jsonl .json .parquet .txt)
#   bash slurm/preprocess.sh inputs.txt            # outside a job: prints the sbatch command, e.g.
#   sbatch --array=0-99%32 slurm/preprocess.sh inputs.txt   # ≤ 32 tasks at a time
#
# Task i reads line i+1 of the list and runs tools/preprocess_data.py on that file with
# --workers = the CPUs Slurm gave the task and --resume, writing the dataset
# RTD_SHARD_DIR/part-<i, 5 digits>_<KEY>_document (KEY from RTD_JSON_KEYS): shards _00000, _00001, …
# of RTD_SHARD_MB MB each, then a .manifest.json. Shards appear only when complete; a task whose
# manifest exists does nothing, and a requeued or resubmitted task (`sbatch --array=7,12 ...` for
# the failed ones) keeps its complete shards and continues after them. slurm/pretrain_*.sh then
# read every *_text_document dataset in RTD_SHARD_DIR.
#
# Environment:
#   RTD_TOKENIZER   <repo>/data/spm.model   SentencePiece model (tools/train_tokenizer.py)
#   RTD_SHARD_DIR   <repo>/data/shards      output directory
#   RTD_JSON_KEYS   text                    fields to tokenize, space-separated
#   RTD_WORKERS     SLURM_CPUS_PER_TASK     encoding processes per task
#   RTD_SHARD_MB    1024                    shard size (MB of token data; --shard-size-mb)
#   RTD_VENV        <repo>/.venv            activated when present
#   RTD_REPO        (found)                 the rtd_scale checkout
#
#SBATCH --job-name=rtd-preprocess
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=16
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --output=slurm-%x-%A_%a.out
set -euo pipefail

# Slurm runs a copy of this file from its spool directory: find the checkout through the job
# record (the path that was submitted), or from this file when run with bash.
_self="${BASH_SOURCE[0]}"
if [ ! -f "$(dirname "$_self")/lib/pretrain_job.sh" ] && [ -n "${SLURM_JOB_ID:-}" ]; then
  _self="$(sed -n '/^ *Command=/{s/^ *Command=\([^ ]*\).*/\1/p;q;}' <<<"$(scontrol show job "$SLURM_JOB_ID")")"
fi
RTD_REPO="${RTD_REPO:-$(cd "$(dirname "$_self")/.." && pwd)}"
[ -f "$RTD_REPO/tools/preprocess_data.py" ] || {
  echo "error: cannot find the rtd_scale checkout (looked in '$RTD_REPO'); set RTD_REPO" >&2; exit 1; }

list="${1:-}"
if [ -z "$list" ] || [ ! -f "$list" ]; then
  echo "usage: sbatch --array=0-<N-1> slurm/preprocess.sh LIST  (LIST: one input file per line)" >&2
  exit 2
fi
mapfile -t inputs < <(grep -v '^[[:space:]]*$' "$list")
n="${#inputs[@]}"
[ "$n" -gt 0 ] || { echo "error: $list names no input files" >&2; exit 2; }

if [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then
  echo "$list names $n input file(s); submit one array task per file:"
  echo "  sbatch --array=0-$(( n - 1 )) ${BASH_SOURCE[0]} $list"
  exit 0
fi

i="$SLURM_ARRAY_TASK_ID"
[ "$i" -lt "$n" ] || { echo "error: array index $i but $list names only $n files" >&2; exit 2; }
input="${inputs[$i]}"
: "${RTD_TOKENIZER:=$RTD_REPO/data/spm.model}"
: "${RTD_SHARD_DIR:=$RTD_REPO/data/shards}"
: "${RTD_JSON_KEYS:=text}"
: "${RTD_WORKERS:=${SLURM_CPUS_PER_TASK:-1}}"
: "${RTD_SHARD_MB:=1024}"
: "${RTD_VENV:=$RTD_REPO/.venv}"
if [ -f "$RTD_VENV/bin/activate" ]; then
  set +u
  # shellcheck disable=SC1091
  source "$RTD_VENV/bin/activate"
  set -u
fi

prefix="$RTD_SHARD_DIR/$(printf 'part-%05d' "$i")"
read -r -a keys <<<"$RTD_JSON_KEYS"
done_already=1
for key in "${keys[@]}"; do
  if [ ! -f "${prefix}_${key}_document.manifest.json" ]; then
    done_already=0
  fi
done
if [ "$done_already" = 1 ]; then
  echo "task $i: $input → ${prefix}_*_document already exists; nothing to do"
  exit 0
fi
mkdir -p "$RTD_SHARD_DIR"
echo "task $i of $n: $input → $prefix (workers $RTD_WORKERS)"
python "$RTD_REPO/tools/preprocess_data.py" --input "$input" --json-keys "${keys[@]}" \
  --tokenizer-model "$RTD_TOKENIZER" --output-prefix "$prefix" --workers "$RTD_WORKERS" \
  --shard-size-mb "$RTD_SHARD_MB" --resume
