"""Named configs (``--preset``): each a function returning a fresh, validated tree, with the
paper or code its numbers come from (STYLE rule 2: presets are functions)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from rtd_scale.config import (AttentionType, ConfigError, DataConfig, EncoderConfig,
                              LayerNormPosition, MLPActivation, ModelConfig, OptimConfig,
                              RTDConfig, RunConfig, Sharing, TrainConfig)


def _enc(layers: int, hidden: int, heads: int, **kw: Any) -> EncoderConfig:
    return EncoderConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         ffn_hidden_size=4 * hidden, **kw)


def _tiny() -> RunConfig:
    """CPU-sized: discriminator 4×96, generator 2×96 (DeBERTaV3 style: same width, half depth;
    both layer counts divide by 2, so it also runs at --pipeline-model-parallel-size 2)."""
    return RunConfig(
        preset="tiny",
        model=ModelConfig(vocab_size=8000, embedding_size=96, max_position_embeddings=128,
                          generator=_enc(2, 96, 2), discriminator=_enc(4, 96, 2)),
        # no loader workers: the tiny model steps faster than worker start-up pays back on CPU
        data=DataConfig(seq_length=128, num_workers=0),
        optim=OptimConfig(lr=1e-3, lr_warmup_iters=30),
        train=TrainConfig(train_iters=300, micro_batch_size=16, global_batch_size=32,
                          eval_interval=100, eval_iters=2),
    )


def _debertav3_tiny() -> RunConfig:
    """The main job's model (``tools/run_default.sh``): ``tiny``'s dimensions in DeBERTaV3's
    layout (disentangled attention, no absolute positions, post-LayerNorm, GDES), with 25% of
    tokens masked (ELECTRA-large's rate, arXiv 2003.10555 Table 6) and no dropout. Measured with
    ``bench/lever_study.py`` on the sample corpus (docs/main-job.md#which-levers-move-it): BERT
    attention stays on the RTD plateau for 600 steps (held-out AUC 0.55); with disentangled
    attention the run leaves it, after about 400 steps at mask 0.15 and dropout 0.1, and by
    step 300 with both levers (0.65 and 0.69 for two seeds, 0.70 and 0.69 at step 600)."""
    cfg = _tiny()
    cfg.preset = "debertav3-tiny"
    cfg.model.layernorm_position = LayerNormPosition.POST
    cfg.model.attention_type = AttentionType.DISENTANGLED
    cfg.rtd.mask_prob = 0.25
    for enc in (cfg.model.generator, cfg.model.discriminator):
        enc.hidden_dropout = enc.attention_dropout = 0.0
    cfg.train.train_iters = 600
    return cfg


def _electra(size: str) -> RunConfig:
    """ELECTRA (arXiv 2003.10555 Table 6): generator narrower, embedding projected."""
    disc, gen, emb, mask_prob, seq = {
        # discriminator 12×256, embedding 128, generator 1/4 width
        "small": (_enc(12, 256, 4), _enc(12, 64, 1), 128, 0.15, 128),
        # 12×768, generator 1/3 width
        "base": (_enc(12, 768, 12), _enc(12, 256, 4), 768, 0.15, 512),
        # 24×1024, generator 1/4 width, mask 25%
        "large": (_enc(24, 1024, 16), _enc(24, 256, 4), 1024, 0.25, 512),
    }[size]
    # BERT's LayerNorm epsilon, kept by ELECTRA's code and Hugging Face's ElectraConfig
    disc, gen = (dataclasses.replace(e, layernorm_epsilon=1e-12) for e in (disc, gen))
    return RunConfig(
        preset=f"electra-{size}",
        # post-LayerNorm encoders, as BERT and ELECTRA (arXiv 2003.10555 §3.1)
        model=ModelConfig(vocab_size=30522, embedding_size=emb, max_position_embeddings=512,
                          generator=gen, discriminator=disc, sharing=Sharing.ES,
                          layernorm_position=LayerNormPosition.POST),
        rtd=RTDConfig(mask_prob=mask_prob, mask_token_prob=0.85, random_token_prob=0.0),
        data=DataConfig(seq_length=seq),
        optim=OptimConfig(lr={"small": 5e-4, "base": 2e-4, "large": 2e-4}[size],
                          lr_warmup_iters=10000, adam_beta2=0.999),
        train=TrainConfig(train_iters={"small": 1_000_000, "base": 766_000, "large": 400_000}[size],
                          micro_batch_size=32,
                          global_batch_size={"small": 128, "base": 256, "large": 2048}[size]),
    )


def _debertav3(size: str) -> RunConfig:
    """DeBERTaV3 (arXiv 2111.09543 §4, Table 10): generator same width, half depth, GDES."""
    disc = {
        "xsmall": _enc(12, 384, 6),
        "small": _enc(6, 768, 12),
        "base": _enc(12, 768, 12),
        "large": _enc(24, 1024, 16),
    }[size]
    gen = dataclasses.replace(disc, num_layers=disc.num_layers // 2)
    return RunConfig(
        preset=f"debertav3-{size}",
        # DeBERTaV3's released configs: disentangled attention (relative_attention, pos_att_type
        # p2c|c2p, position_buckets 256, share_att_key, norm_rel_ebd layer_norm), no absolute
        # position in the input, post-LayerNorm layers, LayerNorm epsilon 1e-7
        model=ModelConfig(vocab_size=128100, embedding_size=disc.hidden_size,
                          max_position_embeddings=512, generator=gen, discriminator=disc,
                          sharing=Sharing.GDES, layernorm_position=LayerNormPosition.POST,
                          attention_type=AttentionType.DISENTANGLED, position_buckets=256,
                          max_relative_positions=-1),
        data=DataConfig(seq_length=512),
        # peak lr of Table 10 (§4's prose gives base 5e-4; slurm/pretrain_base.sh offers it)
        # TODO(verify): arXiv 2111.09543 Table 10, each size's peak learning rate
        optim=OptimConfig(lr=3e-4 if size == "large" else 6e-4, lr_warmup_iters=10000),
        train=TrainConfig(train_iters=500_000, micro_batch_size=8, global_batch_size=8192),
    )


# -- the modern block (attention_type "rotary"; model/modern.py) -------------------------------

def _modern(cfg: RunConfig, window_size: int = 128) -> RunConfig:
    """``cfg`` with ModernBERT's block (arXiv 2412.13663 §2.1; Hugging Face ModernBertConfig of
    answerdotai/ModernBERT-base and -large): RoPE with bases 160,000 (global layers) and 10,000
    (local), a sliding window of ``window_size`` tokens in every layer but every third, GeGLU,
    no bias in any linear or norm, LayerNorm epsilon 1e-5, no dropout, pre-LayerNorm placed as
    ModernBERT (``model/modern.py``), and document-masked packing."""
    m = cfg.model
    m.layernorm_position, m.attention_type = LayerNormPosition.PRE, AttentionType.ROTARY
    m.rotary_base, m.local_rotary_base = 160_000.0, 10_000.0
    m.window_size, m.global_attn_every_n_layers = window_size, 3
    m.normalization, m.norm_bias, m.add_bias_linear = "LayerNorm", False, False
    m.mlp_activation = MLPActivation.GEGLU
    for enc in (m.generator, m.discriminator):
        enc.hidden_dropout = enc.attention_dropout = 0.0
        enc.layernorm_epsilon = 1e-5
    # no attention across documents, positions from 0 in each (ModernBERT §2.1.3 trains on
    # unpadded sequences; data/packed.py, model/document_mask.py)
    cfg.data.document_masking = True
    return cfg


def _modernbert_tiny() -> RunConfig:
    """``tiny``'s dimensions (discriminator 4×96, generator 2×96) in the modern block, FFN 1.5 ×
    width (ModernBERT-base's 1152 / 768) and a 32-token window, so that at ``tiny``'s 128 tokens
    the local layers (1 and 2 of the discriminator, 1 of the generator) see a quarter of it.
    ModernBERT's 8,192 positions: no parameter depends on them (RoPE), so ``--seq-length`` may
    go up to 8,192 (the second phase of a context extension,
    docs/modern-block.md#long-context-8192-tokens-and-the-context-extension)."""
    cfg = _tiny()
    cfg.preset = "modernbert-tiny"
    cfg.model.max_position_embeddings = 8192
    for enc in (cfg.model.generator, cfg.model.discriminator):
        enc.ffn_hidden_size = 144
    return _modern(cfg, window_size=32)


def _modernbert(size: str) -> RunConfig:
    """ModernBERT-base / -large's discriminator (arXiv 2412.13663 Table 4; 149M and 395M
    parameters with the embeddings), its 50,368-id vocabulary and 8,192 positions, pretrained
    at 1,024 tokens; the generator by DeBERTaV3's rule (half depth, same width, GDES), and
    DeBERTaV3's optimiser and schedule (the RTD recipe, ``_debertav3``)."""
    disc = {"base": EncoderConfig(num_layers=22, hidden_size=768, num_attention_heads=12,
                                  ffn_hidden_size=1152),
            "large": EncoderConfig(num_layers=28, hidden_size=1024, num_attention_heads=16,
                                   ffn_hidden_size=2624)}[size]
    cfg = _debertav3("large" if size == "large" else "base")
    cfg.preset = f"modernbert-{size}"
    cfg.model = ModelConfig(vocab_size=50368, embedding_size=disc.hidden_size,
                            max_position_embeddings=8192, generator=dataclasses.replace(
                                disc, num_layers=disc.num_layers // 2),
                            discriminator=disc, sharing=Sharing.GDES)
    cfg.data.seq_length = 1024
    return _modern(cfg)


MODERN_PRESETS: dict[str, Callable[[], RunConfig]] = {
    "modernbert-tiny": _modernbert_tiny,
    **{f"modernbert-{s}": (lambda s=s: _modernbert(s)) for s in ("base", "large")},
}


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": _tiny,
    "debertav3-tiny": _debertav3_tiny,
    **{f"electra-{s}": (lambda s=s: _electra(s)) for s in ("small", "base", "large")},
    **{f"debertav3-{s}": (lambda s=s: _debertav3(s)) for s in ("xsmall", "small", "base", "large")},
    **MODERN_PRESETS,
}


def preset(name: str) -> RunConfig:
    """A fresh config tree for a named preset.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()
