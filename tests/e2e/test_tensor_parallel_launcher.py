"""TP=2 × DP=2 with ZeRO-3 against TP=1 × DP=1 without ZeRO, through `deepspeed
rtd_scale/pretrain.py`, reading both runs' TensorBoard scalars; save and resume at TP=2 × DP=2."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import dist as harness, dist_workers as workers
from tests.helpers.launcher import NO_DROPOUT, assert_resume_continues, launch, scalars

pytestmark = pytest.mark.e2e

def _args(wiki_shards, save, ds_config, iters, tp, extra=()):
    tok, prefix = wiki_shards
    return ["--ds_config", ds_config, "--preset", "tiny", "--data-path", prefix,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", str(iters),
            "--seq-length", "64", "--micro-batch-size", "8", "--global-batch-size", "16",
            "--lr", "1e-3", "--lr-warmup-iters", "5", "--lr-decay-iters", "20",
            "--log-interval", "1",
            "--save-interval", "5", "--seed", "5", "--tensor-model-parallel-size", str(tp),
            *NO_DROPOUT, *extra]


def test_tp2_dp2_zero3_matches_tp1_and_resumes_exactly(wiki_shards, tmp_path):
    ref_dir, tp_dir, res_dir = tmp_path / "tp1", tmp_path / "tp2", tmp_path / "tp2_resumed"
    r = launch(_args(wiki_shards, ref_dir, "ds_configs/zero0.json", 20, 1,
                     ["--export", str(ref_dir / "model.pt")]), ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(_args(wiki_shards, tp_dir, "ds_configs/zero3.json", 20, 2,
                     ["--export", str(tp_dir / "model.pt")]), ranks=4)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world 4 = TP 2 × PP 1 × DP 2" in r.stdout and "ZeRO stage 3" in r.stdout
    ref, tp = scalars(str(ref_dir / "tensorboard")), scalars(str(tp_dir / "tensorboard"))
    assert sorted(tp["loss/total"]) == list(range(1, 21))
    for tag in ("loss/mlm", "loss/rtd", "loss/total"):
        for step in range(1, 21):
            assert tp[tag][step] == pytest.approx(ref[tag][step], rel=1e-4), (tag, step)
    assert ref["loss/mlm"][20] < ref["loss/mlm"][1]  # it trained

    # the consolidated export of the ZeRO-3, TP=2 run is TP-agnostic: every parameter, the
    # TP=1 names and shapes, the same values as the TP=1 run's, and a strict load at TP=1
    exp_tp1 = torch.load(ref_dir / "model.pt")
    exp_tp2 = torch.load(tp_dir / "model.pt")
    assert exp_tp2["model"].keys() == exp_tp1["model"].keys()
    for name, w in exp_tp1["model"].items():
        assert exp_tp2["model"][name].shape == w.shape, name
        assert (exp_tp2["model"][name] - w).abs().max().item() < 1e-3, name
    assert exp_tp2["model"]["generator.embeddings.table.weight"].shape[0] == 1000  # unpadded
    harness.run(workers.load_export, str(tp_dir / "model.pt"), world_size=1, tp=1)

    # save at TP=2 × DP=2 (step 5), resume: the next 5 losses equal the uninterrupted run's
    assert_resume_continues(
        lambda iters, extra: _args(wiki_shards, res_dir, "ds_configs/zero3.json", iters, 2, extra),
        tp, ranks=4, save_dir=res_dir,
        straight_dir=tp_dir)
