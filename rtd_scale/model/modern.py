"""The modern encoder block (ModernBERT, arXiv 2412.13663 §2.1) on megatron-core's layers.

``model.attention_type`` "rotary" in the pre-LayerNorm layout builds, in each encoder:

- embeddings: token rows → (E != H: projection, no bias) → norm → dropout; no position table
  (Hugging Face ``ModernBertEmbeddings``; ``model/embeddings.py``);
- layers: megatron-core's ``TransformerLayer`` (``ModernTransformerLayer``) with ModernBERT's
  placement: x + attention(norm(x)) except in layer 1 (megatron-core's 1-based number), whose
  input is the embedding norm's output and has no attention norm of its own
  (``ModernBertEncoderLayer``: ``attn_norm`` is an identity at layer_id 0), then
  x + mlp(norm(x)); a final norm after the last layer (the block's ``final_layernorm``);
- attention: megatron-core's ``SelfAttention`` (fused QKV, column / row parallel), queries and
  keys rotated by megatron-core's rotary embedding (``apply_rotary_pos_emb``, not interleaved:
  Hugging Face's ``rotate_half``), with the base of the layer's kind: ``rotary_base`` in global
  layers, ``local_rotary_base`` in sliding-window ones (ModernBERT's 160,000 / 10,000);
  ``SDPACoreAttention`` masks keys outside the window (``model/attention.py``);
- MLP: megatron-core's ``MLP`` with ``gated_linear_unit`` (GeGLU / SwiGLU) or plain GELU;
  ``add_bias_linear`` off: no bias in QKV, output projection, fc1 or fc2;
- norms: ``torch.nn.LayerNorm`` (``norm_bias`` off: without bias) or ``torch.nn.RMSNorm``.

Which layers are local is megatron-core's rule (``is_layer_window_attention``) over the config's
``window_size`` (left, right) and ``window_attn_skip_freq`` as a per-layer list, filled from
``ModelConfig.local_layer`` (ModernBERT's pattern: layer 1 and every
``global_attn_every_n_layers``-th after it global; megatron-core's integer form would make the
n-th, 2n-th, … global instead).

Rotary angles: ``rotary_angles`` gives both kinds' angles stacked, [2, s, b or 1, 1, d], in the
block's ``rotary_pos_emb`` (a tensor, so megatron-core's full-layer recompute checkpoints it as
an input); each layer hands its own kind's [s, b or 1, 1, d] to the self-attention. Positions are
0..s-1 for every sample, or per-token ``position_ids`` [b, s] (which may restart inside a packed
sample).

Fused QKV is interleaved per head, so TP shards concatenate to the unpartitioned layout (see
``model/layers.py``); the gated fc1's rows are [a; g] with each half split over the
tensor-parallel ranks (megatron-core's layout, rank r holding [a_r; g_r]), which
``mark_gated`` records for ``model/weights.py`` so that the unpartitioned tensor is [a; g] at
any TP size (Hugging Face ``ModernBertMLP.Wi``'s chunk(2) order).
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import is_layer_window_attention

from rtd_scale.model.weights import mark_gated

# Index of each kind's angles in the stacked rotary tensor the block carries.
GLOBAL, LOCAL = 0, 1


class EncoderNorm:
    """The modern block's norm, built like megatron-core's ``WrappedTorchNorm`` (config,
    hidden_size, eps) from ``config.normalization``, with or without bias: ``LayerNorm`` →
    ``torch.nn.LayerNorm(bias=bias)``, ``RMSNorm`` → ``torch.nn.RMSNorm`` (no bias to have)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                bias: bool = True, **_: object) -> torch.nn.Module:
        return make_norm(config.normalization, hidden_size, eps, bias)


def make_norm(normalization: str, hidden_size: int, eps: float, bias: bool) -> torch.nn.Module:
    """``torch.nn.LayerNorm`` (with ``bias`` or without) or ``torch.nn.RMSNorm``."""
    if normalization == "RMSNorm":
        return torch.nn.RMSNorm(hidden_size, eps=eps)
    assert normalization == "LayerNorm", normalization
    return torch.nn.LayerNorm(hidden_size, eps=eps, bias=bias)


def is_local(config: TransformerConfig, layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based, global) attends within the sliding window."""
    return is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number)


class RotaryAngles(torch.nn.Module):
    """The rotary angles of both layer kinds: megatron-core's ``RotaryEmbedding`` at the global
    and at the local base (no parameters; the inverse frequencies are recomputed, never
    saved)."""

    def __init__(self, config: TransformerConfig, *, rotary_base: float,
                 local_rotary_base: float):
        super().__init__()
        head_dim = config.kv_channels
        self.kinds = [RotaryEmbedding(head_dim, rotary_percent=1.0, rotary_base=base,
                                      use_cpu_initialization=True)
                      for base in (rotary_base, local_rotary_base)]

    def forward(self, s: int, position_ids: Optional[torch.Tensor] = None,
                device=None) -> torch.Tensor:
        """[2, s, b, 1, d] angles at ``position_ids`` [b, s], or [2, s, 1, 1, d] at 0..s-1."""
        if position_ids is None:
            position_ids = torch.arange(s, device=device).view(1, s)
        out = []
        for rope in self.kinds:
            inv_freq = rope.inv_freq.to(position_ids.device)
            freqs = position_ids.to(inv_freq.dtype).unsqueeze(-1) * inv_freq  # [b, s, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # megatron-core's non-interleaved layout
            out.append(emb.transpose(0, 1).unsqueeze(2))  # [s, b, 1, d]
        return torch.stack(out)


class ModernTransformerLayer(TransformerLayer):
    """megatron-core's pre-LayerNorm layer with ModernBERT's placement and per-kind rotary
    angles (module docstring). forward: as ``TransformerLayer``, the block's
    ``rotary_pos_emb`` being ``RotaryAngles``' stacked tensor."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if self.layer_number == 1:  # its input is the embedding norm's output
            self.input_layernorm = IdentityOp()
        self.local = is_local(config, self.layer_number)
        if config.gated_linear_unit:
            mark_gated(self.mlp.linear_fc1.weight)

    def _forward_attention(self, *args, **kwargs):
        # megatron-core passes the block's arguments by keyword (its recompute path too)
        angles = kwargs.get("rotary_pos_emb")
        if angles is not None:
            kwargs["rotary_pos_emb"] = angles[LOCAL if self.local else GLOBAL]
        return super()._forward_attention(*args, **kwargs)
