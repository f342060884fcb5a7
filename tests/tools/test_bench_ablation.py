"""bench/sharing_ablation.py end to end at toy size: three real single-process pretraining runs,
exports, held-out measurements, the POS probe on tests/data/pos_sample instead of the npm
download."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers.env import REPO, standalone_env

POS_SAMPLE = REPO / "tests" / "data" / "pos_sample"


@pytest.mark.e2e
def test_ablation_end_to_end_toy(tmp_path):
    pytest.importorskip("transformers")
    work = tmp_path / "work"
    cmd = [sys.executable, str(REPO / "bench" / "sharing_ablation.py"),
           "--corpus", str(REPO / "tests" / "data" / "wiki_sample.jsonl"), "--work-dir", str(work),
           "--corpus-mb", "0.15", "--vocab-size", "1000", "--heldout-docs", "20",
           "--heldout-seqs", "4", "--ranks", "1", "--steps", "2", "--seq-length", "32",
           "--micro-batch-size", "4", "--global-batch-size", "4", "--warmup", "1",
           "--log-interval", "1", "--save-interval", "2", "--eval-interval", "2",
           "--eval-iters", "1", "--brown-dir", str(POS_SAMPLE), "--probe-train-sentences", "16",
           "--probe-test-sentences", "3", "--probe-finetune-steps", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=standalone_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((work / "ablation.json").read_text())
    assert list(out["results"]) == ["es", "nes", "gdes"]
    for mode, r in out["results"].items():
        for key in ("avg_cosine_generator", "avg_cosine_discriminator", "heldout_mlm",
                    "heldout_rtd", "heldout_auc"):
            assert math.isfinite(r[key]), (mode, key)
        assert -1 <= r["avg_cosine_generator"] <= 1
        assert r["heldout_tokens"] == 4 * 32
        assert r["run_validation"]["step"] == 2 and math.isfinite(r["run_validation"]["mlm"])
        for kind in ("discriminator", "generator"):
            for what in ("linear", "finetune"):
                assert 0 <= r["probe"][kind][what] <= 1
    # ES: one table, so the two cosines are the same number; the others have two tables
    es = out["results"]["es"]
    assert es["avg_cosine_generator"] == es["avg_cosine_discriminator"]
    assert out["results"]["nes"]["avg_cosine_generator"] != out["results"]["nes"]["avg_cosine_discriminator"]
    assert 0 <= out["random_init_probe"]["linear"] <= 1
    table = (work / "table.md").read_text()
    assert all(f"| {m} |" in table for m in ("ES", "NES", "GDES"))
    assert "NES generator cosine > ES generator cosine" in table and "GDES discriminator" in table
    assert table in proc.stdout
    # a second run finds everything done: no pretraining command is issued again
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                           env=standalone_env())
    assert again.returncode == 0, again.stderr[-2000:]
    assert "rtd_scale/pretrain.py" not in again.stdout and "training skipped" in again.stdout
