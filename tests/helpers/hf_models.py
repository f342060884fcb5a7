"""Tiny models for the Hugging Face export tests: a config per layout, a model with every weight
moved off its initial value, its canonical state, and a padded batch of real text."""
from __future__ import annotations

import copy
import dataclasses
import json

import torch

from rtd_scale.config import AttentionType, LayerNormPosition, MLPActivation, Sharing
from rtd_scale.presets import preset
from rtd_scale.hf import convert
from rtd_scale.model import weights
from tests.helpers.env import TEST_DATA

POST, PRE = LayerNormPosition.POST, LayerNormPosition.PRE
DISENTANGLED = AttentionType.DISENTANGLED
ROTARY = AttentionType.ROTARY


def tiny_config(layout: str, sharing: Sharing, projected: bool, vocab_size: int):
    """4 heads of 8, discriminator 2 layers, generator 1 (narrower under E ≠ H, as ELECTRA)."""
    cfg = preset("tiny")
    cfg.model.vocab_size = vocab_size
    cfg.model.sharing = sharing
    cfg.model.max_position_embeddings = 64
    cfg.data.seq_length = 64
    if hasattr(cfg.model, "layernorm_position"):
        cfg.model.layernorm_position = layout
    enc = dict(hidden_dropout=0.0, attention_dropout=0.0, num_attention_heads=4)
    cfg.model.discriminator = dataclasses.replace(cfg.model.discriminator, num_layers=2,
                                                  hidden_size=32, ffn_hidden_size=64, **enc)
    gen_h = 16 if projected else 32
    cfg.model.generator = dataclasses.replace(cfg.model.generator, num_layers=1,
                                              hidden_size=gen_h, ffn_hidden_size=2 * gen_h,
                                              **enc)
    cfg.model.embedding_size = 24 if projected else 32
    cfg.validate()
    return cfg


def build_model(cfg, ctx, tok, seed=3):
    """``cfg``'s model by rtd_scale's one builder (``model/build.py``), on the CPU and in eval
    mode, its initial weights from ``seed`` (as ``--seed``: ``cfg.train.seed`` of a copy; ``cfg``
    itself is left as it is) and the global torch seed set to ``seed`` first."""
    from rtd_scale.model.build import build_model as build

    cfg = copy.deepcopy(cfg)
    cfg.train.seed = seed
    torch.manual_seed(seed)
    return build(cfg, dataclasses.replace(ctx, device=torch.device("cpu")), tok).eval()


@torch.no_grad()
def perturb(model, seed=0):
    """Move every parameter off its initial value (LayerNorm 1/0, zero biases, E_Δ = 0 would hide
    a swapped or dropped tensor)."""
    g = torch.Generator().manual_seed(seed)
    for p in {id(p): p for p in model.parameters()}.values():
        p.add_(torch.randn(p.shape, generator=g) * 0.05)


def real_batch(tok, b=4, max_len=40):
    """[b, s] ids of real text, [CLS] … [SEP], padded at the end to different lengths."""
    with open(TEST_DATA / "wiki_sample.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(b), f)]
    rows = []
    for i, t in enumerate(texts):
        n = max_len - 2 - 7 * i  # lengths 40, 33, 26, 19
        rows.append([tok.cls_id] + tok.encode(t)[:n] + [tok.sep_id])
    ids = torch.full((b, max_len), tok.pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    return ids


def canonical_state(model, ctx):
    return weights.full_state_dict(model, tp_group=ctx.tp_group, vocab_size=model.cfg.vocab_size)


def modern_config(vocab_size: int, *, biases: bool = False,
                  activation: MLPActivation = MLPActivation.GEGLU):
    """``tiny_config`` (GDES, E = H) in the modern block: no bias in any norm or linear unless
    ``biases`` (ModernBERT's), a 16-token window, so that ``real_batch``'s 40 tokens reach past
    it, and a layer pattern and RoPE bases that are not transformers' defaults (layers 0 and 2
    of the discriminator's 3 global, bases 40,000 / 2,000), so that a config read wrongly by
    either major computes something else; the generator 2 layers deep (one local)."""
    cfg = tiny_config(PRE, Sharing.GDES, False, vocab_size)
    m = cfg.model
    m.attention_type, m.mlp_activation = ROTARY, activation
    m.rotary_base, m.local_rotary_base = 40_000.0, 2_000.0
    m.window_size, m.global_attn_every_n_layers = 16, 2
    m.norm_bias = m.add_bias_linear = biases
    m.generator = dataclasses.replace(m.generator, num_layers=2)
    m.discriminator = dataclasses.replace(m.discriminator, num_layers=3)
    cfg.validate()
    return cfg


def layout_config(layout: str, vocab_size: int):
    """``tiny_config`` (GDES, E = H) of one export target: ``POST`` (ELECTRA), ``PRE``
    (RoBERTa-PreLayerNorm), ``DISENTANGLED`` (DebertaV2: post-LayerNorm, 8 log buckets: most
    distances up to 40 go through them) or ``ROTARY`` (ModernBERT, ``modern_config``)."""
    if layout == ROTARY:
        return modern_config(vocab_size)
    if layout != DISENTANGLED:
        return tiny_config(layout, Sharing.GDES, False, vocab_size)
    cfg = tiny_config(POST, Sharing.GDES, False, vocab_size)
    cfg.model.attention_type = DISENTANGLED
    cfg.model.position_buckets = 8
    cfg.model.max_relative_positions = 64
    cfg.validate()
    return cfg


TOL = 1e-4


@torch.no_grad()
def ours(model, ids, pad_id):
    """Our discriminator hidden [b, s, H], RTD logits [b, s], generator hidden [b, s, Hg] and
    MLM logits over the real vocabulary [b, s, V]."""
    pad = ids == pad_id
    d = model.discriminator(ids, pad)  # [s, b, H]
    g = model.generator(ids, pad)
    b, s = ids.shape
    v = model.cfg.vocab_size
    mlm = model.mlm_head(g.transpose(0, 1).reshape(b * s, -1))[:, :v].reshape(b, s, v)
    return d.transpose(0, 1), model.rtd_head(d), g.transpose(0, 1), mlm


def load_checked(cls_name, path, **kwargs):
    import transformers

    model, info = getattr(transformers, cls_name).from_pretrained(
        path, output_loading_info=True, **kwargs)
    assert {k: list(v) for k, v in info.items()} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}, info
    return model.eval()


def _side_rtd_logits(out_dir, hidden):
    """ELECTRA's discriminator_predictions read from ``rtd_head.safetensors``."""
    from safetensors.torch import load_file

    from tests.helpers.hf_deberta import _rtd_logits

    return _rtd_logits(hidden, load_file(out_dir / convert.RTD_HEAD_FILE))


@torch.no_grad()
def hf_outputs(out_dir, layout, ids, pad_id, with_positions=True, with_generator=True):
    """The export's discriminator hidden + RTD logits, generator hidden + MLM logits."""
    attention = (ids != pad_id).long()
    kw = {}
    if layout == PRE and with_positions:  # RoBERTa's offset positions, at pads too
        kw["position_ids"] = (pad_id + 1 + torch.arange(ids.shape[1])).expand_as(ids)
    if layout == ROTARY:
        disc = load_checked("ModernBertModel", out_dir)
        d_hidden = disc(ids, attention_mask=attention).last_hidden_state
        gen = load_checked("ModernBertForMaskedLM", out_dir / "generator")
        base = gen.model
        rtd = _side_rtd_logits(out_dir, d_hidden)
    elif layout == POST:
        disc = load_checked("ElectraForPreTraining", out_dir)
        d_hidden = disc.electra(ids, attention_mask=attention, **kw).last_hidden_state
        rtd = disc(ids, attention_mask=attention, **kw).logits
        if not with_generator:
            return d_hidden, rtd, None, None
        gen = load_checked("ElectraForMaskedLM", out_dir / "generator")
        base = gen.electra
    else:
        disc = load_checked("RobertaPreLayerNormModel", out_dir, add_pooling_layer=False)
        d_hidden = disc(ids, attention_mask=attention, **kw).last_hidden_state
        rtd = _side_rtd_logits(out_dir, d_hidden)
        gen = load_checked("RobertaPreLayerNormForMaskedLM", out_dir / "generator")
        base = gen.roberta_prelayernorm
    g_hidden = base(ids, attention_mask=attention, **kw).last_hidden_state
    return d_hidden, rtd, g_hidden, gen(ids, attention_mask=attention, **kw).logits


def max_diffs(a, b, mask=None):
    out = []
    for x, y in zip(a, b):
        if mask is not None:
            x, y = x[mask], y[mask]
        out.append((x - y).abs().max().item())
    return out
