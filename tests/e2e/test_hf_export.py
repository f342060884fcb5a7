"""Hugging Face export and import through the real `deepspeed` launcher (2 ranks each).

- TP=2 with ZeRO-3 (post-LayerNorm with disentangled attention, i.e. DebertaV2, 16 log
  buckets; GDES, E ≠ H) and PP=2 with ZeRO-1 and bf16 (pre-LayerNorm,
  NES; the fp32 master weights are exported) write ``--export-hf`` at the end; ``tools/export_hf.py`` on their checkpoints writes the same
  tensors bitwise (it restarts each run's world of 2); the export computes what the trained
  model computes (fp32, real text, 1e-4), loaded with zero missing or unexpected keys.
- ``--pretrained-checkpoint`` of the TP=2 export at another layout (TP=1 × DP=2, ZeRO-3): with a
  learning rate of 1e-12 its weights after one step are the exported ones.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rtd_scale.config import LayerNormPosition
from rtd_scale.hf import convert
from tests.helpers.env import REPO
from tests.helpers.hf_models import TOL, hf_outputs, max_diffs, ours, real_batch
from tests.helpers.launcher import launch

POST, PRE = LayerNormPosition.POST, LayerNormPosition.PRE
pytestmark = pytest.mark.e2e


def _args(wiki_shards, save, ds, extra):
    tok, prefix = wiki_shards
    return ["--ds_config", ds, "--preset", "tiny", "--data-path", prefix, "--tokenizer-model",
            tok, "--save", str(save), "--train-iters", "2", "--seq-length", "64",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
            "--lr-warmup-iters", "1", "--log-interval", "1", "--seed", "7", "--eval-iters", "0",
            *extra]


def _tensors(directory):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.rglob("*.safetensors")):
        out.update({f"{f.relative_to(directory)}:{k}": v for k, v in load_file(f).items()})
    return out


def _export_tool(run, out):
    r = subprocess.run([sys.executable, "tools/export_hf.py", "--load", str(run), "--output",
                        str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def _model_from_export_pt(path, tok):
    """Our model at TP = PP = 1 with the trained weights of an ``--export`` file."""
    from rtd_scale.config import RunConfig
    from rtd_scale.model import weights
    from tests.helpers.tiny_model import build

    blob = torch.load(path, weights_only=True)
    cfg = RunConfig.from_dict(blob["config"])
    model = build(cfg, seed=0, tok=tok)  # at TP 1 as one pipeline stage: the whole model
    weights.load_full_state_dict(model, blob["model"], tp_rank=0)
    return model.eval(), blob["model"]


def _check_parity(run_name, export_dir, pt, tok, layout):
    """``layout`` "deberta": DebertaV2 classes, compared at real tokens (see test_hf_deberta)."""
    from tests.helpers import hf_deberta

    model, _ = _model_from_export_pt(pt, tok)
    ids = real_batch(tok)
    if layout == "deberta":
        diffs = hf_deberta._diffs(ours(model, ids, tok.pad_id), hf_deberta.hf_outputs(
            export_dir, ids, tok.pad_id), ids != tok.pad_id)
    else:
        diffs = max_diffs(ours(model, ids, tok.pad_id), hf_outputs(export_dir, layout, ids,
                                                                   tok.pad_id))
    print(f"parity {run_name}: disc_hidden {diffs[0]:.2e} rtd {diffs[1]:.2e} "
          f"gen_hidden {diffs[2]:.2e} mlm {diffs[3]:.2e}")
    assert max(diffs) < TOL, diffs


def test_export_from_tp2_and_pp2_and_import_at_another_layout(single_process_group, wiki_shards,
                                                              tmp_path):
    from rtd_scale.data.tokenizer import Tokenizer

    tok = Tokenizer(wiki_shards[0])
    post = ["--layernorm-position", "post", "--set", "model.embedding_size=64",  # E 64 ≠ H 96
            "--attention-type", "disentangled", "--set", "model.position_buckets=16"]

    # TP=2, ZeRO-3, post-LayerNorm with disentangled attention, GDES, projected embeddings
    a = tmp_path / "tp2"
    r = launch(_args(wiki_shards, a, "ds_configs/zero3.json", [
        "--tensor-model-parallel-size", "2", *post, "--export", str(a / "w.pt"),
        "--export-hf", str(a / "hf")]))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "world 2 = TP 2 × PP 1 × DP 1" in r.stdout and "exported to Hugging Face" in r.stdout
    assert "sharing gdes, disentangled attention, post-LN layers, " in r.stdout
    _check_parity("TP=2 ZeRO-3 disentangled gdes E!=H", a / "hf", a / "w.pt", tok, "deberta")
    assert (a / "hf" / convert.RTD_HEAD_FILE).is_file()
    _export_tool(a, tmp_path / "tp2_tool")
    _assert_same(_tensors(a / "hf"), _tensors(tmp_path / "tp2_tool"))

    # PP=2, ZeRO-1, bf16, pre-LayerNorm, NES
    b = tmp_path / "pp2"
    r = launch(_args(wiki_shards, b, "ds_configs/zero1.json", [
        "--pipeline-model-parallel-size", "2", "--sharing", "nes", "--bf16",
        "--export", str(b / "w.pt"), "--export-hf", str(b / "hf")]))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "world 2 = TP 1 × PP 2 × DP 1" in r.stdout and "bf16" in r.stdout
    exported = torch.load(b / "w.pt", weights_only=True)["model"]  # the fp32 masters, not bf16
    assert any(not torch.equal(t, t.bfloat16().float()) for t in exported.values())
    _check_parity("PP=2 ZeRO-1 pre nes", b / "hf", b / "w.pt", tok, PRE)
    assert (b / "hf" / convert.RTD_HEAD_FILE).is_file()
    _export_tool(b, tmp_path / "pp2_tool")
    _assert_same(_tensors(b / "hf"), _tensors(tmp_path / "pp2_tool"))

    # --pretrained-checkpoint of the TP=2 export at TP=1 × DP=2 with ZeRO-3
    c = tmp_path / "dp2"
    args = _args(wiki_shards, c, "ds_configs/zero3.json", [
        *post, "--pretrained-checkpoint", str(a / "hf"), "--export", str(c / "w.pt")])
    args[args.index("--train-iters") + 1] = "1"
    args[args.index("--lr") + 1] = "1e-12"
    r = launch(args)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "world 2 = TP 1 × PP 1 × DP 2" in r.stdout
    assert f"loaded weights from --pretrained-checkpoint {a / 'hf'}" in r.stdout
    trained = torch.load(a / "w.pt", weights_only=True)["model"]
    started = torch.load(c / "w.pt", weights_only=True)["model"]
    assert sorted(started) == sorted(trained)
    worst = max((started[k] - trained[k]).abs().max().item() for k in trained)
    assert worst < 1e-8, worst  # one step at lr 1e-12 moves nothing measurable


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
