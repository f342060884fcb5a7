"""Learning diagnostics (rtd_scale/training/diagnostics.py): Table 1's average cosines equal a
brute-force pairwise computation, on random rows and on a model's real tables (GDES: E_G + E_Δ),
vocab-parallel at TP = 2 as at TP = 1; the held-out RTD AUC equals brute-force pair counting."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.config import Sharing
from rtd_scale.training.diagnostics import (AVG_COSINE_DISCRIMINATOR, AVG_COSINE_GENERATOR,
                                            ROWWISE_COSINE, avg_pairwise_cosine, roc_auc,
                                            table_cosines)


def brute_force_cosine(rows: torch.Tensor) -> float:
    """Mean of cos(r_i, r_j) over ordered pairs i != j, one pair at a time."""
    n = rows.shape[0]
    total = 0.0
    for i in range(n):
        for j in range(n):
            if i != j:
                total += float(torch.nn.functional.cosine_similarity(
                    rows[i].double(), rows[j].double(), dim=0))
    return total / (n * (n - 1))


def brute_force_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(positive > negative) + ½ P(tie), over every (positive, negative) pair."""
    pos = [float(s) for s, l in zip(scores, labels) if l == 1]
    neg = [float(s) for s, l in zip(scores, labels) if l == 0]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def test_closed_form_cosine_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(40, 7, generator=g) + 0.4  # a common direction: mean cosine well above 0
    rows[5] = 0.0  # a zero row has cosine 0 with every row (torch's cosine_similarity)
    ref = brute_force_cosine(rows)
    assert ref > 0.05
    assert avg_pairwise_cosine(rows) == pytest.approx(ref, abs=1e-12)
    same = torch.ones(6, 3) * torch.arange(1, 7).view(6, 1)  # parallel rows: every cosine 1
    assert avg_pairwise_cosine(same) == pytest.approx(1.0, abs=1e-12)
    assert avg_pairwise_cosine(torch.eye(5)) == pytest.approx(0.0, abs=1e-12)


def test_roc_auc_equals_pair_counting_with_ties():
    g = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 6, (300,), generator=g).float()  # many ties
    labels = torch.randint(-1, 2, (300,), generator=g)  # -1 (padding) is ignored
    labels[:4] = torch.tensor([0, 1, 0, 1])
    keep = labels >= 0
    assert roc_auc(scores, labels) == pytest.approx(brute_force_auc(scores[keep], labels[keep]),
                                                    abs=1e-12)
    cont = torch.randn(200, generator=g)
    lab = (cont + torch.randn(200, generator=g) > 0).long()
    ref = brute_force_auc(cont, lab)
    assert ref > 0.6  # informative scores
    assert roc_auc(cont, lab) == pytest.approx(ref, abs=1e-12)
    assert roc_auc(torch.tensor([0.1, 0.9]), torch.tensor([0, 1])) == 1.0
    assert roc_auc(torch.tensor([0.9, 0.1]), torch.tensor([0, 1])) == 0.0
    assert roc_auc(torch.tensor([3.0, 3.0]), torch.tensor([0, 1])) == 0.5
    assert torch.isnan(torch.tensor(roc_auc(torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))))


def _model(sharing: Sharing, tp_size: int):
    from tests.helpers.dist_workers import build, tiny_config

    model = build(tiny_config(sharing, vocab_size=300), tp_size)
    table = model.discriminator_table
    if hasattr(table, "delta"):  # E_Δ starts at zero: give it TP-independent nonzero rows
        rows = torch.arange(table.delta.shape[0]) + model.generator_table.vocab_start_index
        cols = torch.arange(table.delta.shape[1])
        with torch.no_grad():
            table.delta.copy_(0.02 * torch.sin(rows.view(-1, 1) * 0.37 + cols.view(1, -1)))
    return model


def _full_rows(model, vocab_size: int = 300):
    g = model.generator_table.weight.detach()[:vocab_size]
    d_mod = model.discriminator_table
    if hasattr(d_mod, "delta"):
        d = g + d_mod.delta.detach()[:vocab_size]
    elif d_mod is model.generator_table:
        d = g
    else:
        d = d_mod.weight.detach()[:vocab_size]
    return g, d


@pytest.mark.parametrize("sharing", [Sharing.ES, Sharing.NES, Sharing.GDES])
def test_table_cosines_of_a_model(single_process_group, sharing, monkeypatch):
    from rtd_scale.training import diagnostics

    model = _model(sharing, 1)
    assert model.generator_table.weight.shape[0] > 300  # padded rows exist and are left out
    got = table_cosines(model, single_process_group.tp_group, zero3=False)
    monkeypatch.setattr(diagnostics, "ROW_CHUNK", 7)  # blocks of rows add up to the whole
    assert table_cosines(model, single_process_group.tp_group, zero3=False) == pytest.approx(
        got, abs=1e-12)
    g, d = _full_rows(model)
    u = torch.nn.functional.normalize(g.double(), dim=-1)
    v = torch.nn.functional.normalize(d.double(), dim=-1)
    pair = lambda w: float(((w @ w.T).sum() - (w * w).sum()) / (300 * 299))  # noqa: E731
    assert got[AVG_COSINE_GENERATOR] == pytest.approx(pair(u), abs=1e-10)
    assert got[AVG_COSINE_DISCRIMINATOR] == pytest.approx(pair(v), abs=1e-10)
    assert got[ROWWISE_COSINE] == pytest.approx(float((u * v).sum(-1).mean()), abs=1e-10)
    # brute force on a slice checks the matrix form above
    assert avg_pairwise_cosine(d[:25]) == pytest.approx(brute_force_cosine(d[:25]), abs=1e-12)
    if sharing is Sharing.ES:
        assert got[AVG_COSINE_DISCRIMINATOR] == got[AVG_COSINE_GENERATOR]
        assert got[ROWWISE_COSINE] == pytest.approx(1.0, abs=1e-12)
    if sharing is Sharing.GDES:  # the discriminator's table is E_G + E_Δ, not E_G or E_Δ alone
        assert got[ROWWISE_COSINE] < 0.999
        assert got[AVG_COSINE_DISCRIMINATOR] != pytest.approx(got[AVG_COSINE_GENERATOR], abs=1e-4)
        assert got[AVG_COSINE_DISCRIMINATOR] != pytest.approx(
            avg_pairwise_cosine(model.discriminator_table.delta.detach()[:300]), abs=1e-4)


def cosines_worker(ctx):
    """Table cosines of each sharing mode's model at this TP size (run by the dist harness)."""
    return {s.value: table_cosines(_model(s, ctx.tp_size), ctx.tp_group, zero3=False)
            for s in (Sharing.NES, Sharing.GDES)}


@pytest.mark.dist
def test_table_cosines_tp2_equal_tp1():
    from tests.helpers import dist as harness

    ref = harness.run(cosines_worker, world_size=1)[0]
    for res in harness.run(cosines_worker, world_size=2, tp=2):
        for mode, vals in ref.items():
            assert res[mode] == pytest.approx(vals, abs=1e-10)
    assert ref["gdes"][AVG_COSINE_DISCRIMINATOR] != pytest.approx(
        ref["gdes"][AVG_COSINE_GENERATOR], abs=1e-4)


def evaluate_worker(ctx, zero_stage: int):
    """``loop.evaluate`` through a real DeepSpeed engine (ZeRO ``zero_stage``) on 2 global
    batches of 8 fixed samples, each data-parallel rank reading its share; at DP = 1 also the
    reference: every non-pad token's logit and label from plain forwards of the same model."""
    from rtd_scale import distributed
    from rtd_scale.data.packed import MicroBatch
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.loop import evaluate
    from tests.helpers.dist_workers import build, fixed_batch, tiny_config

    cfg = tiny_config(Sharing.GDES, vocab_size=300)
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.eval_iters = 2, 8, 2
    gas = 8 // (2 * ctx.dp_size)
    ids, idx = fixed_batch(b=16)
    ids[9, 30:] = 0  # padding in the second global batch too
    share = 8 // ctx.dp_size
    loader = [MicroBatch(ids[k * 8 + ctx.dp_rank * share + 2 * j:][:2],
                         idx[k * 8 + ctx.dp_rank * share + 2 * j:][:2])
              for k in range(2) for j in range(gas)]
    model = build(cfg, ctx.tp_size)
    distributed.seed_after_build(ctx, 7)
    ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": zero_stage}}, cfg,
                                      data_parallel_size=ctx.dp_size,
                                      gradient_accumulation_steps=gas)
    eng = engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
    res = {"dp_rank": ctx.dp_rank, "valid": evaluate(cfg, ctx, eng, loader),
           "cosines": table_cosines(model, ctx.tp_group, zero3=zero_stage == 3)}
    if ctx.dp_size == 1:
        model.eval()
        with torch.no_grad():
            outs = [model(ids[i:i + 2], idx[i:i + 2], step=0) for i in range(0, 16, 2)]
        logits = torch.cat([o.rtd_logits for o in outs])
        rep = torch.cat([o.corrupted_ids for o in outs]) != ids
        keep = ids != 0
        res["reference"] = (logits[keep], rep[keep].long())
    return res


@pytest.mark.dist
def test_evaluate_auc_dp2_zero3_equals_dp1_and_pair_counting():
    from tests.helpers import dist as harness

    one = harness.run(evaluate_worker, 0, world_size=1)[0]
    scores, labels = one["reference"]
    assert 20 < int(labels.sum()) < int(labels.numel())  # both classes present
    auc = one["valid"]["valid/rtd/auc"]
    assert auc == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)
    two = harness.run(evaluate_worker, 3, world_size=2)
    first = next(r for r in two if r["dp_rank"] == 0)
    assert first["valid"]["valid/rtd/auc"] == pytest.approx(auc, abs=1e-9)
    assert torch.isnan(torch.tensor(next(r for r in two if r["dp_rank"] == 1)["valid"][
        "valid/rtd/auc"]))  # computed once, on the logging rank's data-parallel group's first rank
    assert first["valid"]["valid/loss/rtd"] == pytest.approx(one["valid"]["valid/loss/rtd"],
                                                             abs=1e-6)
    for r in two:  # Table-1 cosines gathered from ZeRO-3 partitions equal the unpartitioned ones
        assert r["cosines"] == pytest.approx(one["cosines"], abs=1e-10)


def _summary(aucs):
    """A run's summary with the training log of both ends and one validation per AUC."""
    train = {"loss/mlm": 6.0, "loss/rtd": 0.4, "mlm/accuracy": 0.05,
             "rtd/replaced_fraction": 0.13, "rtd/accuracy_replaced": 0.0,
             "rtd/accuracy_original": 1.0, AVG_COSINE_GENERATOR: 0.123,
             AVG_COSINE_DISCRIMINATOR: 0.045}
    valid = [(100 * (i + 1), {"valid/loss/mlm": 6.1, "valid/loss/rtd": 0.41, "valid/rtd/auc": a,
                              "_valid/rtd/auc_chance_sd": 0.01}) for i, a in enumerate(aucs)]
    return {"history": [(1, train), (300, train)], "valid_history": valid}


def test_summary_verdict_reads_the_last_auc_against_chance():
    from rtd_scale.pretrain import summary_text

    text = summary_text(_summary([0.51, 0.53, 0.565]))
    assert "held-out RTD AUC 0.5650 at iteration 300 (0.5 = chance, ± 0.0100" in text
    assert "0.5100 at iteration 100, +0.0550 since" in text
    assert "verdict: learning:" in text and "6.5 chance standard deviations" in text
    # an AUC above chance early on can come from the replaced tokens' identity alone: the
    # verdict does not call it context until L_MLM has fallen
    assert "from context" not in text and "use of context only once L_MLM" in text
    assert "generator 0.123, discriminator 0.045" in text
    assert "verdict: above chance (4.0 chance standard deviations above 0.5) but not rising " \
        "since iteration 100" in summary_text(_summary([0.53, 0.56, 0.54]))
    assert "verdict: learning:" in summary_text(_summary([0.54]))  # one validation: no trend
    assert "verdict: on the prior plateau" in summary_text(_summary([0.49, 0.52]))
    assert "verdict: below chance" in summary_text(_summary([0.46]))
    no_valid = _summary([])
    assert "verdict: no held-out RTD AUC" in summary_text(no_valid)


@pytest.mark.parametrize("preset,flags,cls,head", [
    ("electra-small", {}, "ElectraForPreTraining", "RTD head included"),
    ("tiny", {"layernorm_position": "pre"}, "RobertaPreLayerNormModel",
     "its RTD head in hf/my-run/rtd_head.safetensors"),
    ("debertav3-xsmall", {}, "DebertaV2Model", "its RTD head in hf/my-run/rtd_head.safetensors"),
])
def test_summary_names_the_export_command_of_its_own_run(preset, flags, cls, head):
    from rtd_scale import config
    from rtd_scale.pretrain import export_hint, summary_text

    cfg = config.preset(preset)
    for k, v in flags.items():
        setattr(cfg.model, k, config.LayerNormPosition(v))
    cfg.train.save = "runs/my-run/"
    hint = export_hint(cfg)
    assert hint == (f"python tools/export_hf.py --load runs/my-run/ --output hf/my-run   "
                    f"(loads as {cls}, {head}; the generator in hf/my-run/generator)")
    text = summary_text({**_summary([0.6]), "export_hint": hint})
    assert text.splitlines()[-1] == f"  export:      {hint}"
    cfg.train.save = None
    assert export_hint(cfg) is None
