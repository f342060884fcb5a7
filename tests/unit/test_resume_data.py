"""A checkpoint records what its training shards hold (the SHA-256 of each ``.idx`` and ``.bin``,
``PackedDataset.shard_contents``, cached beside the sample index) and ``--load`` refuses other data
in one line naming the changed shard and ``--override-data-order`` (checkpoint/compat.py
``check_same_data``). The refusal through pretrain.py is in tests/e2e/test_resume_changes.py."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.blend import BlendedDataset
from rtd_scale.data.packed import PackedDataset
from rtd_scale.data.shards import ShardWriter
from rtd_scale.training.checkpoint.compat import check_same_data, data_change

DOCS = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31], [40, 41, 42, 43, 44, 45]]


def _write(prefix, docs) -> str:
    with ShardWriter(prefix, vocab_size=100) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def _data(prefix, cache, weights=(1.0,)) -> BlendedDataset:
    return BlendedDataset([PackedDataset([prefix], 8, cache_dir=str(cache))], list(weights),
                          seed=1)


def test_documents_swapped_in_place_change_the_fingerprint_a_moved_copy_does_not(tmp_path):
    prefix = _write(tmp_path / "a" / "corpus", DOCS)
    before = _data(prefix, tmp_path / "cache").state()
    (shard,) = before["shards"][0]
    assert shard["name"] == "corpus" and len(shard["bin_sha256"]) == 64

    copy = tmp_path / "b"
    shutil.copytree(tmp_path / "a", copy)
    assert data_change(before, _data(str(copy / "corpus"), tmp_path / "cache").state()) is None

    _write(prefix, [DOCS[1], DOCS[0], *DOCS[2:]])  # same lengths: only the .bin differs
    after = _data(prefix, tmp_path / "cache").state()
    assert after["shards"][0][0]["idx_sha256"] == shard["idx_sha256"]
    assert data_change(before, after) == (
        f"shard corpus holds other data than the checkpoint's corpus (its .bin differ: sha256 "
        f"{shard['bin_sha256'][:12]} → {after['shards'][0][0]['bin_sha256'][:12]})")

    _write(prefix, [DOCS[2], DOCS[0], DOCS[1], DOCS[3]])  # other lengths: both files
    assert "(its .idx and .bin differ" in data_change(before, _data(prefix, tmp_path / "c").state())


def test_the_hash_is_cached_by_the_files_stat_and_made_again_when_they_change(tmp_path,
                                                                             monkeypatch):
    from rtd_scale.data import packed

    monkeypatch.setattr(packed, "CONTENT_SETTLE_S", 0.0)  # files written just now are cached
    prefix = _write(tmp_path / "corpus", DOCS)
    cache = tmp_path / "cache"
    real = _data(prefix, cache).state()["shards"][0][0]
    (cached,) = [p for p in cache.iterdir() if p.name.endswith(".content.json")]
    assert json.loads(cached.read_text())["bin_sha256"] == real["bin_sha256"]
    cached.write_text(json.dumps({**real, "bin_sha256": "f" * 64}))
    # read from the cache, not hashed
    assert _data(prefix, cache).state()["shards"][0][0]["bin_sha256"] == "f" * 64
    os.utime(f"{prefix}.bin", ns=(1, 1))  # as a rewrite leaves it: another mtime, hashed again
    assert _data(prefix, cache).state()["shards"][0][0]["bin_sha256"] == real["bin_sha256"]


def test_bytes_rewritten_with_size_and_mtime_kept_are_hashed_again(tmp_path, monkeypatch):
    """A shard's .bin rewritten in place at the same length, its mtime then restored (as
    ``cp -p``, ``rsync -t`` and ``touch -r`` leave a file): the hash a resume compares is made
    from the new bytes, not taken from the cache (its key holds the files' ctime, which no tool
    sets back), and the change names the shard. A shard changed moments before its hashing is
    not cached at all (a later write could keep its ctime)."""
    from rtd_scale.data import packed

    prefix = _write(tmp_path / "corpus", DOCS)
    cache = tmp_path / "cache"
    _data(prefix, cache).state()
    assert not [p for p in cache.iterdir() if p.name.endswith(".content.json")]  # just written

    monkeypatch.setattr(packed, "CONTENT_SETTLE_S", 0.0)
    before = _data(prefix, cache).state()
    (cached,) = [p for p in cache.iterdir() if p.name.endswith(".content.json")]
    cached.write_text(json.dumps({**before["shards"][0][0], "bin_sha256": "f" * 64}))
    assert _data(prefix, cache).state()["shards"][0][0]["bin_sha256"] == "f" * 64  # the cache
    stat = os.stat(f"{prefix}.bin")
    with open(f"{prefix}.bin", "r+b") as f:  # tokens 10 and 11 swapped: same length, same ids
        data = bytearray(f.read())
        width = len(data) // sum(map(len, DOCS))
        data[:2 * width] = data[width:2 * width] + data[:width]
        f.seek(0)
        f.write(data)
    os.utime(f"{prefix}.bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    now = os.stat(f"{prefix}.bin")
    assert (now.st_size, now.st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    after = _data(prefix, cache).state()
    old = before["shards"][0][0]["bin_sha256"]
    assert after["shards"][0][0]["bin_sha256"] not in ("f" * 64, old)
    assert data_change(before, after) == (
        f"shard corpus holds other data than the checkpoint's corpus (its .bin differ: sha256 "
        f"{before['shards'][0][0]['bin_sha256'][:12]} → "
        f"{after['shards'][0][0]['bin_sha256'][:12]})")


def test_other_data_is_refused_in_one_line_unless_overridden(tmp_path):
    prefix = _write(tmp_path / "corpus", DOCS)
    saved = _data(prefix, tmp_path / "cache").state()
    _write(prefix, [DOCS[1], DOCS[0], *DOCS[2:]])
    data = _data(prefix, tmp_path / "cache")
    with pytest.raises(UserInputError) as e:
        check_same_data("runs/x", "global_step2", saved, data, override=False, consumed=32)
    assert str(e.value).startswith("--load runs/x: global_step2 was trained on other data: "
                                   "shard corpus holds other data than the checkpoint's corpus")
    assert str(e.value).endswith("; restore the data it was trained on, or pass "
                                 "--override-data-order to continue on these data, their order "
                                 "starting at global sample 32 where the run resumes")
    assert check_same_data("runs/x", "global_step2", saved, data, override=True,
                           consumed=32) is None


def test_an_edited_blend_is_other_data_and_a_longer_sequence_is_not(tmp_path):
    a, b = (_write(tmp_path / n, DOCS) for n in ("a", "b"))
    cache = tmp_path / "cache"

    def blend(weights):
        return BlendedDataset([PackedDataset([p], 8, cache_dir=str(cache)) for p in (a, b)],
                              weights, seed=1)

    saved = blend([0.5, 0.5]).state()
    assert data_change(saved, blend([0.7, 0.3]).state()) == (
        "the blend weights of --data-path 0.5 0.5 → 0.7 0.3")
    assert data_change(saved, _data(a, cache).state()) == (
        "--data-path blends 1 dataset(s), the checkpoint's 2")
    longer = BlendedDataset([PackedDataset([p], 16, cache_dir=str(cache)) for p in (a, b)],
                            [0.5, 0.5], seed=1)
    assert data_change(saved, longer.state()) is None


def test_a_checkpoint_without_a_fingerprint_resumes_with_a_note(tmp_path):
    data = _data(_write(tmp_path / "corpus", DOCS), tmp_path / "cache")
    old = {k: v for k, v in data.state().items() if k != "shards"}
    assert check_same_data("runs/x", "global_step2", old, data, override=False, consumed=0) == (
        "note: global_step2 records no fingerprint of its training data (saved before "
        "checkpoints recorded one), so the shards could not be checked against it; the next "
        "checkpoint records one")
    assert check_same_data("runs/x", "global_step2", None, data, override=False,
                           consumed=0).startswith("note: global_step2 records no fingerprint")
