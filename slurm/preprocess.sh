#!/usr/bin/env bash
# Tokenize a corpus into megatron-core shards: a Slurm array job, one task per input file.
#
#   ls /data/raw/*.jsonl > inputs.txt              # one input file per line (.jsonl .json .parquet .txt)
#   bash slurm/preprocess.sh inputs.txt            # outside a job: prints the sbatch command, e.g.
#   sbatch --array=0-99%32 slurm/preprocess.sh inputs.txt   # ≤ 32 tasks at a time
#
# Task i reads line i+1 of the list and runs tools/preprocess_data.py on that file with
# --workers = the CPUs Slurm gave the task and --resume, writing the dataset
# RTD_SHARD_DIR/<name>-<hash>_<KEY>_document (KEY from RTD_JSON_KEYS; <name> is the file's name
# without its suffixes, <hash> the first 10 hex digits of the SHA-256 of its real path): shards
# _00000, _00001, … of RTD_SHARD_MB MB each, then a .manifest.json. The output is named after the
# input, not after its line, so a list that changes between submissions (a file inserted, removed
# or reordered) still tokenizes every file exactly once: a file whose dataset is complete is
# skipped, a new one is tokenized. A task refuses, in one line, when
#   - its file was edited since its shards were written (preprocess_data.py --resume compares
#     the real path, size, modification time and first and last MiB recorded in every shard);
#   - the same content is already tokenized in RTD_SHARD_DIR under another name (a copy, a moved
#     file, or a part-NNNNN dataset of an older version of this script that named outputs by list
#     position): the data would be read twice;
# and a line naming the same file as an earlier line is skipped (that task tokenizes it).
# Shards appear only when complete; a requeued or resubmitted task (`sbatch --array=7,12 ...` for
# the failed ones) keeps its complete shards and continues after them. Two tasks started at the
# same moment on two copies of one file both tokenize it (each finds nothing yet). slurm/
# pretrain_*.sh then read every *_text_document dataset in RTD_SHARD_DIR.
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

# The real paths of lines 1..k (no existence check: one line out per line in).
real_paths() { if [ "$1" -gt 0 ]; then realpath -m -- "${inputs[@]:0:$1}"; fi; }

if [ -z "${SLURM_ARRAY_TASK_ID:-}" ]; then
  mapfile -t reals < <(real_paths "$n")
  declare -A first_line=()
  for (( k = 0; k < n; k++ )); do
    [ -f "${reals[$k]}" ] || {
      echo "error: $list line $(( k + 1 )): ${inputs[$k]}: no such file; fix the list" >&2; exit 2; }
    if [ -n "${first_line[${reals[$k]}]:-}" ]; then
      echo "note: $list line $(( k + 1 )) names the same file as line ${first_line[${reals[$k]}]}" \
        "(${reals[$k]}); it is tokenized once"
    else
      first_line[${reals[$k]}]=$(( k + 1 ))
    fi
  done
  echo "$list names $n input file(s); submit one array task per file:"
  echo "  sbatch --array=0-$(( n - 1 )) ${BASH_SOURCE[0]} $list"
  exit 0
fi

i="$SLURM_ARRAY_TASK_ID"
if ! [[ "$i" =~ ^[0-9]+$ ]] || [ "$i" -ge "$n" ]; then
  echo "error: array index $i but $list names only $n files (indices 0-$(( n - 1 )))" >&2; exit 2
fi
input="${inputs[$i]}"
real="$(realpath -m -- "$input")"
if [ ! -f "$real" ]; then
  echo "error: task $i: $list line $(( i + 1 )): $input: no such file" >&2; exit 2
fi
mapfile -t earlier < <(real_paths "$i")
for (( k = 0; k < i; k++ )); do
  if [ "${earlier[$k]}" = "$real" ]; then
    echo "task $i: $list line $(( i + 1 )) names the same file as line $(( k + 1 )) ($real);" \
      "task $k tokenizes it: nothing to do"
    exit 0
  fi
done
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

# The output's name: the file's name without suffixes (safe characters only) and a hash of its
# real path, so it depends on which file this is, never on its line in the list.
stem="$(basename -- "$real")"
while [[ "$stem" =~ ^(.+)\.(gz|xz|bz2|jsonl|json|txt|parquet)$ ]]; do stem="${BASH_REMATCH[1]}"; done
stem="$(printf '%s' "$stem" | tr -c 'A-Za-z0-9._-' '_')"
hash="$(printf '%s' "$real" | sha256sum)"
prefix="$RTD_SHARD_DIR/${stem:0:40}-${hash:0:10}"
read -r -a keys <<<"$RTD_JSON_KEYS"

# Before any work: this file's own dataset must have been made from it as it is now, and its
# content must not be tokenized under another name (the pretraining jobs would read it twice).
if [ -d "$RTD_SHARD_DIR" ]; then
  PYTHONPATH="$RTD_REPO${PYTHONPATH:+:$PYTHONPATH}" \
    python - "task $i: $list line $(( i + 1 ))" "$real" "$RTD_SHARD_DIR" "$prefix" "${keys[@]}" <<'PY'
import glob, json, os, sys, time
from rtd_scale.data.text import input_fingerprint

where, real, shard_dir, prefix, *keys = sys.argv[1:]
own = {f"{prefix}_{key}_document" for key in keys}
mine = input_fingerprint(real)


def describe(fp):
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((fp.get("mtime_ns") or 0) / 1e9))
    return f"{fp.get('bytes')} bytes, modified {when}"


# complete datasets (manifest) and unfinished ones (their first shard's sidecar)
pattern = os.path.join(glob.escape(shard_dir), "*_document")
for record in sorted(glob.glob(pattern + ".manifest.json") + glob.glob(pattern + "_00000.meta.json")):
    dataset = record.rsplit("_document", 1)[0] + "_document"
    try:
        with open(record, encoding="utf-8") as f:
            inputs = (json.load(f).get("run") or {}).get("inputs") or []
    except (OSError, ValueError, AttributeError):
        continue
    for other in inputs:
        if not isinstance(other, dict):
            continue
        if dataset in own:
            if other != mine:
                print(f"error: {where}: {real} changed since {dataset} was made from it (then "
                      f"{describe(other)}; now {describe(mine)}); delete that dataset to "
                      "tokenize the file again", file=sys.stderr)
                sys.exit(1)
        elif other.get("path") == mine["path"] or (other.get("bytes"), other.get(
                "sha256_head_tail")) == (mine["bytes"], mine["sha256_head_tail"]):
            what = ("this file" if other.get("path") == mine["path"]
                    else f"the same content (from {other.get('path')})")
            print(f"error: {where}: {real} is already tokenized: {dataset} holds {what}; delete "
                  f"that dataset to tokenize it as {os.path.basename(prefix)}, or drop the line "
                  "from the list", file=sys.stderr)
            sys.exit(1)
PY
fi
mkdir -p "$RTD_SHARD_DIR"
echo "task $i of $n: $input → $prefix (workers $RTD_WORKERS)"
python "$RTD_REPO/tools/preprocess_data.py" --input "$real" --json-keys "${keys[@]}" \
  --tokenizer-model "$RTD_TOKENIZER" --output-prefix "$prefix" --workers "$RTD_WORKERS" \
  --shard-size-mb "$RTD_SHARD_MB" --resume
