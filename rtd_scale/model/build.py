"""The one builder of a run's ``RTDModel``: this rank's pipeline stage of the generator +
discriminator pair, as ``pretrain.py`` trains it and ``hf/consolidate.py`` reads it back
(tests that exercise the constructor itself call ``RTDModel`` directly)."""
from __future__ import annotations

from typing import TYPE_CHECKING

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
