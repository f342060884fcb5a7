"""Pipeline parallelism equals one stage (gloo, CPU): losses, samples and gradients of the
two-pass 1F1B step, and the tied generator table kept equal across stages."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.config import Sharing
from tests.helpers import dist as harness, dist_workers as workers

pytestmark = pytest.mark.dist

# (name, sharing, layernorm layout[, attention]): every sharing mode pre-LN, ELECTRA's ES
# post-LN, DeBERTa's disentangled attention (a relative table on every stage), the modern
# block (rotary angles on every stage, its global and local layers split over the stages), and
# the modern block under document-masked packing ("_docs": every stage masks attention by the
# micro-batch's document ids, within its windows, and restarts the rotary positions)
CASES = (("es", Sharing.ES, "pre"), ("nes", Sharing.NES, "pre"), ("gdes", Sharing.GDES, "pre"),
         ("post_es", Sharing.ES, "post"), ("deberta_gdes", Sharing.GDES, "post", "disentangled"),
         ("modern_gdes", Sharing.GDES, "pre", "rotary"),
         ("modern_docs", Sharing.GDES, "pre", "rotary"),
         ("deberta_mlm", Sharing.GDES, "post", "disentangled"))  # rtd.objective=mlm: one pass


def _merge(results, case):
    """Per-stage gradient dicts merged by canonical name (TP rank 0 of each stage); the
    last stage's losses."""
    grads, last = {}, None
    for r in results:
        res = r[case]
        if res["tp_rank"] != 0:
            continue
        for name, g in res["grads"].items():
            if name in grads:  # the tied table and the relative tables: every copy must hold
                # the same summed gradient
                assert torch.equal(grads[name], g), name
            grads[name] = g
        if res["mlm"]:
            last = res
    return grads, last


@pytest.fixture(scope="module")
def reference():
    return harness.run(workers.pipeline_parity, CASES, world_size=1)[0]


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_pipeline_equals_one_stage(reference, tp, pp):
    results = harness.run(workers.pipeline_parity, CASES, world_size=tp * pp, tp=tp, pp=pp)
    for case, *_ in CASES:
        ref = reference[case]
        grads, last = _merge(results, case)
        # the post-LN cases really ran post-LN layers, the DeBERTa case its relative tables
        assert any(n.endswith("post_mlp_layernorm.weight") for n in grads) == \
            case.startswith(("post", "deberta"))
        assert any(n.endswith("rel_embeddings.weight") for n in grads) == \
            case.startswith("deberta")
        if case.startswith("deberta"):  # each stage's copy holds the gradient of all layers
            encoder = "generator" if case.endswith("_mlm") else "discriminator"
            copies = [r[case]["grads"][f"{encoder}.rel_embeddings.weight"] for r in results]
            assert all(torch.equal(c, copies[0]) for c in copies) and copies[0].abs().sum() > 0
        if case.endswith("_mlm"):  # the one encoder (4 layers, 2 per stage), no discriminator
            assert "generator.block.layers.3.mlp.linear_fc1.weight" in grads
            assert not [n for n in grads if n.startswith(("discriminator.", "rtd_head."))]
        assert last["mlm"] == pytest.approx(ref["mlm"], abs=1e-5)
        assert last["rtd"] == pytest.approx(ref["rtd"], abs=1e-5)
        for a, b in zip(last["corrupted"], ref["corrupted"]):
            assert torch.equal(a, b)
        assert grads.keys() == ref["grads"].keys()
        for name, g in ref["grads"].items():
            diff = (grads[name] - g).abs().max().item()
            assert diff <= 1e-5, f"{case} tp={tp} pp={pp}: {name} differs by {diff:.3g}"


def test_tied_and_relative_tables_bitwise_equal_after_20_steps():
    """DeBERTa's attention: besides the generator's tied table, each stage's copies of both
    relative tables and their norms stay bitwise equal through DeepSpeed's steps (gradient
    clipping counts the copies once: ``ds_pipe_replicated``)."""
    res = harness.run(workers.pipeline_tied_after_training, 20, "disentangled", world_size=2,
                      pp=2)
    first = next(r for r in res if r["pp_rank"] == 0)
    last = next(r for r in res if r["pp_rank"] == 1)
    assert torch.equal(first["weight"], last["weight"])
    assert len(first["relative"]) == len(last["relative"]) == 6  # 2 encoders × table, weight, bias
    for k, w in first["relative"].items():
        assert torch.equal(w, last["relative"][k]), k
    assert not torch.equal(first["relative"]["1"], torch.ones_like(first["relative"]["1"]))  # trained
    assert last["losses"][-1] < last["losses"][0]  # it trained (lr 1e-2, same 4 micro-batches)
