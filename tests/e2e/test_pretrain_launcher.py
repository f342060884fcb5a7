"""The real entry point through the real `deepspeed` launcher: 2 ranks, gloo, ZeRO-3."""
from __future__ import annotations

import json

import pytest

from rtd_scale.training import digest
from tests.helpers.images import png_size
from tests.helpers.launcher import (TAGS, common, launch, memory_estimate_and_peak,
                                   repeated_lines, scalars)

pytestmark = pytest.mark.e2e


def test_zero3_two_ranks_train_checkpoint_and_resume_exactly(wiki_shards, tmp_path):
    """Also resume exactness: 6 steps straight against 3, save, --load, 3 more — the same sample
    ids, masks and losses, bitwise (the --data-digest lines), whatever the number of loader workers;
    validation in between changes nothing in training and repeats its own losses exactly."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    r = launch(common(wiki_shards, straight, 6, [
        "--data-digest", str(straight / "digest.jsonl"), "--num-workers", "2",
        "--eval-interval", "2", "--eval-iters", "1"]))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ZeRO stage 3" in r.stdout and "world 2 = TP 1 × PP 1 × DP 2" in r.stdout
    assert "micro-batch 4 × accumulation 2 × DP 2 = global 16" in r.stdout
    assert "data train: 1 × wiki_text_document" in r.stdout
    # memory per rank (rtd_scale/memory.py): the estimate at start names ZeRO-3's parts and the
    # runtime; the largest rank's measured peak (resident size) is within 20% of it
    estimate, peak = memory_estimate_and_peak(r.stdout)
    assert "ZeRO-3 live parameters" in r.stdout and "not ours runtime" in r.stdout
    assert abs(peak / estimate - 1) <= 0.2, (estimate, peak)
    assert r.stdout.count("peak memory per rank (GB): ") == 6  # every log line
    assert r.stdout.count(" validation at iteration ") == 3
    assert repeated_lines(r) == {}  # each line from one rank (tests/e2e/test_offload_fp16.py too)
    s = scalars(str(straight / "tensorboard"))
    assert TAGS <= set(s)
    assert sorted(s["loss/total"]) == [1, 2, 3, 4, 5, 6]
    peaks = [s["memory/peak_gb"][k] for k in sorted(s["memory/peak_gb"])]
    assert peaks == sorted(peaks) and 0 < peaks[0] and peaks[-1] <= peak + 0.01  # a running max
    assert sorted(s["valid/loss/mlm"]) == [2, 4, 6]
    assert {"valid/loss/rtd", "valid/loss/total", "valid/mlm/accuracy"} <= set(s)
    # GDES: E_D = E_G + E_Δ starts equal to E_G (row-wise cosine 1, the same Table-1 average),
    # then E_Δ moves it (ZeRO-3 gathered)
    cos = s["embedding/rowwise_cosine_generator_discriminator"]
    assert cos[1] == pytest.approx(1.0, abs=1e-3) and 0.0 < cos[6] < 1.0
    avg_g, avg_d = s["embedding/avg_cosine_generator"], s["embedding/avg_cosine_discriminator"]
    assert avg_d[1] == pytest.approx(avg_g[1], abs=1e-3) and avg_d[6] != avg_g[6]
    assert all(-0.1 < v < 0.5 for v in list(avg_g.values()) + list(avg_d.values()))
    # the held-out AUC: in the validation line and TensorBoard at every validation
    auc = s["valid/rtd/auc"]
    assert sorted(auc) == [2, 4, 6] and all(0.0 < v < 1.0 for v in auc.values())
    assert r.stdout.count(" | rtd auc: ") == 3
    for step, v in s["loss/total"].items():
        assert v == v and abs(v) < 1e4, (step, v)  # finite
        assert v == pytest.approx(s["loss/mlm"][step] + 50.0 * s["loss/rtd"][step], rel=1e-5)
    # with accumulation 2 on 2 ranks: warm-up counts optimizer steps; megatron-core's
    # scheduler starts at 0 and reaches the peak at the step after the 4 warm-up steps
    assert [round(s["optim/lr"][k] / 1e-3, 6) for k in (1, 2, 3, 4, 5, 6)] == [
        0.0, 0.25, 0.5, 0.75, 1.0, 0.5]
    # the run directory holds the resolved configs, written before step 1
    cfg = json.loads((straight / "config.json").read_text())
    ds = json.loads((straight / "ds_config.json").read_text())
    assert cfg["preset"] == "tiny" and cfg["model"]["vocab_size"] == 1000
    assert ds["gradient_accumulation_steps"] == 2 and ds["zero_optimization"]["stage"] == 3
    assert (straight / "latest").read_text().strip() == "global_step6"
    # the summary draws the run's curves into --save (rtd_scale.training.curves)
    assert f"\n  curves:      {straight}/curves.png\n" in r.stdout
    assert png_size(straight / "curves.png") == (1500, 860)
    assert (straight / "global_step3").is_dir()
    a = digest.read(str(straight / "digest.jsonl"))
    assert sorted(a) == [1, 2, 3, 4, 5, 6]
    for step, row in a.items():  # step t reads global samples [16(t-1), 16t), both ranks
        assert row["sample_index"] == list(range(16 * (step - 1), 16 * step))
        assert len(row["losses"]) == 4  # 2 micro-batches × 2 ranks
    assert len({row["masks_sha256"] for row in a.values()}) == 6

    # 3 steps (no validation, no workers), then --load: continues at step 4 and repeats the
    # straight run exactly
    r = launch(common(wiki_shards, resumed, 3, [
        "--data-digest", str(resumed / "digest.jsonl"), "--num-workers", "0",
        "--eval-iters", "0"]))
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(common(wiki_shards, resumed, 6, [
        "--load", str(resumed), "--data-digest", str(resumed / "digest.jsonl"),
        "--num-workers", "1", "--eval-interval", "2", "--eval-iters", "1"]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "at iteration 3" in r.stdout
    first_line = next(l for l in r.stdout.splitlines() if l.strip().startswith("iteration"))
    assert first_line.split()[1] == "4/"
    b = digest.read(str(resumed / "digest.jsonl"))
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in range(1, 7):  # sample ids, inputs, masks and per-micro-batch losses, bitwise
        assert b[step] == a[step], step
    s2 = scalars(str(resumed / "tensorboard"))
    for step in (4, 5, 6):
        assert s2["loss/mlm"][step] == s["loss/mlm"][step]
        assert s2["loss/rtd"][step] == s["loss/rtd"][step]
    for step in (4, 6):  # the same validation samples and masks each time: comparable losses
        for tag in ("valid/loss/mlm", "valid/loss/rtd"):
            assert s2[tag][step] == s[tag][step], (tag, step)
    assert s["valid/loss/mlm"][2] != s["valid/loss/mlm"][6]  # the model moved, the data did not
