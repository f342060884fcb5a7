"""``rtd.objective=mlm``: the masked-LM control (BERT arXiv 1810.04805 §3.1) — one encoder of the
discriminator's shape, its MLM head tied to its own token table, L_MLM the whole loss."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rtd_scale.config import ConfigError, Objective, apply_override
from rtd_scale.model.rtd import RTDModel
from rtd_scale.presets import preset
from tests.helpers.sync import SyncRecorder

SPECIAL = (0, 1, 2, 3, 4)


def _cfg(objective="mlm"):
    cfg = preset("tiny")  # generator 2 layers, discriminator 4
    cfg.model.vocab_size = 300
    for m in ("generator", "discriminator"):
        setattr(cfg.model, m, dataclasses.replace(getattr(cfg.model, m), hidden_size=32,
                                                  ffn_hidden_size=64, hidden_dropout=0.0,
                                                  attention_dropout=0.0))
    cfg.model.embedding_size = 32
    apply_override(cfg, f"rtd.objective={objective}")
    cfg.validate()
    return cfg


def _model(cfg):
    return RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=SPECIAL,
                    pad_id=0, mask_id=4, seed=3)


def _ids(b=4, s=64):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 300, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    ids[3, 40:] = 0  # padding too
    return ids


def test_the_field_takes_the_two_objectives_and_names_itself_otherwise(tmp_path):
    cfg = preset("tiny")
    assert cfg.rtd.objective is Objective.RTD  # the default
    apply_override(cfg, "rtd.objective=mlm")
    assert cfg.rtd.objective is Objective.MLM
    # --config FILE: the file's field, typed as the flag's
    from rtd_scale import config_file

    path = tmp_path / "run.yaml"
    path.write_text("preset: debertav3-tiny\nrtd:\n  objective: mlm\n  mask_prob: 0.3\n")
    from_file, _ = config_file.read(str(path))
    assert from_file.rtd.objective is Objective.MLM and from_file.rtd.mask_prob == 0.3
    with pytest.raises(ConfigError) as e:
        apply_override(cfg, "rtd.objective=bert")
    assert str(e.value) == ("--set rtd.objective=bert: expected one of rtd, mlm, e.g. "
                            "--set rtd.objective=mlm")


def test_label_shuffling_is_refused_under_mlm_in_one_line():
    cfg = _cfg()
    cfg.rtd.shuffle_labels = True
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert str(e.value) == ("rtd.shuffle_labels permutes RTD labels, which rtd.objective=mlm has "
                            "none of; drop it or use rtd.objective=rtd")


def test_pipeline_divisibility_reads_the_one_encoder():
    """tiny's generator has 2 layers, its discriminator 4: PP 4 fits the masked LM alone."""
    cfg = _cfg("rtd")
    apply_override(cfg, "parallel.pipeline_model_parallel_size=4")
    with pytest.raises(ConfigError, match="model.generator.num_layers"):
        cfg.validate()
    apply_override(cfg, "rtd.objective=mlm")
    cfg.validate()


def test_one_encoder_of_the_discriminator_shape_with_its_head_tied(single_process_group):
    cfg = _cfg()
    model = _model(cfg)
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"generator", "mlm_head"}  # no discriminator, no RTD head, no sampler
    assert len(model.generator.block.layers) == cfg.model.discriminator.num_layers == 4
    assert model.mlm_head.table is model.generator_table  # tied: the one table object
    assert model.encoders() == [model.generator]
    # the RTD model of the same config has both, the generator at its own depth
    rtd = _model(_cfg("rtd"))
    assert len(rtd.generator.block.layers) == 2 and len(rtd.discriminator.block.layers) == 4


def test_the_loss_is_the_masked_cross_entropy_and_never_waits(single_process_group):
    model = _model(_cfg())
    ids = _ids()
    rec = SyncRecorder()
    with rec:
        out = model(ids, torch.arange(4), step=7)
        out.loss.backward()
    assert rec.ops == []
    # the reference: the head on every position, cross-entropy at the masked ones
    m = model.mask(ids, torch.arange(4))
    with torch.no_grad():
        hidden = model.generator(m.generator_input, ids == 0)  # [s, b, H]
        logits = model.mlm_head(hidden.transpose(0, 1)[m.masked])  # [n, V]
        ref = F.cross_entropy(logits, ids[m.masked])
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert out.mlm_loss is out.loss and out.rtd_loss.item() == 0.0
    assert out.counts["masked"].item() == m.masked.sum().item() > 0
    assert out.counts["tokens"].item() == (ids != 0).sum().item()
    assert out.counts["replaced"].item() == 0.0 and out.rtd_logits is None
    assert torch.equal(out.corrupted_ids, ids)
    # L_MLM reaches the tied table through both its uses (input and output)
    assert model.generator_table.weight.grad.abs().sum() > 0


def test_the_summary_offers_the_masked_lm_export():
    from rtd_scale.exports import export_hint

    cfg = preset("debertav3-tiny")
    cfg.train.save = "runs/mlm"
    apply_override(cfg, "rtd.objective=mlm")
    assert export_hint(cfg) == ("python tools/export_hf.py --load runs/mlm --output hf/mlm   "
                                "(loads as DebertaV2ForMaskedLM, the masked LM with its head)")
    cfg.train.export_hf = "exports/mlm"
    assert export_hint(cfg, exported=True) == (
        "written to exports/mlm by --export-hf (loads as DebertaV2ForMaskedLM, the masked LM "
        "with its head)")


def test_the_log_lines_and_summary_hold_the_masked_lm_alone():
    from rtd_scale.training.loop import format_valid_line
    from rtd_scale.training.metrics import format_log_line
    from rtd_scale.training.summary import summary_text

    first = {"loss/mlm": 4.25, "loss/total": 4.25, "mlm/accuracy": 0.006}
    last = {"loss/mlm": 0.5, "loss/total": 0.5, "mlm/accuracy": 0.81}
    valid = {"valid/loss/mlm": 0.37, "valid/loss/total": 0.37, "valid/mlm/accuracy": 0.84}
    text = summary_text({"history": [(1, first), (500, last)], "valid_history": [(500, valid)]})
    assert text.splitlines()[1:5] == [
        "MLM pretraining summary",
        "  L_MLM  first 4.2500 (iteration 1)  →  last 0.5000 (iteration 500)",
        "  MLM accuracy 0.006 → 0.810",
        "  validation L_MLM 0.3700 (iteration 500) → 0.3700 (iteration 500), MLM accuracy 0.840"]
    assert "rtd" not in format_valid_line(500, 64, valid)
    line = format_log_line(500, 500, 16000, 53.1, dict(last, **{
        "optim/lr": 3e-3, "optim/grad_norm": 1.4, "throughput/tokens_per_s": 38583.0}), 32)
    assert "mlm loss: 5.000000E-01 | total loss: 5.000000E-01 | mlm acc: 0.8100 | grad norm" in line
    assert "rtd" not in line and "replaced" not in line


def test_an_evaluation_dump_is_said_to_have_no_effect():
    cfg = _cfg()
    cfg.train.eval_dump_dir = "dumps"
    with pytest.warns(UserWarning) as got:
        cfg.validate()
    assert [str(w.message) for w in got] == [
        "--eval-dump-dir dumps has no effect under rtd.objective=mlm: the dumps hold the "
        "discriminator's replacements and logits, which a masked LM has none of; drop the flag"]


def test_load_refuses_a_checkpoint_of_the_other_objective(tmp_path):
    """--load of an RTD checkpoint under rtd.objective=mlm (and back) is another model, named in
    one line; under mlm the generator's fields shape nothing, so they may differ."""
    import json

    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.training.checkpoint.compat import check_compatible
    from rtd_scale.training.checkpoint.files import META_FILE

    def saved(cfg) -> str:
        (tmp_path / "global_step1").mkdir(exist_ok=True)
        (tmp_path / "global_step1" / META_FILE).write_text(json.dumps(
            {"layout": {"world_size": 1}, "config": cfg.to_dict()}))
        return str(tmp_path)

    run = saved(preset("tiny"))
    mlm = preset("tiny")
    apply_override(mlm, "rtd.objective=mlm")
    with pytest.raises(UserInputError) as e:
        check_compatible(run, "global_step1", mlm, {"world_size": 1})
    assert str(e.value) == (f"--load {run}: global_step1 was trained with rtd.objective rtd, "
                            "this run has mlm; resume with --set rtd.objective=rtd, or start a "
                            "new run from its export (tools/export_hf.py, then "
                            "--pretrained-checkpoint)")
    run = saved(mlm)
    with pytest.raises(UserInputError) as e:
        check_compatible(run, "global_step1", preset("tiny"), {"world_size": 1})
    assert str(e.value).startswith(f"--load {run}: global_step1 was trained with rtd.objective "
                                   "mlm, this run has rtd; resume with --set rtd.objective=mlm")
    apply_override(mlm, "model.generator.num_layers=1")  # no effect under mlm
    check_compatible(run, "global_step1", mlm, {"world_size": 1})
