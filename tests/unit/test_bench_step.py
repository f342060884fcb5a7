"""bench/step_vs_hf.py at test size on CPU, so that the benchmark keeps working (no timing is
asserted: it is informational)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
from tests.helpers.env import standalone_env  # noqa: E402

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


def test_bf16_master_steps_fp32_copies_and_writes_them_back():
    """step_vs_hf.BF16Master (what the DeBERTa bench times as pretrain.py --bf16 trains): the
    model computes in bf16; AdamW steps fp32 masters on the bf16 gradients, exactly as an fp32
    AdamW on the same gradients, and the model gets the masters rounded to bf16."""
    import copy
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("step_vs_hf", REPO / "bench" / "step_vs_hf.py")
    svh = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = svh
    spec.loader.exec_module(svh)
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    opt = svh.BF16Master(lin, torch.optim.AdamW(lin.parameters(), lr=0.1))
    assert lin.weight.dtype == torch.bfloat16 and lin.bias.dtype == torch.bfloat16
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for _ in range(2):
        lin(torch.randn(5, 4).bfloat16()).float().pow(2).sum().backward()
        for p, r in zip(lin.parameters(), ref.parameters()):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for (p, master), r in zip(opt.pairs, ref.parameters()):
            assert master.dtype == torch.float32 and torch.equal(master, r.detach())
            assert torch.equal(p.detach(), r.detach().bfloat16())
        opt.zero_grad()
        assert all(p.grad is None and m.grad is None for p, m in opt.pairs)
    assert not torch.equal(ref.weight, copy.deepcopy(lin).float().weight)  # bf16 rounding shows
