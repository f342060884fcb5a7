"""bench/step_vs_hf.py at test size on CPU, so that the benchmark keeps working (no timing is
asserted: it is informational)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.env import REPO, standalone_env

pytest.importorskip("transformers")


def test_step_vs_hf_tiny_run(tmp_path):
    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "step_vs_hf.py"), "--tiny", "--device", "cpu",
         "--rounds", "2", "--steps-per-round", "1", "--warmup", "1", "--profile-steps", "1",
         "--seq-length", "32", "--micro-batch", "4", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env=standalone_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| dims" in proc.stdout and "ours/HF" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert [r["dims"] for r in results] == ["electra-small", "debertav3-xsmall"]
    for r in results:
        assert len(r["times_ms"]["ours"]["wall"]) == len(r["times_ms"]["hf"]["wall"]) == 2
        assert r["ours_ms"] > 0 and r["hf_ms"] > 0
        assert r["ratio"] == pytest.approx(r["ours_ms"] / r["hf_ms"])
        split = r["split"]
        assert sum(split.values()) == pytest.approx(1.0)
        # every named part of rtd_scale's step was found in the profile
        for part in ("encoders", "mlm head + loss", "sampling", "masking", "discriminator head",
                     "optimizer"):
            assert split[part] > 0, part
        assert split["encoders"] > split["masking"]
    # the presets' shapes: ELECTRA narrow generator with ES, DeBERTaV3 GDES
    assert results[0]["shape"].endswith("ES") and results[1]["shape"].endswith("GDES")
