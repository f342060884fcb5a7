"""DeBERTa's disentangled self-attention on megatron-core's ``SelfAttention``.

arXiv 2006.03654 §3.1 (DeBERTa) with DeBERTaV3's settings (arXiv 2111.09543; the released
configs: ``relative_attention``, ``pos_att_type`` "p2c|c2p", ``position_buckets`` 256,
``share_att_key``, ``norm_rel_ebd`` "layer_norm"), written to equal Hugging Face's
``DebertaV2Model`` (``models/deberta_v2/modeling_deberta_v2.py``; tested with copied weights in
``tests/unit/test_disentangled.py``). For query i, key j, head dimension d:

    A[i, j] = ( q_i·k_j  +  q_i·Pk[δ(i, j)]  +  k_j·Pq[δ(i, j)] ) / sqrt(3·d)
               content→content   content→position   position→content

    δ(i, j) = clamp(bucket(i − j) + k, 0, 2k − 1)

with P = LayerNorm(R), R the encoder's one table of 2k relative embeddings [2k, H] (shared by
all layers), and Pq, Pk its projections by each layer's *own* query and key weights and biases
(``share_att_key``: no separate position projections). ``bucket`` keeps distances below k/2 and
maps longer ones logarithmically up to ``max_relative_positions`` (``log_bucket_position``).
The position-to-content term reads Pq at δ(i, j) = clamp(−bucket(j − i) + k): ``bucket`` is odd,
so one index matrix serves both terms.

Tensor parallelism: q, k, v and Pq, Pk come from megatron-core's column-parallel ``linear_qkv``
(each rank holds whole heads; the relative table R is replicated, and the linear's input
all-reduce in backward sums R's gradient over the heads of every rank), the output from the
row-parallel ``linear_proj`` — the names, shapes and initialisation of a ``SelfAttention``.

The relative embeddings reach each layer's attention through two of megatron-core's arguments,
named here only (``RELATIVE_TABLE_BLOCK_ARG``, ``RELATIVE_TABLE_ATTENTION_ARG``), which leaves
its rotary ones (``rotary_pos_emb`` …) to a rotary attention:

- the ``TransformerBlock``'s ``context``: the block passes it to every layer and threads each
  layer's returned ``context`` to the next, and its full-layer activation recompute takes it as
  a differentiable checkpoint input (a tensor captured any other way would be back-propagated
  once per layer through one graph) — in an encoder it has no other use (megatron-core gives it
  to cross-attention, which an encoder has none of);
- the layer (``PostLNTransformerLayer``, the one layout disentangled attention has) hands it to
  its self-attention as ``attention_bias``, megatron-core's argument for what the attention
  scores are biased by (its T5 passes relative-position biases there), and returns it
  unchanged.

Padding as Hugging Face's ``DebertaV2Encoder.get_attention_mask``: a score is masked when its
key *or* its query is [PAD], so a [PAD] query's row is masked whole and averages over every key
(its output is never read by a loss, but it makes every hidden state equal Hugging Face's).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from rtd_scale.model import disentangled_flash
from rtd_scale.model.relative_position import (log_bucket_position,  # noqa: F401 (re-exported)
                                               relative_position_index, used_rows)

# The arguments an encoder's relative table P [2k, H] travels in (the module docstring says why):
# the TransformerBlock's, and the self-attention's that the layer hands it on in.
RELATIVE_TABLE_BLOCK_ARG = "context"
RELATIVE_TABLE_ATTENTION_ARG = "attention_bias"

# Implementations of the attention core (benchmarked in bench/deberta_step_vs_hf.py):
#   "explicit": scores [b, n, s, s] = c2c + c2p + p2c, softmax, dropout, @ V
#   "sdpa": the same c2p + p2c as one float bias, the rest in PyTorch's
#           scaled_dot_product_attention (its memory-efficient kernel takes a bias with grad on GPU)
#   "flex": one FlexAttention kernel reading the c2p / p2c tables in a score modification
#           (``disentangled_flex.py``; CUDA, no attention-probability dropout)
#   "flash": flashdeberta's Triton kernels, forward and backward, the c2p / p2c gathers inside
#            (``disentangled_flash.py``; CUDA, ``pip install '.[gpu]'``, no attention-probability
#            dropout; key padding, and document-masked packing through its varlen kernel)
# (config: ``model.disentangled_core``, ``config.DisentangledCore``)
IMPLEMENTATIONS = ("explicit", "sdpa", "flex", "flash")
# How "explicit" and "sdpa" build c2p and p2c [b, n, s, s] (the same values):
#   "gather": [b, n, s, r] matmuls against the r relative rows, gathered at δ(i, j); the
#             backward pass of a gather is a scatter-add (atomics on GPU)
#   "shift": [b, n, s, 2s − 1] matmuls against the row of each distance i − j, skewed into
#            place by a view (``relative_shift``): twice the matmul work at s = 2k, no
#            gather and no scatter-add. On CPU a whole step measured 3–4% faster at seq 128
#            and 5–12% slower at seq 512 (bench/README.md); on GPU it is unmeasured, so it is
#            not the default.
RELATIVE_TERMS = ("gather", "shift")


def distance_rows(index: torch.Tensor) -> torch.Tensor:
    """[2s − 1] int64: the row ``index`` [s, s] (a function of i − j, as δ is) gives each
    distance i − j = −(s − 1), …, s − 1, in that order."""
    return torch.cat((index[0, 1:].flip(0), index[:, 0]))


def relative_shift(x: torch.Tensor) -> torch.Tensor:
    """[..., s, 2s − 1] → [..., s, s] with out[..., i, j] = x[..., i, j − i + s − 1]: a view
    (Transformer-XL's "relative shift", arXiv 1901.02860 App. B, done by re-striding the
    contiguous rows), whose backward pass is a strided copy, not a scatter."""
    s = x.shape[-2]
    if s == 1:
        return x
    flat = x.contiguous().flatten(-2)[..., s - 1:s - 1 + s * (2 * s - 2)]
    return flat.unflatten(-1, (s, 2 * s - 2))[..., :s]


def disentangled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           pos_q: torch.Tensor, pos_k: torch.Tensor, index: torch.Tensor,
                           key_pad: Optional[torch.Tensor], *, dropout_p: float = 0.0,
                           impl: str = "explicit",
                           relative_terms: str = "gather") -> torch.Tensor:
    """The attention core, heads batched.

    Args:
        q, k, v: [b, n, s, d] content queries, keys, values.
        pos_q, pos_k: [n, r, d] relative embeddings projected by the query / key weights (all
            2k rows, or the rows ``index`` reads).
        index: [s, s] int64, δ(i, j) (``relative_position_index``) minus the first row given.
        key_pad: bool [b, 1, 1, s], True at [PAD], or [b, 1, s, s], True where query i may not
            see key j (``model/document_mask.py``: another document, or a [PAD] key), or None.
            A score is masked when it is masked for (i, j) or for (j, i) — with key padding
            alone: when its key or its query is [PAD] (a fully masked row becomes uniform, as
            in Hugging Face); the document mask is symmetric.
        dropout_p: attention-probability dropout (the caller picks the RNG).
        impl: one of ``IMPLEMENTATIONS``.
        relative_terms: one of ``RELATIVE_TERMS`` (explicit and sdpa; flex reads the tables
            in its kernel).
    Returns:
        [b, n, s, d].
    """
    b, n, s, d = q.shape
    scale = 1.0 / math.sqrt(3 * d)  # three terms (arXiv 2006.03654 §3.1, "scaled by 1/sqrt(3d)")
    assert impl != "flash", "the flash core takes the relative rule: DisentangledCoreAttention"
    if impl == "flex":
        if key_pad is not None and key_pad.shape[-2] != 1:
            raise ValueError("the flex attention core takes key padding only, not a document "
                             "mask (--reset-attention-mask): use the sdpa or explicit core")
        if dropout_p > 0:
            raise ValueError("the flex attention core has no attention-probability dropout: "
                             "set --attention-dropout 0 (and --generator-attention-dropout 0) "
                             "or use the sdpa core")
        from rtd_scale.model.disentangled_flex import flex_disentangled_attention

        return flex_disentangled_attention(q, k, v, pos_q, pos_k, index, key_pad, scale)
    qs = q * scale
    if relative_terms == "shift":
        # δ(i, j) depends on i − j only: one matmul per term against the row of each distance,
        # skewed into place by a view — no gather of [b, n, s, s], no scatter-add backward
        by_distance = distance_rows(index)  # [2s − 1]: the row of i − j = −(s − 1) … s − 1
        # content→position q_i · Pk[δ(i, j)]: column c of [b, n, s, 2s − 1] is i − j = s − 1 − c
        c2p = relative_shift(torch.matmul(qs, pos_k[:, by_distance.flip(0)].transpose(-1, -2)))
        # position→content k_j · Pq[δ(i, j)]: row j, column c is i − j = c − (s − 1); transposed
        p2c = relative_shift(torch.matmul(k * scale, pos_q[:, by_distance].transpose(-1, -2)))
        bias = c2p + p2c.transpose(-1, -2)  # [b, n, s, s]
    else:
        assert relative_terms == "gather", relative_terms
        # content→position: q_i · Pk[δ(i, j)]  — [b, n, s, r] gathered to [b, n, s, s]
        idx = index.expand(b, n, s, s)
        bias = torch.gather(torch.matmul(qs, pos_k.transpose(-1, -2)), -1, idx)
        # position→content: k_j · Pq[δ(i, j)] — row j of (k · Pqᵀ) gathered at δ(i, j)ᵀ,
        # transposed
        bias = bias + torch.gather(torch.matmul(k * scale, pos_q.transpose(-1, -2)), -1,
                                   index.t().expand(b, n, s, s)).transpose(-1, -2)
    masked = None if key_pad is None else key_pad | key_pad.transpose(-1, -2)  # [b, 1, s, s]
    if impl == "sdpa":
        if masked is not None:
            bias = bias.masked_fill(masked, torch.finfo(bias.dtype).min)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout_p, scale=scale)
    assert impl == "explicit", impl
    scores = torch.matmul(qs, k.transpose(-1, -2)) + bias  # [b, n, s, s]
    if masked is not None:
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)


class DisentangledCoreAttention(MegatronModule):
    """The core of disentangled attention, on one tensor-parallel rank's heads.

    forward(query, key, value [s, b, n, d], attention_mask bool [b, 1, 1, s] (True = masked key,
    megatron's convention) or [b, 1, s, s] (query × key, document-masked packing) or, to the
    flash core, int [b, s] (the compact document mask, ``document_mask.document_keys``) or
    None, pos_query, pos_key [hi − lo, 1, n, d]: rows [lo, hi) = ``self.rows(s)`` of the
    projected relative table) -> [s, b, n·d]. Attention-probability dropout draws from
    megatron-core's model-parallel RNG tracker (heads are split over TP ranks). No parameters.

    Args (beyond megatron-core's core-attention constructor):
        position_buckets: k (> 0) or -1 (no buckets); max_relative_positions: resolved (> 0).
        impl: ``IMPLEMENTATIONS``; None picks "sdpa" on CUDA and "explicit" elsewhere, and so
            does "flash" where flashdeberta cannot run (``disentangled_flash.runs_on``).
    """

    def __init__(self, config: TransformerConfig, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, *,
                 position_buckets: int, max_relative_positions: int,
                 impl: Optional[str] = None) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("DisentangledCoreAttention does not support context parallelism")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.position_buckets = position_buckets
        self.max_relative_positions = max_relative_positions
        self.span = position_buckets if position_buckets > 0 else max_relative_positions
        assert impl is None or impl in IMPLEMENTATIONS, impl
        self.impl = impl
        self.relative_terms = "gather"  # RELATIVE_TERMS; bench/deberta_step_vs_hf.py times both

    def core(self, device: torch.device) -> str:
        """The implementation that runs on ``device`` (``impl``, resolved)."""
        auto = "sdpa" if device.type == "cuda" else "explicit"
        if self.impl == "flash" and not disentangled_flash.runs_on(device):
            return auto
        return self.impl or auto

    def rows(self, seq_length: int) -> tuple[int, int]:
        """[lo, hi): the relative rows a sequence of this length reads (``used_rows``)."""
        return used_rows(seq_length, self.span, self.position_buckets,
                         self.max_relative_positions)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], *, pos_query: torch.Tensor,
                pos_key: torch.Tensor) -> torch.Tensor:
        s, b, n, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, d]
        pq, pk = (t.squeeze(1).transpose(0, 1) for t in (pos_query, pos_key))  # [n, r, d]
        lo = self.rows(s)[0]
        impl = self.core(query.device)
        dropout_p = self.dropout_p if self.training else 0.0
        if impl == "flash":
            out = disentangled_flash.flash_disentangled_attention(
                q, k, v, pq, pk, attention_mask, scale=1.0 / math.sqrt(3 * d), first_row=lo,
                position_buckets=self.position_buckets,
                max_relative_positions=self.max_relative_positions, dropout_p=dropout_p)
            return out.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, n·d]
        key_pad = (attention_mask if attention_mask is None or attention_mask.dim() == 4
                   else attention_mask.view(b, 1, 1, s))
        index = relative_position_index(s, self.span, self.position_buckets,
                                        self.max_relative_positions, device=query.device) - lo
        if dropout_p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = disentangled_attention(q, k, v, pq, pk, index, key_pad,
                                             dropout_p=dropout_p, impl=impl,
                                             relative_terms=self.relative_terms)
        else:
            out = disentangled_attention(q, k, v, pq, pk, index, key_pad, impl=impl,
                                         relative_terms=self.relative_terms)
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, n·d]


class DisentangledSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` (same ``linear_qkv`` / ``linear_proj``, TP split, names)
    whose core also reads the relative embeddings.

    forward(hidden_states [s, b, H], attention_mask, attention_bias=P [2k, H], ...) ->
    (output [s, b, H], bias [H] or None), as ``SelfAttention``. P is the encoder's LayerNorm'd
    relative table (``RELATIVE_TABLE_ATTENTION_ARG``; see the module docstring). Neither rotary
    embeddings, packed sequences nor inference caches.
    """

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                key_value_states=None, inference_context=None,
                rotary_pos_emb: Optional[torch.Tensor] = None, rotary_pos_cos=None,
                rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None):
        table = attention_bias  # RELATIVE_TABLE_ATTENTION_ARG
        if not isinstance(table, torch.Tensor):
            raise ValueError("disentangled attention needs the relative embeddings [2k, H] "
                             f"(the Encoder's block argument {RELATIVE_TABLE_BLOCK_ARG!r}, handed "
                             f"on by the layer as {RELATIVE_TABLE_ATTENTION_ARG!r})")
        if (rotary_pos_emb is not None or packed_seq_params is not None
                or inference_context is not None or inference_params is not None):
            raise ValueError("disentangled attention supports neither rotary embeddings, "
                             "packed sequences nor inference caches")
        query, key, value = self.get_query_key_value_tensors(hidden_states)  # [s, b, n, d]
        # each layer drops out its own copy of P (Hugging Face ``pos_dropout``, hidden dropout);
        # P is replicated over TP ranks, so the default generator (shared by TP peers) draws it
        lo, hi = self.core_attention.rows(hidden_states.shape[0])  # the rows this length reads
        rel = torch.nn.functional.dropout(table[lo:hi].to(hidden_states.dtype),
                                          p=self.config.hidden_dropout, training=self.training)
        # the relative table through this layer's own query / key projections (share_att_key)
        pos_query, pos_key, _ = self.get_query_key_value_tensors(rel.unsqueeze(1))  # [2k,1,n,d]
        context = self.core_attention(query, key, value, attention_mask,
                                      pos_query=pos_query, pos_key=pos_key)
        return self.linear_proj(context)


def relative_embeddings(table: torch.nn.Embedding, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """P = LayerNorm(R) [2k, H], the relative table every layer reads (Hugging Face
    ``DebertaV2Encoder.get_rel_embedding`` with ``norm_rel_ebd = layer_norm``). Both are called
    as modules, so DeepSpeed ZeRO-3 gathers their parameters."""
    rows = torch.arange(table.num_embeddings, device=table.weight.device)
    return norm(table(rows))
