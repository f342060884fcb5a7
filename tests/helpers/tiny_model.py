"""Tiny RTD configs (the unit tests' and the multi-process workers'), and one-process RTD models
and batches for the unit tests of the model's gradient paths."""
from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import torch

from rtd_scale.config import AttentionType, LayerNormPosition, Sharing
from rtd_scale.presets import preset
from rtd_scale.model.build import build_model
from rtd_scale.model.rtd import RTDModel

SPECIAL = (0, 1, 2, 3, 4)  # [PAD] [CLS] [SEP] [UNK] [MASK], tools/train_tokenizer.py's ids

# one process, the whole model: what build_model reads of a ParallelContext
ONE_STAGE = SimpleNamespace(pp_size=1, is_first_stage=True, is_last_stage=True,
                            device=torch.device("cpu"))


class FixedIds:
    """What ``build_model`` reads of a tokenizer, for the tests' synthetic ids: the ids
    tools/train_tokenizer.py gives the special tokens, and a word-start table when the test
    brings one."""

    special_ids, pad_id, mask_id = SPECIAL, 0, 4

    def __init__(self, word_start_table=None):
        self.table = word_start_table

    def word_start_table(self):
        if self.table is None:
            raise ValueError("this test's ids have no words: pass word_start_table")
        return self.table


def tiny_config(sharing: Sharing, *, embedding_size: int = 48, dropout: float = 0.0,
                vocab_size: int = 300, layout: str = "pre", attention: str = "bert",
                position_buckets: int = 8, num_layers: tuple[int, int] = (1, 2)):
    """The tiny preset made smaller: a generator 32 wide (2 heads, FFN 64) and a discriminator 48
    wide (4 heads, FFN 96), ``num_layers`` (generator, discriminator) deep, over ``vocab_size``
    ids. ``attention`` "disentangled": DeBERTa's attention with ``position_buckets`` buckets (8:
    the tests' 40-token batches reach its logarithmic buckets); "rotary": the modern block
    (``modernbert-tiny``'s settings) with an 8-token window, so that the tests' 32–40-token
    batches have tokens outside it, and layer 1 of 3 global (``layout`` must be "pre")."""
    cfg = preset("modernbert-tiny" if attention == "rotary" else "tiny")
    if attention == "rotary":
        cfg.model.window_size = 8
    cfg.model.vocab_size = vocab_size
    cfg.model.sharing = sharing
    cfg.model.layernorm_position = LayerNormPosition(layout)
    cfg.model.attention_type = AttentionType(attention)
    cfg.model.position_buckets = position_buckets
    cfg.model.embedding_size = embedding_size
    cfg.model.generator = dataclasses.replace(
        cfg.model.generator, num_layers=num_layers[0], hidden_size=32, num_attention_heads=2,
        ffn_hidden_size=64, hidden_dropout=dropout, attention_dropout=dropout)
    cfg.model.discriminator = dataclasses.replace(
        cfg.model.discriminator, num_layers=num_layers[1], hidden_size=48, num_attention_heads=4,
        ffn_hidden_size=96, hidden_dropout=dropout, attention_dropout=dropout)
    return cfg


def build(cfg, ctx=ONE_STAGE, *, seed: int, tp: int = 1, word_start_table=None,
          tok=None) -> RTDModel:
    """``cfg``'s model through the product's one builder (``model/build.py``) at ``seed``, TP
    ``tp`` and ``ctx``'s pipeline stage; ``cfg`` itself is left as it is. Its special ids (and
    word-start table) are ``tok``'s, a real tokenizer, or by default ``FixedIds``'."""
    cfg = copy.deepcopy(cfg)
    cfg.train.seed = seed
    cfg.parallel.tensor_model_parallel_size = tp
    return build_model(cfg, ctx, FixedIds(word_start_table) if tok is None else tok)


def tiny_rtd_model(cfg, seed: int = 5) -> RTDModel:
    """``cfg``'s RTDModel at TP 1, seeded."""
    torch.manual_seed(seed)
    return build(cfg, seed=seed)


def sample_ids(b: int = 4, s: int = 32, seed: int = 0) -> torch.Tensor:
    """[b, s] ids in [5, 300) framed by [CLS] … [SEP]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    return ids


def grad_abs_sums(loss: torch.Tensor, params) -> list[float]:
    """Σ|∂loss/∂p| for each of ``params`` (0.0 where ``loss`` does not reach p)."""
    gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return [0.0 if g is None else g.abs().sum().item() for g in gs]
