"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

A drop-in ``core_attention`` for megatron-core's ``SelfAttention`` (same constructor and forward
signature as ``megatron.core.transformer.dot_product_attention.DotProductAttention``). On GPU,
SDPA dispatches to flash / memory-efficient kernels; on CPU it needs no CUDA state, unlike the
local ``DotProductAttention``. In a layer that megatron-core's ``is_layer_window_attention`` calls
local (the config's ``window_size`` (left, right) and ``window_attn_skip_freq``; the modern block,
``model/modern.py``) query i attends only keys i - left … i + right, an explicit [s, s] mask
combined with the padding mask (megatron-core's local attention builds its window mask on CUDA
only and in place of the padding mask). Given the compact mask of ``model/document_mask.py``
(``document_keys``: int32 [b, s], what the encoder passes on CUDA), it runs FlexAttention over a
block mask built from it (document × padding × the layer's window), writing no [b, s, s] tensor;
with attention-probability dropout, which FlexAttention lacks, it writes the mask out and runs
SDPA as on the CPU. Attention-probability dropout (inside the tensor-parallel region:
heads are split over TP ranks) draws from megatron-core's model-parallel RNG tracker.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from rtd_scale.model import document_mask


class SDPACoreAttention(MegatronModule):
    """Bidirectional attention with a key-padding mask.

    forward(query, key, value, attention_mask):
        query, key, value: [s, b, heads_per_rank, head_dim]
        attention_mask: bool, [b, 1, 1, s] (masked keys) or [b, 1, s, s] (masked query-key
            pairs), True = masked (megatron's convention); int32 [b, s], the compact document
            mask (``document_mask.document_keys``: FlexAttention); or None.
        returns: [s, b, heads_per_rank * head_dim]

    A query row with every key masked (SDPA would return NaN there: a sample that is entirely
    padding, or a [PAD] query whose window holds only [PAD] keys) attends to every key instead;
    no loss reads it.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.window_size = (config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
        s, b, h, d = query.shape
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        if attention_mask is not None and attention_mask.dtype == torch.int32:
            if dropout_p == 0:
                out = flex_masked_attention(q, k, v, attention_mask, self.window_size,
                                            self.softmax_scale)
                return out.permute(2, 0, 1, 3).reshape(s, b, h * d)
            attention_mask = document_mask.expand(attention_mask)
        keep = None
        if attention_mask is not None:
            keep = ~attention_mask
        if self.window_size is not None:
            band = window_keep(s, self.window_size, q.device)
            keep = band if keep is None else keep & band
        if keep is not None:
            keep = keep | ~keep.any(dim=-1, keepdim=True)  # never a fully masked row
        if dropout_p > 0:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=0.0, scale=self.softmax_scale)
        # [b, h, s, d] -> [s, b, h * d]
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def window_keep(s: int, window_size: tuple[int, int], device=None) -> torch.Tensor:
    """[s, s] bool, True where query i may attend key j: i - left <= j <= i + right."""
    i = torch.arange(s, device=device)
    q, k = i.view(s, 1), i.view(1, s)
    # two [s, s] comparisons, no [s, s] int64 j - i: at s 8,192 that was 512 MiB and 10× the time
    return (k >= q - window_size[0]) & (k <= q + window_size[1])


def flex_masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                          window_size: Optional[tuple[int, int]], scale: float) -> torch.Tensor:
    """FlexAttention over the compact mask ``keys`` [b, s] (``document_mask.block_mask``) and
    ``window_size`` or none; q, k, v and the result [b, h, s, d]. Compiled on CUDA (the fused
    kernel); eager elsewhere, forward only (PyTorch's CPU FlexAttention has no backward), which
    is how the tests compare it with the explicit mask. A [PAD] query sees no key: its output
    is 0 (SDPA's core would let it see every key; no loss reads it)."""
    from torch.nn.attention.flex_attention import flex_attention

    mask = document_mask.block_mask(keys, window_size)
    if q.is_cuda:
        from rtd_scale.model.disentangled_flex import compiled_flex_attention

        return compiled_flex_attention()(q, k, v, block_mask=mask, scale=scale)
    return flex_attention(q, k, v, block_mask=mask, scale=scale)
