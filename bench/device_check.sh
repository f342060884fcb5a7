#!/usr/bin/env bash
# The GPU check of the RTD step, in one call on a fresh CUDA machine (~8 minutes on one H200).
#
# That machine has CUDA torch, transformers, tensorboard, sentencepiece and pytest but neither
# deepspeed nor megatron-core, and no network: their wheels travel in .wheels/ (git-ignored),
# built on the CPU machine from the repository root:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .wheels megatron-core==0.16.1 pydantic==2.14.4 \
#     pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 hjson==3.1.0
#   pip wheel --no-deps --no-build-isolation -w .wheels deepspeed==0.19.8
#
# Then, on the GPU machine, from the repository root with .wheels/ copied along, run
# `bash bench/device_check.sh` and allow it 8 minutes. Everything it prints also lands in $OUT
# (10 files):
#   env.txt            versions and the GPU
#   pytest.txt         the sampler and step tests, CUDA ones included (a GPU draw agrees with
#                      the CPU's and with softmax; forward + backward with zero host syncs)
#   gpu_rtd_step.*     bench/gpu_rtd_step.py: HF eager vs rtd_scale (DeepSpeed bf16, ZeRO-1) for
#                      ELECTRA-large B 32, ELECTRA-base B 64, DeBERTaV3-large dims B 16, seq 512,
#                      then rtd_scale with compiled layers (ELECTRA-large) while time is left
#   doc_mask_attention.*  bench/doc_mask_attention.py: the modern block's document mask, the
#                      explicit mask + SDPA against FlexAttention's block mask (ms, peak memory)
#   step_vs_hf.*       bench/step_vs_hf.py on CUDA (electra-small, debertav3-xsmall dims)
#   deberta_step_vs_hf.*  bench/deberta_step_vs_hf.py: our DeBERTaV3 step (disentangled
#                      attention, sdpa core, c2p / p2c gathered and shifted, bf16 parameters
#                      and autocast) vs the HF DebertaV2 recipe, debertav3-large dims, bf16,
#                      batch 16 × seq 512 (~2 minutes)
#
# TINY=1 runs the same steps at test size on CPU (no install when the packages import): a check
# of this script's plumbing, not of the GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/device_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TINY=${TINY:-0}
start=$(date +%s)
elapsed() { echo "[device_check] $(( $(date +%s) - start ))s: $*"; }

# 1. deepspeed, megatron-core and the dependencies the machine lacks, from the carried wheels
if ! $PY -c "import deepspeed, megatron.core" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .wheels/*.whl || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY - <<'EOF' 2>&1 | grep -v -i warn | tee "$OUT/env.txt"
import platform, torch, transformers, deepspeed, megatron.core
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"python {platform.python_version()} torch {torch.__version__} transformers "
      f"{transformers.__version__} deepspeed {deepspeed.__version__} megatron-core "
      f"{megatron.core.__version__}; {gpu}")
EOF
elapsed "installed"

# 2. the tests of the sampler and of the step (the CUDA ones skip on CPU)
timeout 130 $PY -m pytest -q -p no:cacheprovider -x tests/unit/test_objectives.py \
  tests/unit/test_rtd_step.py tests/unit/test_disentangled.py tests/unit/test_document_mask.py \
  -k "cuda or sampler or never_wait" 2>&1 \
  | tee "$OUT/pytest.txt" | tail -25
elapsed "tests"

# 2b. the modern block's document mask: explicit [b, 1, s, s] + SDPA against the compact ids +
#     FlexAttention's block mask, forward + backward, s 1,024 and 8,192 (~1 minute)
if [ "$TINY" = 1 ]; then
  docmask_args=(--device cpu --tiny)
else
  docmask_args=(--device cuda --seq 1024 8192 --batch 8 2)
fi
timeout 150 $PY bench/doc_mask_attention.py "${docmask_args[@]}" \
  --json "$OUT/doc_mask_attention.json" 2>&1 | grep -v -i "warn" \
  | tee "$OUT/doc_mask_attention.txt" | tail -8
elapsed "doc_mask_attention"

# 3. DeBERTaV3: our disentangled-attention step against Hugging Face's DebertaV2 at
#    debertav3-large dims (first, so that the slower rows below cannot crowd it out)
if [ "$TINY" = 1 ]; then
  deberta_args=(--tiny --device cpu --batch 4 --seq 48 --rounds 1 --steps-per-round 1 --warmup 1)
else
  # ours with bf16 parameters (as pretrain.py --bf16 trains) and under autocast (as HF's),
  # c2p / p2c gathered and shifted (rtd_scale/model/disentangled.py RELATIVE_TERMS)
  deberta_args=(--dims large --device cuda --bf16 --ours-bf16 both --impls sdpa
                --relative-terms gather,shift --batch 16 --seq 512 --rounds 2
                --steps-per-round 2 --warmup 2)
fi
timeout 220 $PY bench/deberta_step_vs_hf.py "${deberta_args[@]}" \
  --json "$OUT/deberta_step_vs_hf.json" 2>&1 | grep -v -i "warn" \
  | tee "$OUT/deberta_step_vs_hf.txt" | tail -8
elapsed "deberta_step_vs_hf"

# 4. the side-by-side rows: HF eager and rtd_scale per workload, diagnostics for ELECTRA-large,
#    compiled layers last while the deadline allows
if [ "$TINY" = 1 ]; then
  gpu_args=(--device cpu --tiny --deadline-s 240)
  step_args=(--device cpu --tiny --rounds 1 --steps-per-round 1 --warmup 1 --profile-steps 1)
else
  gpu_args=(--deadline-s 240)
  step_args=(--device cuda --rounds 3 --steps-per-round 3 --warmup 3 --profile-steps 2)
fi
timeout 270 $PY bench/gpu_rtd_step.py --skip stack,extras,hf-compile "${gpu_args[@]}" \
  --json "$OUT/gpu_rtd_step.json" 2>&1 | grep -v -i "warn" | tee "$OUT/gpu_rtd_step.txt" \
  | tail -60
elapsed "gpu_rtd_step"

# 5. the side-by-side of the CPU targets, on the GPU
timeout 80 $PY bench/step_vs_hf.py "${step_args[@]}" --json "$OUT/step_vs_hf.json" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/step_vs_hf.txt" | tail -8
elapsed "done"
