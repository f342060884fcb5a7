"""The only place that picks layer implementations (STYLE: ModuleSpec, not forked models).

Both encoders use megatron-core's ``TransformerLayer`` with its tensor-parallel linear layers
(ColumnParallelLinear / RowParallelLinear, even at TP=1) and a pre-LayerNorm residual layout
(as megatron-core's BERT). Core attention is ``SDPACoreAttention`` (PyTorch SDPA: flash on GPU,
no CUDA state on CPU). Where TransformerEngine is installed and a GPU is used, its fused
LayerNorm+linear layers are used instead, keeping the SDPA core attention.
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

from rtd_scale.model.attention import SDPACoreAttention


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def encoder_layer_spec(use_transformer_engine: bool | None = None) -> ModuleSpec:
    """The ``TransformerLayer`` spec of both encoders (bidirectional, padding mask).

    Args:
        use_transformer_engine: None picks TE when it is importable and a GPU is present.
    """
    if use_transformer_engine is None:
        use_transformer_engine = _have_transformer_engine()
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
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.padding},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=qkv,
                    core_attention=SDPACoreAttention,
                    linear_proj=proj,
                    q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=mlp_norm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
