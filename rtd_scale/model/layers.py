"""The post-LayerNorm transformer layer of BERT / ELECTRA on megatron-core's ``TransformerLayer``.

megatron-core's layer is pre-LayerNorm: x + f(LN(x)) for each residual branch f. BERT (arXiv
1810.04805 §3, after arXiv 1706.03762 §5.4) and ELECTRA (arXiv 2003.10555 §3.1) normalise after
each residual add instead, exactly as Hugging Face's ``ElectraLayer`` (``ElectraSelfOutput`` and
``ElectraOutput``):

    y = LN_1(x + dropout(proj(attention(x))))
    z = LN_2(y + dropout(fc2(gelu(fc1(y)))))

``PostLNTransformerLayer`` keeps megatron-core's own submodules and forward (the same attention,
MLP, bias-dropout-add, TP splitting, recompute and pipeline handling) with its two pre-branch
norms left as ``IdentityOp``, and applies one LayerNorm after each bias-dropout-add. The spec in
``model/specs.py`` chooses it.

Parameters of one layer (names relative to the layer, shapes on one tensor-parallel rank of T,
hidden H, FFN F):

    self_attention.linear_qkv.{weight [3H/T, H], bias [3H/T]}   fused Q, K, V, interleaved per
        head: rows [3d·h, 3d·h + d) are head h's query, the next d its key, the next d its value
        (d = H / heads); TP shards split whole heads, and concatenating them along dim 0 gives
        the unpartitioned layout.
    self_attention.linear_proj.{weight [H, H/T], bias [H]}       attention output (row parallel)
    post_self_attn_layernorm.{weight [H], bias [H]}              LN_1 (HF attention.output.LayerNorm)
    mlp.linear_fc1.{weight [F/T, H], bias [F/T]}                 (HF intermediate.dense)
    mlp.linear_fc2.{weight [H, F/T], bias [H]}                   (HF output.dense)
    post_mlp_layernorm.{weight [H], bias [H]}                    LN_2 (HF output.LayerNorm)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from rtd_scale.model.disentangled import RELATIVE_TABLE_ATTENTION_ARG, RELATIVE_TABLE_BLOCK_ARG


@dataclass
class PostLNTransformerLayerSubmodules(TransformerLayerSubmodules):
    """megatron-core's layer submodules plus the norm after each residual add."""

    post_self_attn_layernorm: Union[ModuleSpec, type] = IdentityOp
    post_mlp_layernorm: Union[ModuleSpec, type] = IdentityOp


class PostLNTransformerLayer(TransformerLayer):
    """A megatron-core ``TransformerLayer`` that normalises after each residual add.

    forward: as ``TransformerLayer`` — hidden_states [s, b, H] in, ([s, b, H], context) out.
    Its spec must leave ``input_layernorm`` and ``pre_mlp_layernorm`` as ``IdentityOp``
    (ValueError otherwise). The norms use the config's ``layernorm_epsilon``.
    """

    def __init__(self, config, submodules: PostLNTransformerLayerSubmodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        if not (isinstance(self.input_layernorm, IdentityOp)
                and isinstance(self.pre_mlp_layernorm, IdentityOp)):
            raise ValueError("PostLNTransformerLayer normalises after the residual adds; its spec "
                             "must leave input_layernorm and pre_mlp_layernorm as IdentityOp")
        self.post_self_attn_layernorm = build_module(
            submodules.post_self_attn_layernorm, config=self.config,
            hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)
        self.post_mlp_layernorm = build_module(
            submodules.post_mlp_layernorm, config=self.config,
            hidden_size=self.config.hidden_size, eps=self.config.layernorm_epsilon)

    def _forward_attention(self, *args, **kwargs):
        # An encoder's relative table (disentangled attention) arrives in the block's argument
        # for it and goes on to the self-attention in the attention's, unchanged to the next
        # layer (model/disentangled.py names both); megatron-core would give it to
        # cross-attention, which an encoder has none of.
        table = kwargs.pop(RELATIVE_TABLE_BLOCK_ARG, None)
        if table is not None:
            kwargs[RELATIVE_TABLE_ATTENTION_ARG] = table
        # megatron-core returns x + dropout(proj(attention(x)) + bias) (no cross-attention here)
        hidden_states, _ = super()._forward_attention(*args, **kwargs)
        return self.post_self_attn_layernorm(hidden_states), table

    def _forward_post_mlp(self, mlp_output_with_bias, residual) -> torch.Tensor:
        # megatron-core returns residual + dropout(fc2(...) + bias)
        hidden_states = super()._forward_post_mlp(mlp_output_with_bias, residual)
        return self.post_mlp_layernorm(hidden_states)
