"""Packed samples over real shards, the sample order and the data-parallel split."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rtd_scale.data.packed import PackedDataset, micro_batches, sample_order
from rtd_scale.data.shards import open_shard


def test_packing_covers_the_stream_exactly(wiki_shards):
    _, prefix = wiki_shards
    ds = PackedDataset([prefix], seq_length=64)
    raw = open_shard(prefix)
    stream = np.concatenate([np.append(np.asarray(raw[i], dtype=np.int64), 2)
                             for i in range(len(raw))])
    assert ds.stream_tokens == len(stream)
    assert len(ds) == len(stream) // 62
    samples = np.stack([ds[i] for i in range(len(ds))])
    assert samples.shape == (len(ds), 64)
    assert (samples[:, 0] == 1).all() and (samples[:, -1] == 2).all()  # [CLS] … [SEP]
    assert not (samples == 0).any()  # packed: no padding
    np.testing.assert_array_equal(samples[:, 1:-1].reshape(-1), stream[: len(ds) * 62])


def test_two_prefixes_concatenate(wiki_shards):
    _, prefix = wiki_shards
    one = PackedDataset([prefix], seq_length=128)
    two = PackedDataset([prefix, prefix], seq_length=128)
    assert two.stream_tokens == 2 * one.stream_tokens
    np.testing.assert_array_equal(two[0], one[0])


def test_sample_order_is_a_pure_function_of_seed_and_epoch():
    n = 50
    k = np.arange(0, 120)
    a = sample_order(n, 7, k)
    assert sorted(a[:50].tolist()) == list(range(50))  # each epoch is a permutation
    assert not np.array_equal(a[:50], a[50:100])  # reshuffled per epoch
    np.testing.assert_array_equal(sample_order(n, 7, k[60:70]), a[60:70])
    assert not np.array_equal(sample_order(n, 8, k), a)


def test_data_parallel_ranks_split_the_global_batch(wiki_shards):
    _, prefix = wiki_shards
    ds = PackedDataset([prefix], seq_length=32)
    kw = dict(consumed_samples=48, seed=1, global_batch_size=16)
    single = micro_batches(ds, micro_batch_size=8, dp_rank=0, dp_size=1, **kw)
    parts = [mb for r in range(2)
             for mb in micro_batches(ds, micro_batch_size=4, dp_rank=r, dp_size=2, **kw)]
    cat = lambda mbs, f: torch.cat([getattr(m, f) for m in mbs])  # noqa: E731
    assert torch.equal(cat(single, "sample_index"), torch.arange(48, 64))
    assert torch.equal(cat(parts, "sample_index"), cat(single, "sample_index"))
    assert torch.equal(cat(parts, "input_ids"), cat(single, "input_ids"))


def test_empty_data_path_is_a_clear_error():
    with pytest.raises(ValueError, match="--data-path is empty"):
        PackedDataset([], seq_length=32)
