"""The one builder of a run's ``RTDModel``: this rank's pipeline stage of the generator +
discriminator pair, as ``pretrain.py`` trains it and ``hf/consolidate.py`` reads it back
(tests that exercise the constructor itself call ``RTDModel`` directly)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from rtd_scale.config import MaskStrategy, Precision, RunConfig
from rtd_scale.model.rtd import RTDModel

if TYPE_CHECKING:
    from rtd_scale.data.tokenizer import Tokenizer
    from rtd_scale.distributed import ParallelContext


def build_model(cfg: RunConfig, ctx: "ParallelContext", tok: "Tokenizer") -> RTDModel:
    """``cfg``'s model on ``ctx.device``: TP from ``cfg.parallel``, this rank's stage from
    ``ctx`` (``pre_process`` / ``post_process``), activations between stages in bf16 under
    ``--bf16`` (else fp32), the special ids from ``tok`` and its word-start table when
    ``rtd.mask_strategy`` is not "token". The initial weights are a function of
    ``cfg.train.seed`` alone (``model/weights.py``)."""
    return RTDModel(cfg.model, cfg.rtd,
                    tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
                    pipeline_model_parallel_size=ctx.pp_size,
                    pre_process=ctx.is_first_stage, post_process=ctx.is_last_stage,
                    pipeline_dtype=(torch.bfloat16 if cfg.train.precision is Precision.BF16
                                    else torch.float32),
                    recompute_activations=cfg.model.recompute_activations,
                    special_ids=tok.special_ids, pad_id=tok.pad_id, mask_id=tok.mask_id,
                    seed=cfg.train.seed,
                    word_start_table=(None if cfg.rtd.mask_strategy is MaskStrategy.TOKEN
                                      else tok.word_start_table())).to(ctx.device)


def build_on_meta(cfg: RunConfig, ctx: Optional["ParallelContext"] = None) -> RTDModel:
    """``cfg``'s model on the meta device (no memory): every parameter's shape and
    tensor-parallel attributes, no values. ``ctx``: this rank's pipeline stage (None: the
    whole model, one stage); the tensor-parallel size is ``cfg.parallel``'s, as
    :func:`build_model`'s."""
    with torch.device("meta"):
        return build_model(cfg, _MetaStage(ctx), _MetaTokenizer(cfg.model.vocab_size))


class _MetaStage:
    """What :func:`build_model` reads of a ``ParallelContext``, on the meta device."""

    def __init__(self, ctx=None):
        self.pp_size = ctx.pp_size if ctx is not None else 1
        self.is_first_stage = ctx.is_first_stage if ctx is not None else True
        self.is_last_stage = ctx.is_last_stage if ctx is not None else True
        self.device = torch.device("meta")


class _MetaTokenizer:
    """What :func:`build_model` reads of a tokenizer (the ids do not change any shape)."""

    special_ids, pad_id, mask_id = (0, 1, 2, 3, 4), 0, 4

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def word_start_table(self):
        return torch.zeros(self.vocab_size, dtype=torch.bool)
