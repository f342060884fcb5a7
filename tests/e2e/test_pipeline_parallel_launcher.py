"""PP=2 × DP=2 with ZeRO-1 against PP=1 × DP=1, through `deepspeed rtd_scale/pretrain.py`,
reading both runs' TensorBoard scalars (training and validation); save and resume at PP=2
continue exactly."""
from __future__ import annotations

import pytest

from tests.helpers.launcher import assert_resume_continues, launch, scalars
from tests.helpers.launcher import NO_DROPOUT

pytestmark = pytest.mark.e2e


def _args(wiki_shards, save, ds_config, iters, pp, extra=()):
    tok, prefix = wiki_shards
    return ["--ds_config", ds_config, "--preset", "tiny", "--data-path", prefix,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", str(iters),
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--lr", "1e-3", "--lr-warmup-iters", "5", "--lr-decay-iters", "20",
            "--log-interval", "1", "--save-interval", "5", "--seed", "5",
            "--eval-interval", "10", "--eval-iters", "1",
            "--pipeline-model-parallel-size", str(pp), *NO_DROPOUT, *extra]


def test_pp2_dp2_zero1_matches_pp1_and_resumes_exactly(wiki_shards, tmp_path):
    ref_dir, pp_dir, res_dir = tmp_path / "pp1", tmp_path / "pp2", tmp_path / "pp2_resumed"
    r = launch(_args(wiki_shards, ref_dir, "ds_configs/zero0.json", 20, 1), ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(_args(wiki_shards, pp_dir, "ds_configs/zero1.json", 20, 2), ranks=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 4 = TP 1 × PP 2 × DP 2" in r.stdout and "ZeRO stage 1" in r.stdout
    ref, pp = scalars(str(ref_dir / "tensorboard")), scalars(str(pp_dir / "tensorboard"))
    assert sorted(pp["loss/total"]) == list(range(1, 21))
    for tag in ("loss/mlm", "loss/rtd", "loss/total"):
        for step in range(1, 21):
            assert pp[tag][step] == pytest.approx(ref[tag][step], rel=1e-4), (tag, step)
    for tag in ("valid/loss/mlm", "valid/loss/rtd"):  # validation: forward-only 1F1B at PP=2
        assert sorted(pp[tag]) == [10, 20]
        for step in (10, 20):
            assert pp[tag][step] == pytest.approx(ref[tag][step], rel=1e-4), (tag, step)
    for step in (10, 20):  # the held-out AUC, gathered over DP on the last stage
        assert pp["valid/rtd/auc"][step] == pytest.approx(ref["valid/rtd/auc"][step], abs=1e-3)
    for step in (1, 10, 20):  # DeepSpeed's global gradient norm counts the tied table once
        assert pp["optim/grad_norm"][step] == pytest.approx(ref["optim/grad_norm"][step],
                                                            rel=1e-4)

    assert_resume_continues(
        lambda iters, extra: _args(wiki_shards, res_dir, "ds_configs/zero1.json", iters, 2, extra),
        pp, ranks=4, save_dir=res_dir,
        straight_dir=pp_dir)


def test_pipeline_rejects_zero3(wiki_shards, tmp_path):
    r = launch(_args(wiki_shards, tmp_path / "x", "ds_configs/zero3.json", 2, 2), ranks=2)
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
    assert "ZeRO stage 3 with --pipeline-model-parallel-size 2 is not supported" in r.stderr
    assert not (tmp_path / "x").exists()
