"""Packed samples over real shards: the stream, documents, splits, the cached index and the
sample order (rtd_scale/data/packed.py), also over one-sentence documents. Concurrent builds of
one index by several processes are in tests/multiproc/test_packed_concurrent_builds.py."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.blend import BlendedDataset
from rtd_scale.data.loader import DataParallelSampler, build_loader, micro_batches
from rtd_scale.data.packed import PackedDataset, sample_order, split_boundaries
from rtd_scale.data.shards import ShardWriter, _indexed_dataset_module, open_shard, resolve_data_path
from tests.helpers.env import CASES
from tests.helpers.tools import load_tool


def _stream(prefix: str) -> np.ndarray:
    """The documents of every shard of ``prefix``, each followed by [SEP] (id 2)."""
    parts = []
    for shard in resolve_data_path(prefix):
        raw = open_shard(shard)
        parts += [np.append(np.asarray(raw[i], dtype=np.int64), 2) for i in range(len(raw))]
    return np.concatenate(parts)


def _contents(ds: PackedDataset) -> np.ndarray:
    return np.concatenate([ds.content(i) for i in range(len(ds))])


def test_packing_covers_the_stream_exactly(wiki_shards, tmp_path):
    _, prefix = wiki_shards
    ds = PackedDataset([prefix], seq_length=64, cache_dir=str(tmp_path))
    stream = _stream(prefix)
    assert ds.stream_tokens == len(stream)
    assert len(ds) == -(-len(stream) // 62)  # ceil: the remainder is the last sample
    samples = np.stack([ds[i] for i in range(len(ds))])
    assert samples.shape == (len(ds), 64)
    assert (samples[:, 0] == 1).all() and (samples[:-1, -1] == 2).all()  # [CLS] … [SEP]
    assert not (samples[:-1] == 0).any()  # packed: no padding before the last sample
    tail = len(stream) - (len(ds) - 1) * 62
    assert samples[-1, tail + 1] == 2 and (samples[-1, tail + 2:] == 0).all()
    np.testing.assert_array_equal(samples[:-1, 1:-1].reshape(-1), stream[: (len(ds) - 1) * 62])
    np.testing.assert_array_equal(_contents(ds), stream)


def test_two_prefixes_concatenate(wiki_shards, tmp_path):
    _, prefix = wiki_shards
    one = PackedDataset([prefix], seq_length=128, cache_dir=str(tmp_path))
    two = PackedDataset([prefix, prefix], seq_length=128, cache_dir=str(tmp_path))
    assert two.stream_tokens == 2 * one.stream_tokens
    np.testing.assert_array_equal(two[0], one[0])
    np.testing.assert_array_equal(_contents(two), np.concatenate([_stream(prefix)] * 2))


def test_a_document_of_several_sequences_is_one_run(tmp_path):
    """Megatron-LM's --split-sentences shards: one document = several sequences, contiguous in
    .bin; it is one [SEP]-terminated run. An empty document adds nothing (no lone [SEP])."""
    prefix = str(tmp_path / "megatron")
    builder = _indexed_dataset_module().IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    docs = [([10, 11, 12], [13, 14]), ([],), ([20],), ([30, 31], [32], [33, 34, 35])]
    for sentences in docs:
        builder.add_document(np.array([t for s in sentences for t in s], np.uint16),
                             [len(s) for s in sentences])
    builder.finalize(prefix + ".idx")
    ds = PackedDataset([prefix], seq_length=8, cache=False)
    expected = [10, 11, 12, 13, 14, 2, 20, 2, 30, 31, 32, 33, 34, 35, 2]
    assert ds.total_documents == 4 and ds.stream_tokens == len(expected)
    np.testing.assert_array_equal(_contents(ds), expected)
    np.testing.assert_array_equal(ds[0], [1, 10, 11, 12, 13, 14, 2, 2])
    np.testing.assert_array_equal(ds[2], [1, 34, 35, 2, 2, 0, 0, 0])  # remainder, padded


def test_one_sentence_documents_pack_across_boundaries(wiki_shards, tmp_path):
    """300 one-sentence documents. Samples hold many documents each, every document is
    reachable through some sample, and reading every sample (and a loader over them) ends."""
    tok, _ = wiki_shards
    load_tool("preprocess_data").main(["--input", str(CASES / "single_sentence_docs.jsonl"),
                                       "--tokenizer-model", tok, "--output-prefix", str(tmp_path / "single_sentence"),
                                       "--workers", "1"])
    prefix = str(tmp_path / "single_sentence_text_document")
    ds = PackedDataset([prefix], seq_length=64)
    stream = _stream(prefix)
    assert ds.total_documents == 300 and len(ds) == -(-len(stream) // 62) > 1
    np.testing.assert_array_equal(_contents(ds), stream)  # nothing lost, nothing repeated
    spans = [ds.documents_of(i) for i in range(len(ds))]
    assert all(first < last for first, last in spans[:-1])  # concatenated across boundaries
    assert np.mean([(ds.content(i) == 2).sum() for i in range(len(ds))]) > 2
    covered = np.zeros(ds.total_documents, bool)
    for first, last in spans:
        covered[first:last + 1] = True
    assert covered.all()  # every document is reachable
    # one epoch through the loader: every sample once, in the seeded order, and it ends
    data = BlendedDataset([ds], [1.0], seed=5)
    sampler = DataParallelSampler(total_samples=len(ds) // 4 * 4, consumed_samples=0,
                                  global_batch_size=4, micro_batch_size=2, dp_rank=0, dp_size=1)
    read = [mb.input_ids for mb in build_loader(data, sampler, num_workers=0, pin_memory=False)]
    assert len(read) == len(ds) // 4 * 2
    order = ds.order(5, 0)
    for j, ids in enumerate(read):
        np.testing.assert_array_equal(ids.numpy(), [ds[int(i)] for i in order[2 * j:2 * j + 2]])
    assert (tmp_path / "index-cache").is_dir()  # cached next to the shards
    # the validation split of --split 969,30,1 is not empty, and packs the same way
    valid = PackedDataset([prefix], seq_length=64, split=(969, 30, 1), part=1)
    assert valid.document_range == (291, 300) and len(valid) >= 1
    assert (valid.content(0) == 2).sum() >= 2


def test_split_boundaries_follow_megatron():
    assert split_boundaries((969, 30, 1), 402) == [0, 390, 402, 402]
    assert split_boundaries((8, 1, 1), 10) == [0, 8, 9, 10]
    assert split_boundaries((1,), 7) == [0, 7, 7, 7]
    assert split_boundaries((98, 2), 3) == [0, 3, 3, 3]  # too few documents: valid is empty


def test_splits_are_disjoint_document_ranges(wiki_shards, tmp_path):
    _, prefix = wiki_shards
    parts = [PackedDataset([prefix], seq_length=64, split=(8, 1, 1), part=p,
                           cache_dir=str(tmp_path)) for p in range(3)]
    assert [p.document_range for p in parts] == [(0, 322), (322, 362), (362, 402)]
    stream = _stream(prefix)
    np.testing.assert_array_equal(np.concatenate([_contents(p) for p in parts]), stream)


def test_sample_order_is_a_pure_function_of_seed_and_epoch(wiki_shards, tmp_path):
    n = 50
    k = np.arange(0, 120)
    a = sample_order(n, 7, k)
    assert sorted(a[:50].tolist()) == list(range(50))  # each epoch is a permutation
    assert not np.array_equal(a[:50], a[50:100])  # reshuffled per epoch
    np.testing.assert_array_equal(sample_order(n, 7, k[60:70]), a[60:70])
    assert not np.array_equal(sample_order(n, 8, k), a)
    # the dataset's cached order is the same permutation: default_rng([seed, epoch])
    _, prefix = wiki_shards
    ds = PackedDataset([prefix], seq_length=64, cache_dir=str(tmp_path))
    np.testing.assert_array_equal(ds.order(7, 1), sample_order(len(ds), 7, len(ds) + np.arange(len(ds))))
    np.testing.assert_array_equal(ds.order(7, 1), np.random.default_rng([7, 1]).permutation(len(ds)))


def _write_shard(prefix, docs):
    with ShardWriter(prefix, vocab_size=100) as w:
        for d in docs:
            w.add_document(d)


def test_index_is_cached_once_and_rebuilt_when_the_shards_change(tmp_path):
    prefix = str(tmp_path / "data" / "corpus")
    _write_shard(prefix, [np.arange(5, 5 + n) for n in (7, 3, 11, 5)])
    cache = tmp_path / "data" / "index-cache"
    first = PackedDataset([prefix], seq_length=6)
    files = sorted(p.name for p in cache.glob("*.npy"))
    assert len(files) == 2  # doc_starts + samples
    mtimes = {p: p.stat().st_mtime_ns for p in cache.glob("*.npy")}
    again = PackedDataset([prefix], seq_length=6)
    assert {p: p.stat().st_mtime_ns for p in cache.glob("*.npy")} == mtimes  # loaded, not built
    np.testing.assert_array_equal(_contents(again), _contents(first))
    assert isinstance(again._samples, np.ndarray) and again._samples.base is not None  # mmap

    _write_shard(prefix, [np.arange(40, 40 + n) for n in (2, 9)])  # new shard, same prefix
    changed = PackedDataset([prefix], seq_length=6)
    np.testing.assert_array_equal(_contents(changed), [40, 41, 2, *range(40, 49), 2])
    assert len(list(cache.glob("*.samples.npy"))) == 2  # a new index beside the old one


def test_a_shard_rewritten_with_its_size_and_mtime_kept_is_indexed_again(tmp_path):
    """``cp -p`` / ``rsync -t`` of other documents over a shard keep both files' sizes and
    mtimes: the cached index of the old documents' lengths must not be read for the new ones."""
    import os

    prefix = str(tmp_path / "corpus")
    _write_shard(prefix, [np.arange(5, 5 + n) for n in (7, 3, 11, 5)])
    old = PackedDataset([prefix], seq_length=6)
    times = {p: os.stat(p) for p in (f"{prefix}.bin", f"{prefix}.idx")}
    _write_shard(prefix, [np.arange(40, 40 + n) for n in (11, 5, 7, 3)])  # same sizes
    for p, st in times.items():
        assert os.path.getsize(p) == st.st_size
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    new = PackedDataset([prefix], seq_length=6)
    np.testing.assert_array_equal(_contents(new), _stream(prefix))  # every document whole
    np.testing.assert_array_equal(_contents(new)[:12], [*range(40, 51), 2])
    assert not np.array_equal(new._samples, old._samples)  # the new lengths' sample starts


def test_unwritable_cache_directory_falls_back_to_memory(wiki_shards, tmp_path):
    _, prefix = wiki_shards
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = PackedDataset([prefix], seq_length=64, cache_dir=str(blocker / "cache"))
        ds.order(1, 0)
    notes = [str(w.message) for w in caught if "--data-cache-path" in str(w.message)]
    assert len(notes) == 1 and str(blocker / "cache") in notes[0]
    np.testing.assert_array_equal(_contents(ds), _stream(prefix))


def test_data_parallel_ranks_split_the_global_batch(wiki_shards, tmp_path):
    _, prefix = wiki_shards
    ds = PackedDataset([prefix], seq_length=32, cache_dir=str(tmp_path))
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


def test_shards_without_tokens_are_a_clear_error(tmp_path):
    prefix = str(tmp_path / "empty")
    _write_shard(prefix, [[]])
    with pytest.raises(UserInputError, match="hold no tokens"):
        PackedDataset([prefix], seq_length=32, cache=False)
