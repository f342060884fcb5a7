"""Four forked processes build the same cached sample index at once (rtd_scale/data/packed.py):
each reads the same samples and order, and no temporary file is left in the cache."""
from __future__ import annotations

import multiprocessing
import os

import numpy as np

from rtd_scale.data.packed import PackedDataset
from rtd_scale.data.shards import ShardWriter


def _write_shard(prefix, docs):
    with ShardWriter(prefix, vocab_size=100) as w:
        for d in docs:
            w.add_document(d)


def _build_in_process(prefix, cache_dir, out):
    ds = PackedDataset([prefix], seq_length=6, cache_dir=cache_dir)
    out.put([ds.content(i).tolist() for i in range(len(ds))] + [ds.order(3, 0).tolist()])


def test_concurrent_builds_of_the_same_index_are_safe(tmp_path):
    prefix = str(tmp_path / "corpus")
    _write_shard(prefix, [np.arange(5, 5 + n) for n in range(1, 40)])
    cache = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_build_in_process, args=(prefix, cache, out)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(r == results[0] for r in results)
    assert not [n for n in os.listdir(cache) if n.endswith(".tmp")]
    assert results[0][:-1] == [c.tolist() for c in map(
        PackedDataset([prefix], seq_length=6, cache=False).content, range(len(results[0]) - 1))]
