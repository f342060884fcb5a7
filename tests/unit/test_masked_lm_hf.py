"""``rtd.objective=mlm`` leaves and enters through Hugging Face as its layout's masked-LM class
(``ElectraForMaskedLM``, ``RobertaPreLayerNormForMaskedLM``, ``DebertaV2ForMaskedLM``,
``ModernBertForMaskedLM``): every weight perturbed, exported, loaded by transformers with no
missing or unexpected key, the same hidden states and MLM logits (1e-4); read back by
``--pretrained-checkpoint`` into a differently seeded model bitwise, head included. An RTD run
started from a masked-LM directory takes its encoder as the discriminator and says where the
head went. (Under transformers 4.x: tests/e2e/test_hf_export_transformers4.py.)"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import Objective, Sharing
from rtd_scale.hf.export import write_export
from rtd_scale.hf.pretrained import load_pretrained
from tests.helpers.hf_deberta import _assert_bitwise, _tensors
from tests.helpers.hf_models import (DISENTANGLED, POST, PRE, ROTARY, TOL, build_model,
                                     canonical_state, layout_config, load_checked, perturb,
                                     real_batch, tiny_config)

CLASSES = {POST: "ElectraForMaskedLM", PRE: "RobertaPreLayerNormForMaskedLM",
           DISENTANGLED: "DebertaV2ForMaskedLM", ROTARY: "ModernBertForMaskedLM"}
LAYOUTS = list(CLASSES)


@pytest.fixture(scope="module")
def tok(wiki_shards):
    from rtd_scale.data.tokenizer import Tokenizer

    return Tokenizer(wiki_shards[0])


def mlm_config(layout, vocab_size: int, projected: bool = False):
    """``layout_config`` under rtd.objective=mlm; ``projected``: ELECTRA's table narrower than
    the encoder (24 → 32, ``embeddings_project``)."""
    cfg = tiny_config(POST, Sharing.GDES, True, vocab_size) if projected else \
        layout_config(layout, vocab_size)
    cfg.rtd.objective = Objective.MLM
    cfg.validate()
    return cfg


def export(model, cfg, ctx, tok, path):
    write_export(canonical_state(model, ctx), cfg.trained_model(), str(path), pad_id=tok.pad_id,
                 cls_id=tok.cls_id, sep_id=tok.sep_id, note=lambda m: None, masked_lm=True)


def load(model, cfg, ctx, tok, path, notes=None):
    load_pretrained(model, str(path), cfg.trained_model(), pad_id=tok.pad_id,
                    tp_group=ctx.tp_group, tp_rank=0,
                    print_fn=None if notes is None else notes.append)


@torch.no_grad()
def ours(model, ids, pad_id):
    """The encoder's hidden states [b, s, H] and MLM logits over the real vocabulary."""
    h = model.generator(ids, ids == pad_id).transpose(0, 1)
    b, s, _ = h.shape
    v = model.cfg.vocab_size
    return h, model.mlm_head(h.reshape(b * s, -1))[:, :v].reshape(b, s, v)


@torch.no_grad()
def theirs(path, layout, ids, pad_id):
    attention = (ids != pad_id).long()
    kw = {}
    if layout == PRE:  # RoBERTa's offset positions, at pads too
        kw["position_ids"] = (pad_id + 1 + torch.arange(ids.shape[1])).expand_as(ids)
    hf = load_checked(CLASSES[layout], path)
    return (hf.base_model(ids, attention_mask=attention, **kw).last_hidden_state,
            hf(ids, attention_mask=attention, **kw).logits)


@pytest.mark.parametrize("layout,projected", [(l, False) for l in LAYOUTS] + [(POST, True)],
                         ids=[l.value for l in LAYOUTS] + ["post-E!=H"])
def test_export_is_the_masked_lm_class_and_imports_back_bitwise(single_process_group, tok,
                                                                 tmp_path, layout, projected):
    ctx = single_process_group
    cfg = mlm_config(layout, tok.vocab_size, projected)
    assert (cfg.model.embedding_size != cfg.model.discriminator.hidden_size) == projected
    first = build_model(cfg, ctx, tok, seed=3)
    perturb(first)
    export(first, cfg, ctx, tok, tmp_path / "a")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "config.json", "model.safetensors", "rtd_scale.json"]  # one model, no generator/
    manifest = json.loads((tmp_path / "a" / "rtd_scale.json").read_text())
    assert manifest["objective"] == "mlm" and manifest["masked_lm"] == CLASSES[layout]
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == [CLASSES[layout]]
    assert config["num_hidden_layers"] == cfg.model.discriminator.num_layers  # its shape
    ids = real_batch(tok)
    mine, hf = ours(first, ids, tok.pad_id), theirs(tmp_path / "a", layout, ids, tok.pad_id)
    keep = ids != tok.pad_id
    diffs = [(x[keep] - y[keep]).abs().max().item() for x, y in zip(mine, hf)]
    print(f"masked LM {layout.value}: hidden {diffs[0]:.2e}, logits {diffs[1]:.2e}")
    assert max(diffs) < TOL and mine[1][keep].abs().max() > 0.1
    # --pretrained-checkpoint into a differently seeded model, exported again: the same bytes
    # of every tensor (the head's too), the same outputs (ModernBERT's bias-free head norm
    # folds our norm bias into its decoder bias, so the state itself may differ there)
    second = build_model(cfg, ctx, tok, seed=9)
    load(second, cfg, ctx, tok, tmp_path / "a")
    export(second, cfg, ctx, tok, tmp_path / "b")
    _assert_bitwise(_tensors(tmp_path / "a"), _tensors(tmp_path / "b"))
    for x, y in zip(mine, ours(second, ids, tok.pad_id)):
        assert (x[keep] - y[keep]).abs().max() < 1e-5


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l.value for l in LAYOUTS])
def test_an_rtd_run_starts_its_discriminator_from_a_masked_lm(single_process_group, tok,
                                                              tmp_path, layout):
    """A masked-LM class's directory (ModernBertForMaskedLM, …) → an RTD run: the encoder is
    the discriminator's, the note says that the MLM head is set aside; the generator keeps its
    own weights."""
    ctx = single_process_group
    cfg = mlm_config(layout, tok.vocab_size)
    mlm = build_model(cfg, ctx, tok, seed=3)
    perturb(mlm)
    export(mlm, cfg, ctx, tok, tmp_path / "mlm")
    rtd_cfg = layout_config(layout, tok.vocab_size)
    rtd_cfg.model.discriminator = cfg.model.discriminator
    rtd = build_model(rtd_cfg, ctx, tok, seed=4)
    fresh = canonical_state(rtd, ctx)
    notes = []
    load_pretrained(rtd, str(tmp_path / "mlm"), rtd_cfg.model, pad_id=tok.pad_id,
                    tp_group=ctx.tp_group, tp_rank=0, print_fn=notes.append)
    assert (f"note: {tmp_path / 'mlm'} holds a {CLASSES[layout]}: its encoder starts the "
            "discriminator and its MLM head is set aside (--set rtd.objective=mlm continues it "
            "as a masked LM, head included)") in notes
    got, src = canonical_state(rtd, ctx), canonical_state(mlm, ctx)
    assert torch.equal(got["discriminator.block.layers.0.mlp.linear_fc1.weight"],
                       src["generator.block.layers.0.mlp.linear_fc1.weight"])
    assert torch.equal(got["mlm_head.dense.weight"], fresh["mlm_head.dense.weight"])


def test_a_masked_lm_run_refuses_an_rtd_export_naming_its_generator(single_process_group, tok,
                                                                    tmp_path):
    ctx = single_process_group
    rtd_cfg = layout_config(DISENTANGLED, tok.vocab_size)
    rtd = build_model(rtd_cfg, ctx, tok, seed=3)
    write_export(canonical_state(rtd, ctx), rtd_cfg.model, str(tmp_path / "rtd"),
                 pad_id=tok.pad_id, note=lambda m: None)
    cfg = mlm_config(DISENTANGLED, tok.vocab_size)
    model = build_model(cfg, ctx, tok, seed=4)
    with pytest.raises(UserInputError) as e:
        load(model, cfg, ctx, tok, tmp_path / "rtd")
    path = tmp_path / "rtd"
    assert str(e.value) == (
        f"--pretrained-checkpoint {path}: rtd.objective=mlm starts from a DebertaV2ForMaskedLM "
        f"directory (the masked LM and its head), not a DebertaV2Model; its generator is "
        f"{path}/generator; pass a DebertaV2ForMaskedLM directory or use rtd.objective=rtd")


def test_a_shape_mismatch_names_the_discriminators_field(single_process_group, tok, tmp_path):
    """An --export file of a 2-layer masked LM into a 3-layer one: the fix is the field that
    shapes rtd.objective=mlm's encoder, the discriminator's."""
    ctx = single_process_group
    cfg = mlm_config(POST, tok.vocab_size)
    small = build_model(cfg, ctx, tok, seed=3)
    torch.save({"config": cfg.to_dict(), "model": canonical_state(small, ctx)},
               tmp_path / "small.pt")
    big_cfg = mlm_config(POST, tok.vocab_size)
    big_cfg.model.discriminator = dataclasses.replace(big_cfg.model.discriminator, num_layers=3)
    big = build_model(big_cfg, ctx, tok, seed=4)
    with pytest.raises(UserInputError) as e:
        load(big, big_cfg, ctx, tok, tmp_path / "small.pt")
    assert str(e.value) == (f"--pretrained-checkpoint {tmp_path / 'small.pt'}: the masked LM "
                            "has 2 layers there, 3 here; pass --set model.discriminator.num_layers=2")


def test_a_masked_lm_directory_of_another_depth_is_named_as_the_masked_lm(
        single_process_group, tok, tmp_path):
    """The same from a Hugging Face masked-LM directory: its config is the masked LM's (not a
    generator's), and the fix is the discriminator's field."""
    ctx = single_process_group
    cfg = mlm_config(DISENTANGLED, tok.vocab_size)
    export(build_model(cfg, ctx, tok, seed=3), cfg, ctx, tok, tmp_path / "mlm")
    big_cfg = mlm_config(DISENTANGLED, tok.vocab_size)
    layers = cfg.model.discriminator.num_layers
    big_cfg.model.discriminator = dataclasses.replace(big_cfg.model.discriminator,
                                                      num_layers=layers + 1)
    big = build_model(big_cfg, ctx, tok, seed=4)
    with pytest.raises(UserInputError) as e:
        load(big, big_cfg, ctx, tok, tmp_path / "mlm")
    assert str(e.value) == (f"--pretrained-checkpoint {tmp_path / 'mlm'}: the masked LM's "
                            f"num_hidden_layers is {layers} there but {layers + 1} in this model; "
                            f"pass --set model.discriminator.num_layers={layers} (or the preset "
                            "it was trained with)")
