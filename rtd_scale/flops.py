"""Model FLOPs of one RTD training step and of an encoder stack: the numerator of bench/'s MFU
and the basis of tools/estimate_cost.py (one formula for both).

MFU = (model FLOPs per token × tokens/s) / (measured bf16 matmul ceiling in FLOP/s).

A multiply-add counts 2 FLOPs. For a linear layer applied to one token, the forward pass costs
2·(fan_in·fan_out); the backward pass costs twice that (gradient w.r.t. the input and w.r.t. the
weight), so forward + backward = 3 × forward. Per token and per encoder layer with hidden size h,
FFN size f and sequence length s, the forward matmuls are:

    QKV projections     3 · 2h²  = 6h²
    output projection       2h²
    FFN (h → f → h)         4hf   (= 16h² when f = 4h)
    attention scores QKᵀ    2sh   (one s-long dot product per head dimension, all heads)
    attention · V           2sh
    ------------------------------------------
    forward               8h² + 4hf + 4sh  = 24h² + 4sh when f = 4h
    forward + backward    3 · (24h² + 4sh)

Attention is bidirectional, so the s² terms are not halved. DeBERTa's disentangled attention
(arXiv 2006.03654 §3.1; ``model/disentangled.py``) adds two score terms per layer, each a dot
product of every query (content→position) or key (position→content) with the R relative
embeddings the sequence reads (R = ``model/relative_position.used_rows``: 511 of 512 at s 512
with DeBERTaV3's 256 buckets, 255 at s 128):

    content→position  q · Pkᵀ   2Rh
    position→content  k · Pqᵀ   2Rh    → attention forward 4sh + 4Rh

The modern block (ModernBERT, ``model/modern.py``) changes two terms. Its gated FFN (GeGLU /
SwiGLU) has three matrices, fc1 of width 2f and fc2: 6hf instead of 4hf. Its local layers attend
within the sliding window, each query to the K keys j with |i - j| <= w/2 inside the sequence, so
their attention costs 4Kh instead of 4sh, K the mean over the s queries (the window's edges see
fewer keys):

    K = s                                   when w/2 >= s - 1 (the window holds the sequence)
    K = (s·(w+1) - (w/2)·(w/2 + 1)) / s     otherwise, w even (2·(w/2) + 1 keys inside)

(129 keys at most for ModernBERT's 128-token window; 124.9 on average at s 1,024). The count
assumes a kernel that skips the masked blocks (FlexAttention, or flash attention's window); the
CPU path's explicit mask computes all s keys.

Projecting the R relative embeddings by each layer's query and key weights is done once per
micro-batch, not per token (4Rh² per layer and micro-batch: about 0.5% of a debertav3-large
step at 16 × 512 tokens) and is not counted. An RTD step adds, per token,
forward + backward (× 3) of:

    the generator's and the discriminator's layers (above, each with its own h, f, layer count);
    the embedding projection E → h of a model whose hidden size h differs from the table width E
        (ELECTRA's narrower generator): 2·E·h;
    the generator's MLM head at masked positions only, i.e. × mask_prob:
        dense h_g → E (2·h_g·E) and the tied vocabulary projection E → V (2·E·V);
    the discriminator's RTD head at every token: dense h_d → h_d (2h_d²) and h_d → 1 (2h_d).

The masked-LM control (``rtd.objective=mlm``, ``RTDDims.masked_lm_only``) counts one encoder of the
discriminator's shape (in the generator's entries, where the model holds it), its embedding
projection and its MLM head at the masked positions; the discriminator's entries and the RTD
head are 0. An RTD run and an MLM run of equal compute take steps in the inverse ratio of their
per-token counts (``tools/estimate_cost.py`` prints it).

Not counted: embedding lookups (gathers, no multiply-adds), biases, LayerNorm, GELU, softmax,
dropout, losses, the sampler and the optimizer — elementwise work, small next to the matmuls and
not "model FLOPs" — and disentangled attention's gathers of the c2p / p2c scores. V is the real
vocabulary (rtd_scale's padding to a multiple of 128 is not model work). An implementation that computes MLM logits at every position (Hugging Face's
``labels=-100`` idiom) or recomputes attention in the backward pass (flash) does more hardware
work than this; MFU deliberately does not credit it, so for one workload MFU ratios equal
tokens/s ratios.

Check against the H200 measurements bench/gpu_rtd_step.py compares with (its anchors):
ELECTRA-large (disc 24×1024, gen 24×256, E 1024, V 30,522, s 512, mask 15%) is 2.150 GFLOP per
token, so 96.4k tokens/s = 207 TFLOP/s = 27.5% of 754 TFLOP/s; the 24×1024 stack alone is
1.963 GFLOP per token, so 191.5k tokens/s = 376 TFLOP/s (tests/unit/test_bench_gpu_script.py
asserts both).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class EncoderDims:
    """The matmul shapes of one encoder."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    gated: bool = False  # GeGLU / SwiGLU: fc1 of width 2f
    local_layers: int = 0  # layers attending within RTDDims.window_size


@dataclass(frozen=True, kw_only=True)
class RTDDims:
    """Everything the FLOP count of one RTD step needs."""

    generator: EncoderDims
    discriminator: EncoderDims
    embedding_size: int  # E, the shared token table's width
    vocab_size: int  # V, real ids (not padded)
    seq_length: int  # s
    mask_prob: float  # fraction of tokens that reach the MLM head
    relative_rows: int = 0  # R of disentangled attention; 0 for BERT attention
    window_size: int = -1  # w of the local layers (EncoderDims.local_layers); -1: none
    masked_lm_only: bool = False  # rtd.objective=mlm: the generator's entries alone, no RTD head


def attended_keys(seq_length: int, window_size: int = -1) -> float:
    """K: the mean number of keys a query attends to in a sequence of ``seq_length``, within a
    sliding window of ``window_size`` tokens (|i - j| <= w // 2), or all of them (w = -1)."""
    s, half = seq_length, window_size // 2
    if window_size <= 0 or half >= s - 1:
        return s
    return (s * (2 * half + 1) - half * (half + 1)) / s


def layer_forward_flops_per_token(hidden_size: int, ffn_hidden_size: int, seq_length: float,
                                  relative_rows: int = 0, gated: bool = False) -> float:
    """Forward FLOPs of one encoder layer for one token: 8h² + 4hf + 4sh + 4Rh (24h² + 4sh at
    f = 4h with BERT attention, R = 0); a gated FFN 6hf. ``seq_length``: the keys each query
    attends to (``attended_keys`` in a local layer)."""
    h, f, s, r = hidden_size, ffn_hidden_size, seq_length, relative_rows
    return 8 * h * h + (6 if gated else 4) * h * f + 4 * s * h + 4 * r * h


def layer_flops_per_token(hidden_size: int, ffn_hidden_size: int, seq_length: float,
                          relative_rows: int = 0, gated: bool = False) -> tuple[float, float]:
    """(matmul, attention) forward + backward FLOPs per token of one layer:
    3·(8h² + 4hf) (gated: 6hf) and 3·(4sh + 4Rh), s the keys each query attends to."""
    h, f, s, r = hidden_size, ffn_hidden_size, seq_length, relative_rows
    return 3 * (8 * h * h + (6 if gated else 4) * h * f), 3 * 4 * (s + r) * h


def _stack_flops(enc: EncoderDims, seq_length: int, relative_rows: int,
                 window_size: int) -> tuple[float, float]:
    """(matmul, attention) forward + backward FLOPs per token of a layer stack: its global
    layers attend to all ``seq_length`` keys, its local ones to ``attended_keys``."""
    mm, att = layer_flops_per_token(enc.hidden_size, enc.ffn_hidden_size, seq_length,
                                    relative_rows, enc.gated)
    total_att = (enc.num_layers - enc.local_layers) * att
    if enc.local_layers:
        _, local = layer_flops_per_token(enc.hidden_size, enc.ffn_hidden_size,
                                         attended_keys(seq_length, window_size), relative_rows)
        total_att += enc.local_layers * local
    return enc.num_layers * mm, total_att


def stack_flops_per_token(enc: EncoderDims, seq_length: int, relative_rows: int = 0,
                          window_size: int = -1) -> float:
    """Forward + backward FLOPs per token of a layer stack alone:
    3 · L · (8h² + 4hf + 4sh + 4Rh), with the gated FFN and local layers as above."""
    return sum(_stack_flops(enc, seq_length, relative_rows, window_size))


def rtd_flops_breakdown(d: RTDDims) -> dict[str, float]:
    """Forward + backward model FLOPs of one RTD step per input token, by component (see the
    module docstring)."""
    g, disc, e, v = d.generator, d.discriminator, d.embedding_size, d.vocab_size
    encoders = (("generator", g),) if d.masked_lm_only else (("generator", g),
                                                            ("discriminator", disc))
    out: dict[str, float] = {}
    for name in ("generator", "discriminator"):
        enc = dict(encoders).get(name)
        mm, att = (0, 0) if enc is None else _stack_flops(enc, d.seq_length, d.relative_rows,
                                                          d.window_size)
        out[f"{name}_matmul"] = float(mm)
        out[f"{name}_attention"] = float(att)
    out["embedding_projection"] = float(
        sum(3 * 2 * e * enc.hidden_size for _, enc in encoders if enc.hidden_size != e))
    out["mlm_head"] = 3 * (2 * g.hidden_size * e + 2 * e * v) * d.mask_prob
    out["rtd_head"] = 0.0 if d.masked_lm_only else float(
        3 * (2 * disc.hidden_size * disc.hidden_size + 2 * disc.hidden_size))
    return out


def rtd_flops_per_token(d: RTDDims) -> float:
    """Forward + backward model FLOPs of one RTD step, per input token (see the module docstring).

    Returns a float because the MLM head term is scaled by ``mask_prob``.
    """
    return sum(rtd_flops_breakdown(d).values())


def dims_of(cfg, *, seq_length=None, vocab_size=None, mask_prob=None) -> RTDDims:
    """The RTDDims of a ``rtd_scale.config.RunConfig`` (overrides default to the config's): of
    the model it builds (``RunConfig.trained_model``; under ``rtd.objective=mlm`` the masked LM
    alone, ``masked_lm_only``)."""
    from rtd_scale.config import Objective

    m = cfg.trained_model()
    gated = m.mlp_activation.gated

    def enc(e):
        return EncoderDims(num_layers=e.num_layers, hidden_size=e.hidden_size,
                           ffn_hidden_size=e.ffn_hidden_size, gated=gated,
                           local_layers=sum(m.local_layer(n) for n in range(1, e.num_layers + 1)))

    seq_length = seq_length or cfg.data.seq_length
    return RTDDims(generator=enc(m.generator), discriminator=enc(m.discriminator),
                   embedding_size=m.embedding_size, vocab_size=vocab_size or m.vocab_size,
                   seq_length=seq_length,
                   mask_prob=cfg.rtd.mask_prob if mask_prob is None else mask_prob,
                   relative_rows=relative_rows(m, seq_length), window_size=m.window_size,
                   masked_lm_only=cfg.rtd.objective is Objective.MLM)


def relative_rows(model_cfg, seq_length: int) -> int:
    """R: the relative embeddings a sequence of ``seq_length`` reads under the config's
    disentangled attention (``model/relative_position.used_rows``); 0 for BERT attention."""
    if not model_cfg.attention_type.relative_table:
        return 0
    from rtd_scale.model.relative_position import used_rows  # torch, imported only here

    lo, hi = used_rows(seq_length, model_cfg.relative_span(), model_cfg.position_buckets,
                       model_cfg.resolved_max_relative_positions())
    return hi - lo


def mfu(flops_per_token: float, tokens_per_s: float, ceiling_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the measured matmul ceiling."""
    return flops_per_token * tokens_per_s / ceiling_flops_per_s
