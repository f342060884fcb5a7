#!/usr/bin/env python
"""Loader throughput: packed AND masked sequences per second per training process.

    .venv/bin/python bench/loader.py                      # defaults below; ~3–6 min the first time
    .venv/bin/python bench/loader.py --seconds 5 --workers 0,1,2 --micro-batch-size 32

What one training process does for its data, timed per row for ``--seconds`` after one warm-up
micro-batch (worker start-up excluded):

- the real loader (``rtd_scale.data.loader.build_loader``) over the real blended training split
  (``rtd_scale.data.blend.build_split``, 969,30,1) of the benchmark corpus, reading micro-batches
  of ``--micro-batch-size`` packed [CLS] … [SEP] sequences of ``--seq-length`` tokens in the
  seeded order, with ``--workers`` loader processes (0: in the training process) and
  ``prefetch_factor`` 2;
- then, as the model does at the start of its forward, ``rtd_scale.objectives.masking.mask_tokens``
  on each micro-batch, here on the CPU in the training process (15% masking, 80/10/10).

Target: ≥ 10,000 sequences/s per process at seq_length 512.

Inputs: /work/shared/corpus/bench_corpus.jsonl.xz (``--corpus``), decompressed with lzma into
``--out`` (default build/bench_loader, git-ignored), a SentencePiece model trained on it with
tools/train_tokenizer.py and shards written by tools/preprocess_data.py (both run as
subprocesses, once; later runs reuse them, and the sample index cache next to the shards).
"""
from __future__ import annotations

import argparse
import lzma
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rtd_scale.data.blend import build_split  # noqa: E402
from rtd_scale.data.loader import DataParallelSampler, build_loader  # noqa: E402
from rtd_scale.data.packed import PackedDataset  # noqa: E402
from rtd_scale.data.tokenizer import Tokenizer  # noqa: E402
from rtd_scale.objectives.masking import mask_tokens  # noqa: E402

TARGET = 10_000


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", default="/work/shared/corpus/bench_corpus.jsonl.xz")
    p.add_argument("--out", default=str(REPO / "build" / "bench_loader"))
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--workers", default="0,1,2", help="comma-separated loader worker counts")
    p.add_argument("--seconds", type=float, default=5.0, help="timed seconds per row")
    return p.parse_args()


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")


def prepare(args) -> tuple[str, str]:
    """(tokenizer model, dataset prefix), made once under --out."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "bench_corpus.jsonl"
    if not corpus.exists():
        print(f"decompressing {args.corpus} …", flush=True)
        tmp = corpus.with_suffix(".tmp")
        with lzma.open(args.corpus, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, corpus)
    spm = out / f"spm{args.vocab_size}"
    if not spm.with_suffix(".model").exists():
        print("training the tokenizer (tools/train_tokenizer.py) …", flush=True)
        run([sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input", str(corpus),
             "--vocab-size", str(args.vocab_size), "--input-sentence-size", "300000",
             "--output-prefix", str(spm)])
    prefix = out / f"shards{args.vocab_size}" / "bench"
    data = Path(str(prefix) + "_text_document")
    if not Path(str(data) + ".manifest.json").exists() and not Path(str(data) + ".idx").exists():
        print("writing shards (tools/preprocess_data.py) …", flush=True)
        run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus),
             "--tokenizer-model", str(spm.with_suffix(".model")), "--output-prefix", str(prefix),
             "--workers", str(max(1, (os.cpu_count() or 2) - 1))])
    return str(spm.with_suffix(".model")), str(data)


def measure(data, tok: Tokenizer, *, workers: int, mask: bool, args) -> float:
    """Sequences per second of this process: loader (+ masking) for --seconds."""
    b = args.micro_batch_size
    sampler = DataParallelSampler(total_samples=b * 1_000_000, consumed_samples=0,
                                  global_batch_size=b, micro_batch_size=b, dp_rank=0, dp_size=1)
    loader = build_loader(data, sampler, num_workers=workers, pin_memory=False, prefetch_factor=2,
                          seed=0)
    it = iter(loader)
    next(it)  # warm-up: worker start-up, first pages of the maps
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds:
        mb = next(it)
        if mask:
            mask_tokens(mb.input_ids, mb.sample_index, seed=0, mask_prob=0.15,
                        mask_token_prob=0.8, random_token_prob=0.1, mask_id=tok.mask_id,
                        vocab_size=tok.vocab_size, special_ids=tok.special_ids)
        n += mb.input_ids.shape[0]
    rate = n / (time.perf_counter() - t0)
    del it, loader
    return rate


def main() -> None:
    args = parse_args()
    model, prefix = prepare(args)
    tok = Tokenizer(model)
    split = dict(sources=[(1.0, [prefix])], seq_length=args.seq_length, split=(969, 30, 1),
                 seed=0)
    data = build_split(part=0, **split)  # builds the cache on the first run
    t0 = time.perf_counter()
    cold = PackedDataset([prefix], args.seq_length, split=(969, 30, 1), part=0, cache=False)
    cold.order(0, 0)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = build_split(part=0, **split)
    data.locate(np.arange(1))  # opens epoch 0's cached order
    t_warm = time.perf_counter() - t0
    ds = data.datasets[0]
    print(f"\ncorpus: {ds.total_documents:,} documents, {int(ds._doc_starts[-1]):,} tokens in "
          f"{len(ds.shards)} shard(s); train split: {len(ds):,} samples of {args.seq_length} "
          f"tokens; sample index and epoch order: built in {t_cold:.3f} s, loaded from the cache "
          f"({ds.cache.directory}) in {t_warm:.3f} s")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} CPUs, micro-batch {args.micro_batch_size}\n")
    rows = []
    for w in (int(x) for x in args.workers.split(",")):
        for mask in (False, True):
            rate = measure(data, tok, workers=w, mask=mask, args=args)
            rows.append((f"pack{' + mask' if mask else ''}, {w} worker{'s' if w != 1 else ''}",
                         rate, mask))
    print(f"| config (seq_length {args.seq_length}) | sequences/s per process | tokens/s | "
          f"≥ {TARGET:,} seq/s |")
    print("|---|---:|---:|:---:|")
    for name, rate, mask in rows:
        ok = ("yes" if rate >= TARGET else "no") if mask else "—"
        print(f"| {name} | {rate:,.0f} | {rate * args.seq_length:,.0f} | {ok} |")


if __name__ == "__main__":
    main()
