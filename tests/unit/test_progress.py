"""Progress of the sample-index build (rtd_scale/data/packed.py), a long silent step, with a
zero interval, so every step prints. tools/train_tokenizer.py's progress, seen from its command,
is in tests/tools/test_tokenizer_progress.py."""
from __future__ import annotations

import re

from rtd_scale.data import packed
from rtd_scale.data.packed import PackedDataset


def test_sample_index_build_prints_progress_then_nothing_on_a_cache_hit(wiki_shards, tmp_path,
                                                                        capsys, monkeypatch):
    _, prefix = wiki_shards
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(packed, "PROGRESS_INTERVAL_S", 0.0)
    ds = PackedDataset([prefix], seq_length=64, cache_dir=str(tmp_path))
    err = capsys.readouterr().err.splitlines()
    name, shards, n = "wiki_text_document", len(ds.shards), ds.num_samples
    what = re.escape(f"the sample index of {name} (train)")
    assert err[:shards] == [x for x in err if "shard indices read" in x]
    assert re.fullmatch(rf"building {what}: {shards} of {shards} shard indices read \(\d+ s\)",
                        err[shards - 1])
    assert re.fullmatch(rf"building {what}: {n + 1:,} of {n + 1:,} sample starts \(\d+ s\)", err[-2])
    assert re.fullmatch(rf"built {what}: {n:,} samples of {ds.num_documents:,} documents in \d+ s",
                        err[-1])
    ds.order(seed=1, epoch=0)
    assert re.fullmatch(rf"built the order of {name} \(train\), epoch 0: {n:,} samples shuffled "
                        r"in \d+ s\n", capsys.readouterr().err)
    PackedDataset([prefix], seq_length=64, cache_dir=str(tmp_path)).order(seed=1, epoch=0)
    assert capsys.readouterr().err == ""  # everything came from the cache


def test_sample_index_progress_only_on_rank_0_and_only_for_long_builds(wiki_shards, tmp_path,
                                                                       capsys, monkeypatch):
    _, prefix = wiki_shards
    monkeypatch.setattr(packed, "PROGRESS_INTERVAL_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    PackedDataset([prefix], seq_length=64, cache_dir=str(tmp_path / "a"))
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(packed, "PROGRESS_INTERVAL_S", 10.0)  # the default: a quick build is quiet
    PackedDataset([prefix], seq_length=64, cache_dir=str(tmp_path / "b"))
    assert capsys.readouterr().err == ""
