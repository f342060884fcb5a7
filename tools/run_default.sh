#!/usr/bin/env bash
# README command 1: the main job on the embedded default, from a fresh machine.
#   set-up → sample corpus (Wikipedia vital-article leads) → SentencePiece → shards →
#   `deepspeed rtd_scale/pretrain.py` (debertav3-tiny preset, 2 ranks, ZeRO-3, 600 steps) → summary.
# Validation reads 8 global batches (256 of the split's 284 samples) instead of the preset's 2, so
# the held-out RTD AUC's chance standard deviation is 0.0038 (as the summary reports it) rather than ~0.009.
# Knobs (environment): RTD_STEPS (600), RTD_RANKS (2), RTD_DS_CONFIG (ds_configs/zero3.json),
# RTD_RUN_DIR (runs/debertav3-tiny-<time>), MASTER_PORT (the launcher's --master_port; unset:
# deepspeed's 29500; set a free one to run a second job on the same machine).
# A run that fails before writing anything leaves no empty run directory behind (rmdir removes
# only an empty one; tests/e2e/test_run_default.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$(date +%s)
# shellcheck disable=SC1091
source tools/setup_env.sh
export PYTHONWARNINGS="ignore::UserWarning:megatron,ignore::FutureWarning"
# a CPU run never calls megatron-core's fused kernels: compile them on first use, not at every
# rank's import (rtd_scale/_lazy_fusions.py; a few seconds of each process's start on 2 cores)
export RTD_SCALE_LAZY_FUSIONS=1

data=data/sample
python tools/build_sample_corpus.py --output "$data/corpus.jsonl"
if [ ! -f "$data/spm.model" ]; then
  python tools/train_tokenizer.py --input "$data/corpus.jsonl" --vocab-size 8000 --character-coverage 1.0 \
    --output-prefix "$data/spm"
fi
manifest="$data/wiki_text_document.manifest.json"
if [ ! -f "$manifest" ] || [ "$data/spm.model" -nt "$manifest" ]; then
  python tools/preprocess_data.py --input "$data/corpus.jsonl" --json-keys text \
    --tokenizer-model "$data/spm.model" --output-prefix "$data/wiki" --workers 2 --overwrite
fi

run_dir="${RTD_RUN_DIR:-runs/debertav3-tiny-$(date +%Y%m%d-%H%M%S)}"
launcher=(--num_gpus "${RTD_RANKS:-2}")
if [ -n "${MASTER_PORT:-}" ]; then
  launcher+=(--master_port "$MASTER_PORT")
fi
if [ ! -e "$run_dir" ]; then  # ours to tidy: remove it on exit if the run left it empty
  trap 'rmdir "$run_dir" 2>/dev/null || true' EXIT
fi
deepspeed "${launcher[@]}" rtd_scale/pretrain.py \
  --ds_config "${RTD_DS_CONFIG:-ds_configs/zero3.json}" \
  --preset debertav3-tiny \
  --data-path "$data/wiki_text_document" \
  --tokenizer-model "$data/spm.model" \
  --save "$run_dir" \
  --train-iters "${RTD_STEPS:-600}" \
  --log-interval 25 --save-interval 100 --eval-iters 8 2>&1 \
  | grep --line-buffered -vE '^\[[0-9-]+ [0-9:,]+\] \[(INFO|WARNING)\]|^ *warnings.warn\(|^  return func'
echo "main job done in $(( $(date +%s) - start )) s (set-up included)"
