"""Bad input to the entry point: one line naming the thing and the fix, exit 1, nothing written."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rtd_scale import pretrain
from tests.conftest import REPO, TEST_DATA
from tests.e2e.test_pretrain_launcher import launch


def _args(wiki_shards, save, *extra):
    tok, prefix = wiki_shards
    return ["--ds_config", "ds_configs/zero3.json", "--data-path", prefix, "--tokenizer-model",
            tok, "--save", str(save), "--train-iters", "2", "--micro-batch-size", "4",
            "--global-batch-size", "8", *extra]


def _error(capsys, argv, monkeypatch) -> str:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert pretrain.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_ds_config_contradicting_the_flags(wiki_shards, tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 3}}))
    save = tmp_path / "run"
    argv = _args(wiki_shards, save)
    argv[1] = str(cfg)
    msg = _error(capsys, argv, monkeypatch)
    assert f"--ds_config {cfg}: train_batch_size=64 contradicts --global-batch-size" in msg
    assert not save.exists()


def test_load_without_checkpoint(wiki_shards, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    save = tmp_path / "run"
    msg = _error(capsys, _args(wiki_shards, save, "--load", str(empty)), monkeypatch)
    assert f"--load {empty}: no checkpoint found" in msg and "drop --load" in msg
    assert not save.exists()


def test_tokenizer_that_does_not_match_the_shards(wiki_shards, tmp_path, capsys, monkeypatch):
    other = tmp_path / "other"
    subprocess.run([sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input",
                    str(TEST_DATA / "wiki_sample.jsonl"), "--vocab-size", "600",
                    "--output-prefix", str(other)], check=True, capture_output=True)
    argv = _args(wiki_shards, tmp_path / "run")
    argv[5] = str(other) + ".model"
    msg = _error(capsys, argv, monkeypatch)
    assert wiki_shards[1] in msg and "tokenizer" in msg
    assert not (tmp_path / "run").exists()


def test_missing_shards_and_bad_batch(wiki_shards, tmp_path, capsys, monkeypatch):
    argv = _args(wiki_shards, tmp_path / "run")
    argv[3] = str(tmp_path / "nope_text_document")
    assert "nope_text_document" in _error(capsys, argv, monkeypatch)
    argv = _args(wiki_shards, tmp_path / "run", "--global-batch-size", "12")
    assert "--global-batch-size 12 is not divisible by --micro-batch-size 4" in _error(
        capsys, argv, monkeypatch)


def test_launcher_reports_a_user_error_without_traceback(wiki_shards, tmp_path):
    r = launch(_args(wiki_shards, tmp_path / "run", "--load", str(tmp_path / "missing")))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout
    assert f"error: --load {tmp_path / 'missing'}: no such directory" in r.stderr + r.stdout
