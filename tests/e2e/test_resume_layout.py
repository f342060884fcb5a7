"""``--load`` of a checkpoint saved at another data-parallel size and ZeRO stage (TP 1, PP 1),
through the real ``deepspeed`` launcher: the resumed steps repeat the uninterrupted run's losses
and final fp32 weights within 1e-5 relative, in both directions (DP 2 ZeRO-3 → DP 1 ZeRO-1 and
DP 1 ZeRO-1 → DP 2 ZeRO-3), through DeepSpeed's universal checkpoint (training/reshard.py).

One uninterrupted run (DP 2, ZeRO-3, 6 steps, a checkpoint at 3) is the reference for both
directions: rtd_scale's samples, masks and sampling noise are functions of the global sample
index and step, and its losses are normalised over the global batch, so the run is the same at
every DP size (its DP 1 ZeRO-1 twin gives the same losses).
"""
from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.launcher import (NO_DROPOUT, assert_close, common, cut_back, file_digests,
                                    fp32_weights, launch, scalars)

pytestmark = pytest.mark.e2e

REL = 1e-5


def _args(wiki_shards, save, iters, zero, extra=()):
    args = common(wiki_shards, save, iters, [*NO_DROPOUT, *extra])
    args[args.index("--ds_config") + 1] = f"ds_configs/zero{zero}.json"
    return args


@pytest.fixture(scope="module")
def straight(wiki_shards, tmp_path_factory):
    """(run directory, TensorBoard scalars, fp32 weights at step 6) of the uninterrupted run."""
    run = tmp_path_factory.mktemp("layout") / "straight"
    r = launch(_args(wiki_shards, run, 6, 3), ranks=2)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return run, scalars(str(run / "tensorboard")), fp32_weights(run, "global_step6")


def _assert_continues(r, run, straight, was: str, now: str) -> float:
    """The resumed run converted once, then repeated steps 4–6 and the final weights; returns
    the conversion's seconds."""
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("converted ")]
    assert len(lines) == 1, lines
    m = re.fullmatch(rf"converted {re.escape(str(run))}/global_step3 from {re.escape(was)} to "
                     rf"{re.escape(now)} \(DeepSpeed universal checkpoint "
                     rf"{re.escape(str(run))}/global_step3_universal/global_step3\) in "
                     r"(\d+\.\d) s", lines[0])
    assert m, lines[0]
    assert f"resumed from {run} at iteration 3 (48 samples consumed)" in r.stdout
    ref_dir, ref, ref_weights = straight
    resumed = scalars(str(run / "tensorboard"))
    assert max(resumed["loss/mlm"]) == 6 and {4, 5, 6} <= set(resumed["loss/mlm"])
    for step in (4, 5, 6):
        for tag in ("loss/mlm", "loss/rtd", "optim/lr", "optim/grad_norm"):
            assert_close(resumed[tag][step], ref[tag][step], REL, (tag, step))
    weights = fp32_weights(run, "global_step6")
    assert sorted(weights) == sorted(ref_weights)
    for name, w in weights.items():
        scale = ref_weights[name].abs().max().item()
        assert torch.allclose(w, ref_weights[name], rtol=REL, atol=REL * scale), name
    assert not list(run.glob(".global_step3_universal.tmp-*"))  # renamed when complete
    assert (run / "global_step3_universal" / "global_step3" / "rtd_universal_complete").is_file()
    return float(m.group(1))


def test_zero3_two_ranks_resumes_at_zero1_one_rank_with_its_adam_moments(
        wiki_shards, straight, tmp_path):
    """DP 2 ZeRO-3 → DP 1 ZeRO-1; the original checkpoint's files stay byte-identical. Then the
    same resume with the conversion's AdamW moments zeroed (reused, not converted again):
    step 4 (the restored weights) still matches, step 5 (the first update) no longer does — the
    moments, not the weights alone, carried the continuation."""
    run = cut_back(straight[0], tmp_path / "z3_to_z1", 3)
    before = file_digests(run / "global_step3")
    r = launch(_args(wiki_shards, run, 6, 1, ["--load", str(run)]), ranks=1)
    seconds = _assert_continues(r, run, straight, "TP 1 × PP 1 × DP 2, ZeRO-3",
                                "TP 1 × PP 1 × DP 1, ZeRO-1")
    assert 0.0 < seconds < 120.0
    print(f"conversion of the DP 2 ZeRO-3 checkpoint: {seconds} s")
    assert file_digests(run / "global_step3") == before

    zeroed = cut_back(run, tmp_path / "zeroed_moments", 3)
    moments = list((zeroed / "global_step3_universal" / "global_step3" / "zero").glob(
        "*/exp_avg*.pt"))
    assert len(moments) > 20
    for path in moments:
        state = torch.load(path, weights_only=False)
        assert state["param"].abs().max() > 0, path  # what the conversion carried
        torch.save({"param": torch.zeros_like(state["param"])}, path)
    r = launch(_args(wiki_shards, zeroed, 6, 1, ["--load", str(zeroed)]), ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "reusing the conversion made earlier" in r.stdout
    ref, got = straight[1], scalars(str(zeroed / "tensorboard"))
    assert_close(got["loss/mlm"][4], ref["loss/mlm"][4], REL, "step 4")
    assert abs(got["loss/mlm"][5] - ref["loss/mlm"][5]) > 10 * REL * abs(ref["loss/mlm"][5])


def test_zero1_one_rank_resumes_at_zero3_two_ranks_exactly(wiki_shards, straight, tmp_path):
    """DP 1 ZeRO-1 (3 steps, saved at 3) → DP 2 ZeRO-3 to step 6: equals the DP 2 run."""
    run = tmp_path / "z1_to_z3"
    r = launch(_args(wiki_shards, run, 3, 1), ranks=1)
    assert r.returncode == 0, r.stderr[-3000:]
    before = file_digests(run / "global_step3")
    r = launch(_args(wiki_shards, run, 6, 3, ["--load", str(run)]), ranks=2)
    _assert_continues(r, run, straight, "TP 1 × PP 1 × DP 1, ZeRO-1",
                      "TP 1 × PP 1 × DP 2, ZeRO-3")
    assert file_digests(run / "global_step3") == before
