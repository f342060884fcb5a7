"""The data flags through the entry point: a blended --data-path run through the launcher, and
one-line errors for bad --data-path / --split values."""
from __future__ import annotations

import pytest

from rtd_scale.data.shards import resolve_data_path
from rtd_scale.training import digest
from tests.helpers.launcher import pretrain_error
from tests.helpers.launcher import launch, scalars

pytestmark = pytest.mark.e2e


def _args(tok, data_path, save, *extra):
    return ["--ds_config", "ds_configs/zero0.json", "--preset", "tiny", "--data-path", *data_path,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", "3",
            "--seq-length", "64", "--micro-batch-size", "5", "--global-batch-size", "10",
            "--log-interval", "1", *extra]


def test_blended_data_path_with_validation_and_a_cache_directory(wiki_shards, tmp_path):
    tok, prefix = wiki_shards
    shard = resolve_data_path(prefix)[0]  # the same corpus as a second dataset, by its shard
    cache = tmp_path / "cache"
    r = launch(_args(tok, ["0.8", prefix, "0.2", shard], tmp_path / "run", "--split", "90,10", "--eval-interval", "3", "--eval-iters", "1",
                     "--data-cache-path", str(cache), "--data-digest",
                     str(tmp_path / "digest.jsonl")), ranks=1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "rtd_scale: preset tiny, sharing gdes, bert attention, pre-LN layers, " in r.stdout
    assert "data train: 0.8 × wiki_text_document (" in r.stdout
    assert " + 0.2 × wiki_text_document_00000 (" in r.stdout
    assert "data valid: 0.8 × wiki_text_document" in r.stdout
    assert r.stdout.count(" validation at iteration        3 ") == 1
    assert sorted(scalars(str(tmp_path / "run" / "tensorboard"))["valid/loss/total"]) == [3]
    assert len(list(cache.glob("*.samples.npy"))) == 4  # (2 datasets) × (train, valid)
    rows = digest.read(str(tmp_path / "digest.jsonl"))
    datasets = [d for step in (1, 2, 3) for d, _ in rows[step]["samples"]]
    assert datasets == [0, 0, 1, 0, 0] * 6  # 8:2 in every period of 5, interleaved


def _error(capsys, argv, monkeypatch) -> str:
    return pretrain_error(capsys, argv, monkeypatch, world_size=1)


def test_bad_data_flags_are_one_line_errors(wiki_shards, tmp_path, capsys, monkeypatch):
    tok, prefix = wiki_shards
    msg = _error(capsys, _args(tok, ["0.5", prefix, "0.5"], tmp_path / "a"), monkeypatch)
    assert "--data-path 0.5" in msg and "WEIGHT PREFIX pairs (e.g. --data-path 0.7 A 0.3 B)" in msg
    msg = _error(capsys, _args(tok, [prefix], tmp_path / "b", "--split", "0,1"), monkeypatch)
    assert "--split '0,1'" in msg and "positive train share" in msg
    msg = _error(capsys, _args(tok, [prefix], tmp_path / "c", "--split", "99999,1",
                               "--eval-interval", "1"), monkeypatch)
    assert "leaves no valid documents in --data-path wiki_text_document" in msg
    assert "--eval-iters 0" in msg
    msg = _error(capsys, _args(tok, [str(tmp_path / "nothing")], tmp_path / "d"), monkeypatch)
    assert f"--data-path {tmp_path / 'nothing'}: neither a shard" in msg
    assert not any((tmp_path / n).exists() for n in "abcd")
