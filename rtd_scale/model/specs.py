"""The only place that picks layer implementations (STYLE: ModuleSpec, not forked models).

Both encoders use megatron-core's tensor-parallel linear layers (ColumnParallelLinear /
RowParallelLinear, even at TP=1), its ``SelfAttention`` and ``MLP``, with core attention
``SDPACoreAttention`` (PyTorch SDPA: flash on GPU, no CUDA state on CPU). The layer depends on
``model.layernorm_position``:

- "pre": megatron-core's ``TransformerLayer``, LayerNorm on each residual branch's input (as
  megatron-core's BERT). Where TransformerEngine is installed and a GPU is used, its fused
  LayerNorm+linear layers are used instead (the norms then live inside ``linear_qkv`` and
  ``linear_fc1`` as ``layer_norm_weight`` / ``layer_norm_bias``).
- "post": ``PostLNTransformerLayer`` (``model/layers.py``), LayerNorm after each residual add
  (BERT / ELECTRA, Hugging Face ``ElectraLayer``). With TransformerEngine its plain linears are
  used (a norm after the add cannot be fused into the next linear); parameter names are the same.

``model.attention_type`` "disentangled" (post layout only) swaps the attention for
``DisentangledSelfAttention`` with ``DisentangledCoreAttention`` (``model/disentangled.py``,
DeBERTa): the same ``linear_qkv`` / ``linear_proj``, so parameter names and shapes do not change.

``model.attention_type`` "rotary" (pre layout only) builds the modern block's layer,
``ModernTransformerLayer`` (``model/modern.py``): megatron-core's attention and MLP with torch
norms built by ``EncoderNorm`` (LayerNorm with or without bias, or RMSNorm; TransformerEngine's
plain linears on GPU, as the post layout: its fused norm+linear has a bias and would sit in
layer 1, which has no attention norm).
"""
from __future__ import annotations

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from rtd_scale.config import AttentionType, LayerNormPosition
from rtd_scale.model.attention import SDPACoreAttention
from rtd_scale.model.disentangled import DisentangledCoreAttention, DisentangledSelfAttention
from rtd_scale.model.layers import PostLNTransformerLayer, PostLNTransformerLayerSubmodules
from rtd_scale.model.modern import EncoderNorm, ModernTransformerLayer


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _self_attention(qkv, proj, relative: dict | None = None) -> ModuleSpec:
    """BERT attention, or with ``relative`` (position_buckets, max_relative_positions)
    DeBERTa's disentangled attention."""
    core = SDPACoreAttention
    if relative is not None:
        core = ModuleSpec(module=DisentangledCoreAttention, params=dict(relative))
    return ModuleSpec(
        module=SelfAttention if relative is None else DisentangledSelfAttention,
        params={"attn_mask_type": AttnMaskType.padding},
        submodules=SelfAttentionSubmodules(
            linear_qkv=qkv,
            core_attention=core,
            linear_proj=proj,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )


def _plain_linears(use_transformer_engine: bool):
    """Column- and row-parallel linears without a fused norm: TransformerEngine's or
    megatron-core's."""
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelLinear,
            TERowParallelLinear,
        )

        return TEColumnParallelLinear, TERowParallelLinear
    return ColumnParallelLinear, RowParallelLinear


def encoder_norm_spec(bias: bool = True) -> ModuleSpec:
    """The modern block's norm (``EncoderNorm``: the config's ``normalization``, with or without
    bias)."""
    return ModuleSpec(module=EncoderNorm, params={"bias": bias})


def encoder_layer_spec(layernorm_position: LayerNormPosition = LayerNormPosition.PRE,
                       use_transformer_engine: bool | None = None, *,
                       attention_type: AttentionType = AttentionType.BERT,
                       position_buckets: int = 256,
                       max_relative_positions: int = 512,
                       disentangled_core: str | None = None,
                       norm_bias: bool = True) -> ModuleSpec:
    """The transformer-layer spec of both encoders (bidirectional, padding mask).

    Args:
        layernorm_position: "pre" (megatron-core's ``TransformerLayer``) or "post"
            (``PostLNTransformerLayer``, BERT / ELECTRA).
        use_transformer_engine: None picks TE when it is importable and a GPU is present.
        attention_type: "bert", "disentangled" (post layout only; DeBERTa) or "rotary" (pre
            layout only; the modern block).
        position_buckets, max_relative_positions: disentangled attention's relative positions
            (``max_relative_positions`` resolved, > 0).
        disentangled_core: its core's implementation (``disentangled.IMPLEMENTATIONS``), or
            None for the device's default.
        norm_bias: the modern block's norms have a bias (LayerNorm only).
    Raises:
        ValueError: an unknown ``layernorm_position`` or ``attention_type``, or disentangled
            attention in the pre layout.
    """
    relative = None
    if attention_type.disentangled:
        if layernorm_position is not LayerNormPosition.POST:
            raise ValueError("disentangled attention needs the post-LayerNorm layout")
        relative = {"position_buckets": position_buckets,
                    "max_relative_positions": max_relative_positions, "impl": disentangled_core}
    if use_transformer_engine is None:
        use_transformer_engine = _have_transformer_engine()
    if attention_type.rotary:
        if layernorm_position is not LayerNormPosition.PRE:
            raise ValueError("rotary attention (the modern block) needs the pre-LayerNorm layout")
        column, row = _plain_linears(use_transformer_engine)
        return ModuleSpec(
            module=ModernTransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=encoder_norm_spec(norm_bias),
                self_attention=_self_attention(column, row),
                self_attn_bda=get_bias_dropout_add,
                pre_mlp_layernorm=encoder_norm_spec(norm_bias),
                mlp=ModuleSpec(module=MLP,
                               submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
                mlp_bda=get_bias_dropout_add,
            ),
        )
    if layernorm_position is LayerNormPosition.POST:
        column, row = _plain_linears(use_transformer_engine)
        return ModuleSpec(
            module=PostLNTransformerLayer,
            submodules=PostLNTransformerLayerSubmodules(
                input_layernorm=IdentityOp,
                self_attention=_self_attention(column, row, relative),
                self_attn_bda=get_bias_dropout_add,
                post_self_attn_layernorm=WrappedTorchNorm,
                pre_mlp_layernorm=IdentityOp,
                mlp=ModuleSpec(module=MLP,
                               submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row)),
                mlp_bda=get_bias_dropout_add,
                post_mlp_layernorm=WrappedTorchNorm,
            ),
        )
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import (
            TELayerNormColumnParallelLinear,
            TERowParallelLinear,
        )

        input_norm, qkv, proj = IdentityOp, TELayerNormColumnParallelLinear, TERowParallelLinear
        mlp_norm, fc1, fc2 = IdentityOp, TELayerNormColumnParallelLinear, TERowParallelLinear
    else:
        input_norm, qkv, proj = WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear
        mlp_norm, fc1, fc2 = WrappedTorchNorm, ColumnParallelLinear, RowParallelLinear
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=_self_attention(qkv, proj),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=mlp_norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
