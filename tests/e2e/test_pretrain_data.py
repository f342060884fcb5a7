"""The data flags through the entry point: a blended --data-path run through the launcher (which
also validates the final model when the last step is off --eval-interval), and one-line errors
for bad --data-path / --split values."""
from __future__ import annotations

import pytest

from rtd_scale.data.shards import resolve_data_path
from rtd_scale.training import digest
from tests.helpers.launcher import pretrain_error
from tests.helpers.launcher import launch, scalars

pytestmark = pytest.mark.e2e


def _args(tok, data_path, save, *extra, iters=3):
    return ["--ds_config", "ds_configs/zero0.json", "--preset", "tiny", "--data-path", *data_path,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", str(iters),
            "--seq-length", "64", "--micro-batch-size", "5", "--global-batch-size", "10",
            "--log-interval", "1", *extra]


def test_blended_data_path_with_validation_and_a_cache_directory(wiki_shards, tmp_path):
    """Also the final model's validation: with --train-iters 5 --eval-interval 2 the run
    validates at 2, 4 and, once more, after its last step, 5 (as Megatron-LM does at the end of
    pretraining); the summary's held-out AUC and verdict are step 5's, not step 4's."""
    tok, prefix = wiki_shards
    shard = resolve_data_path(prefix)[0]  # the same corpus as a second dataset, by its shard
    cache = tmp_path / "cache"
    r = launch(_args(tok, ["0.8", prefix, "0.2", shard], tmp_path / "run", "--split", "90,10", "--eval-interval", "2", "--eval-iters", "2",
                     "--data-cache-path", str(cache), "--data-digest",
                     str(tmp_path / "digest.jsonl"), iters=5), ranks=1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "rtd_scale: preset tiny, sharing gdes, bert attention, pre-LN layers, " in r.stdout
    assert "data train: 0.8 × wiki_text_document (" in r.stdout
    assert " + 0.2 × wiki_text_document_00000 (" in r.stdout
    assert "data valid: 0.8 × wiki_text_document" in r.stdout
    valid = {int(line.split("|")[0].split()[-1]): line.split("rtd auc: ")[1].split()[0]
             for line in r.stdout.splitlines() if line.startswith(" validation at iteration ")}
    assert sorted(valid) == [2, 4, 5]
    tb = scalars(str(tmp_path / "run" / "tensorboard"))
    assert sorted(tb["valid/loss/total"]) == sorted(tb["valid/rtd/auc"]) == [2, 4, 5]
    assert valid[5] != valid[4]  # the final model's AUC is another value: the summary shows whose
    summary = r.stdout[r.stdout.index("RTD pretraining summary"):]
    assert f"  held-out RTD AUC {valid[5]} at iteration 5 (0.5 = chance, " in summary
    assert f"; {valid[2]} at iteration 2, " in summary
    assert "(iteration 2) → " in summary and " (iteration 5), L_RTD " in summary
    assert "\n  verdict: " in summary
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
    assert "--split (data.split) '0,1'" in msg and "positive train share" in msg
    msg = _error(capsys, _args(tok, [prefix], tmp_path / "c", "--split", "99999,1",
                               "--eval-interval", "1"), monkeypatch)
    assert "leaves no valid documents in --data-path wiki_text_document" in msg
    assert "--eval-iters 0" in msg
    msg = _error(capsys, _args(tok, [str(tmp_path / "nothing")], tmp_path / "d"), monkeypatch)
    assert f"--data-path {tmp_path / 'nothing'}: neither a shard" in msg
    assert not any((tmp_path / n).exists() for n in "abcd")
