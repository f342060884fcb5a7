"""Learning diagnostics (rtd_scale/training/diagnostics.py): Table 1's average cosines equal a
brute-force pairwise computation, on random rows and on a model's real tables (GDES: E_G + E_Δ);
the RTD AUC equals brute-force pair counting. TP = 2 and DP = 2 runs are in
tests/multiproc/test_diagnostics_parallel.py."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.config import Sharing
from rtd_scale.training.diagnostics import (AVG_COSINE_DISCRIMINATOR, AVG_COSINE_GENERATOR,
                                            ROWWISE_COSINE, avg_pairwise_cosine, roc_auc,
                                            table_cosines)
from tests.helpers.diagnostics import brute_force_auc
from tests.helpers.diagnostics import diagnostics_model as _model


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
    from rtd_scale.training.summary import summary_text

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
    from rtd_scale import config, presets
    from rtd_scale.exports import export_hint
    from rtd_scale.training.summary import summary_text

    cfg = presets.preset(preset)
    for k, v in flags.items():
        setattr(cfg.model, k, config.LayerNormPosition(v))
    cfg.train.save = "runs/my-run/"
    hint = export_hint(cfg)
    assert hint == (f"python tools/export_hf.py --load runs/my-run/ --output hf/my-run   "
                    f"(loads as {cls}, {head}; the generator in hf/my-run/generator)")
    text = summary_text({**_summary([0.6]), "export_hint": hint})
    assert text.splitlines()[-1] == f"  export:      {hint}"
    cfg.train.export_hf = "exports/my-run"  # written at the end of the run: where it is
    head = head.replace("hf/my-run", "exports/my-run")
    assert export_hint(cfg, exported=True) == (
        f"written to exports/my-run by --export-hf (loads as {cls}, {head}; the generator in "
        "exports/my-run/generator)")
    cfg.train.save = None
    assert export_hint(cfg) is None
    assert export_hint(cfg, exported=True).startswith("written to exports/my-run by --export-hf")


def test_summary_offers_no_export_its_adapter_would_refuse():
    """A modern-block run with RMSNorm: ModernBERT has LayerNorm only, so tools/export_hf.py
    refuses it; the summary offers no command but says why, in the export tool's words (with
    LayerNorm it names ModernBertModel's)."""
    from rtd_scale import presets
    from rtd_scale.exports import export_hint

    cfg = presets.preset("modernbert-tiny")
    cfg.train.save = "runs/m"
    assert "(loads as ModernBertModel, " in export_hint(cfg)
    cfg.model.normalization = "RMSNorm"
    assert export_hint(cfg) == ("none: cannot export: Hugging Face ModernBERT has LayerNorm only, "
                                "but --normalization RMSNorm; train with --normalization "
                                "LayerNorm")


def test_the_start_line_says_whether_samples_are_document_masked():
    from types import SimpleNamespace

    import torch

    from rtd_scale import presets
    from rtd_scale.training.summary import start_lines

    model = torch.nn.Linear(10, 10)  # 110 parameters
    model.padded_vocab_size = 8064
    ctx = SimpleNamespace(world_size=1, tp_size=1, pp_size=1, dp_size=1)
    ds = {"zero_optimization": {"stage": 3}}
    modern = start_lines(presets.preset("modernbert-tiny"), ctx, model, ds, 1, 2, {})[0]
    assert modern.endswith(", fp32, packed samples of 128 tokens (document-masked), "
                           "0 loader workers"), modern
    assert "preset modernbert-tiny, sharing gdes, rotary attention, pre-LN layers, 0.00M" in modern
    plain = start_lines(presets.preset("debertav3-tiny"), ctx, model, ds, 1, 2, {})[0]
    assert plain.endswith(", fp32, packed samples of 128 tokens, 0 loader workers"), plain
    mlm = presets.preset("debertav3-tiny")
    mlm.rtd.objective = "mlm"  # the masked-LM control: no sharing to speak of
    assert ("preset debertav3-tiny, objective mlm (the masked LM alone), disentangled attention"
            in start_lines(mlm, ctx, model, ds, 1, 2, {})[0])
