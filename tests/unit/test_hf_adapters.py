"""A new Hugging Face target is one adapter and one registry entry (``rtd_scale/hf/adapters.py``).

``Bert`` below is such a target, written the way ``rtd_scale/hf/electra.py`` is: post-LN BERT
attention → ``BertModel`` (no pooler, the RTD head in ``rtd_head.safetensors``) and
``BertForMaskedLM``. Registered under the post-LN / BERT-attention key in place of ELECTRA, and
with nothing else changed, the export is a BERT pair that transformers loads with zero missing or
unexpected keys and that computes our outputs; ``--pretrained-checkpoint`` reads it back, and a
second export is the same bytes; the messages that list the targets name it.
"""
from __future__ import annotations

import json

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import AttentionType, LayerNormPosition, Sharing
from rtd_scale.hf import adapters, electra
from rtd_scale.hf.common import (POST_LN_NORMS, RTD_HEAD_FILE, Adapter, ExportError,
                                 base_config_kwargs, layer_pairs, mlm_head_names, wb)
from rtd_scale.hf.export import write_export
from rtd_scale.hf.pretrained import load_pretrained, read_pretrained
from tests.helpers.hf_deberta import _assert_bitwise, _tensors
from tests.helpers.hf_models import (TOL, build_model, canonical_state, load_checked, max_diffs,
                                     ours, perturb, real_batch, tiny_config)

KEY = (LayerNormPosition.POST, AttentionType.BERT)


class Bert(Adapter):
    """Post-LN encoders with BERT attention → BERT (transformers ``models/bert/``): ELECTRA's
    embedding and layer names, no embedding projection (E = H), the legacy MLM head."""

    name = "BERT"
    model_type = "bert"
    attention_words = "BERT-style"
    discriminator_class = "BertModel"
    generator_class = "BertForMaskedLM"
    discriminator_base = ""
    generator_base = "bert."
    model_kwargs = {"add_pooling_layer": False}
    ignored_heads = ("pooler.",)
    mlm_head_maps = (mlm_head_names("cls.predictions.transform", "LayerNorm",
                                    "cls.predictions.bias"),)
    tied_to_table = ("cls.predictions.decoder.weight",)
    tied_to_bias = ("cls.predictions.decoder.bias",)

    def check_exportable(self, model):
        if model.embedding_size != model.discriminator.hidden_size:
            raise ExportError("BERT has no embedding projection")

    def hf_config(self, model, which, *, pad_id, cls_id, sep_id):
        from transformers import BertConfig

        return BertConfig(max_position_embeddings=model.max_position_embeddings,
                          **base_config_kwargs(model, getattr(model, which), pad_id=pad_id,
                                               architecture=self.class_of(which)))

    def encoder_pairs(self, num_layers, projected):
        return (wb("embeddings.norm", "embeddings.LayerNorm") + electra.POSITIONS
                + layer_pairs(num_layers, POST_LN_NORMS))


@pytest.fixture(scope="module")
def tok(wiki_shards):
    from rtd_scale.data.tokenizer import Tokenizer

    return Tokenizer(wiki_shards[0])


@pytest.fixture
def bert(monkeypatch):
    """The registry with ``Bert`` in ELECTRA's place: the one line a new target adds."""
    monkeypatch.setitem(adapters.ADAPTERS, KEY, Bert())


def _export(model, cfg, ctx, tok, path):
    write_export(canonical_state(model, ctx), cfg.model, str(path), pad_id=tok.pad_id,
                 cls_id=tok.cls_id, sep_id=tok.sep_id, note=lambda m: None)


@torch.no_grad()
def _bert_outputs(path, ids, pad_id):
    """The export's discriminator hidden + RTD logits, generator hidden + MLM logits, read by
    transformers' BERT classes (zero missing, unexpected or mismatched keys)."""
    from safetensors.torch import load_file

    from rtd_scale.hf.common import RTD_HEAD_PREFIX as p

    attention = (ids != pad_id).long()
    disc = load_checked("BertModel", path, add_pooling_layer=False)
    d_hidden = disc(ids, attention_mask=attention).last_hidden_state
    head = load_file(path / RTD_HEAD_FILE)
    x = torch.nn.functional.gelu(torch.nn.functional.linear(
        d_hidden, head[p + "dense.weight"], head[p + "dense.bias"]))
    rtd = torch.nn.functional.linear(x, head[p + "dense_prediction.weight"],
                                     head[p + "dense_prediction.bias"]).squeeze(-1)
    gen = load_checked("BertForMaskedLM", path / "generator")
    g_hidden = gen.bert(ids, attention_mask=attention).last_hidden_state
    return d_hidden, rtd, g_hidden, gen(ids, attention_mask=attention).logits


def test_a_registered_target_exports_and_imports_through_its_adapter(
        bert, single_process_group, tok, tmp_path):
    """Export: BERT's classes, our outputs (1e-4). Import → export: the same bytes, and the
    imported model computes what the first did. GDES, so the sharing rule runs both ways."""
    ctx = single_process_group
    cfg = tiny_config(LayerNormPosition.POST, Sharing.GDES, False, tok.vocab_size)
    first = build_model(cfg, ctx, tok, seed=3)
    perturb(first)
    _export(first, cfg, ctx, tok, tmp_path / "a")
    for where, cls in ((tmp_path / "a", "BertModel"),
                       (tmp_path / "a" / "generator", "BertForMaskedLM")):
        written = json.loads((where / "config.json").read_text())
        assert (written["model_type"], written["architectures"]) == ("bert", [cls])
    ids = real_batch(tok)
    mine = ours(first, ids, tok.pad_id)
    diffs = max_diffs(mine, _bert_outputs(tmp_path / "a", ids, tok.pad_id))
    assert max(diffs) < TOL, diffs
    assert mine[1].abs().max() > 0.1  # not a trivially zero comparison

    second = build_model(cfg, ctx, tok, seed=9)
    load_pretrained(second, str(tmp_path / "a"), cfg.model, pad_id=tok.pad_id,
                    tp_group=ctx.tp_group, tp_rank=0)
    _export(second, cfg, ctx, tok, tmp_path / "b")
    _assert_bitwise(_tensors(tmp_path / "a"), _tensors(tmp_path / "b"))
    for x, y in zip(mine, ours(second, ids, tok.pad_id)):
        assert torch.equal(x, y)


def test_the_registry_lists_a_registered_target(bert, tok, tmp_path):
    """The messages that name the targets are built from the registry: BERT is in them, and an
    ELECTRA checkpoint (no longer registered) is a model type none reads."""
    cfg = tiny_config(LayerNormPosition.POST, Sharing.GDES, False, tok.vocab_size)
    assert "BERT (bert)" in adapters.import_sources()
    assert "ELECTRA" not in adapters.import_sources()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "electra"}))
    with pytest.raises(UserInputError, match=r"model_type 'electra'; pass .*BERT \(bert\)"):
        read_pretrained(str(tmp_path), cfg.model, pad_id=tok.pad_id)
