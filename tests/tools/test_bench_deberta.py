"""bench/deberta_step_vs_hf.py run as a script at test size on CPU, so that the DeBERTa
benchmark keeps working (no time is asserted)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")


@pytest.mark.parametrize("precision, rows", [
    ([], {"ours:explicit", "ours:sdpa", "hf"}),
    # the GPU command's path: ours with bf16 parameters, as pretrain.py --bf16 trains (its
    # autocast rows need CUDA: megatron-core's linear layers autocast their backward there only)
    (["--bf16", "--relative-terms", "gather,shift"],
     {"ours:explicit", "ours:explicit/shift", "ours:sdpa", "ours:sdpa/shift", "hf"}),
])
def test_deberta_bench_tiny_run(tmp_path, precision, rows):
    """bench/deberta_step_vs_hf.py at test size on CPU keeps working (no time is asserted)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers.env import standalone_env

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "deberta.json"
    proc = subprocess.run(
        [sys.executable, str(repo / "bench" / "deberta_step_vs_hf.py"), "--tiny", "--batch", "2",
         "--seq", "24", "--rounds", "1", "--steps-per-round", "1", "--warmup", "1",
         "--json", str(out), *precision],
        cwd=repo, capture_output=True, text=True, timeout=900, env=standalone_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| ours:explicit |" in proc.stdout and "| hf |" in proc.stdout
    res = json.loads(out.read_text())
    assert set(res["rows"]) == rows and res["bf16"] == bool(precision)
    for row in res["rows"].values():
        assert row["ms"] > 0 and row["tokens_per_s"] == pytest.approx(48 / row["ms"] * 1e3)
    assert res["rows"]["hf"]["ratio"] == 1.0
