"""One encoder (generator or discriminator): embeddings → megatron-core TransformerBlock.

The block's layers come from ``model/specs.py``. In the pre-LayerNorm layout the final LayerNorm
is the block's own (``post_layer_norm``); the post-LayerNorm layout (BERT / ELECTRA) has none,
its last layer ending in a LayerNorm. Data enters as [b, s]; inside the block everything is
[s, b, h].

State-dict names of one encoder (``generator.`` / ``discriminator.`` in ``RTDModel``), layer
index i local to the pipeline stage (``model/weights.py`` maps it to the global layer):

    embeddings.*                    ``EncoderEmbeddings`` (table, position, token_type, norm,
                                    projection), first stage only; what the discriminator
                                    shares with the generator is ``model/sharing.py``'s
    block.layers.{i}.*              one layer, see ``model/layers.py`` (post) or megatron-core's
                                    ``TransformerLayer`` (pre: ``input_layernorm``,
                                    ``pre_mlp_layernorm`` and the same attention / MLP linears)
    block.final_layernorm.{weight, bias}    pre layout, last stage only
    rel_embeddings.weight [2k, H]           disentangled attention (DeBERTa), every stage: the
    rel_embeddings_norm.{weight, bias} [H]  relative table all layers share and its LayerNorm
                                            (Hugging Face ``encoder.rel_embeddings`` /
                                            ``encoder.LayerNorm``); on a pipeline of several
                                            stages each holds a copy, kept equal by summing
                                            their gradients (``training/pipeline.py``)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.enums import ModelType
from megatron.core.transformer.transformer_block import (TransformerBlock,
                                                         TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig

from rtd_scale.config import (AttentionType, EncoderConfig, LayerNormPosition, MLPActivation,
                              ModelConfig)
from rtd_scale.model.disentangled import RELATIVE_TABLE_BLOCK_ARG, relative_embeddings
from rtd_scale.model import disentangled_flash, document_mask
from rtd_scale.model.document_mask import attention_mask as make_attention_mask
from rtd_scale.model.document_mask import document_position_ids
from rtd_scale.model.embeddings import EncoderEmbeddings, init_normal, scaled_init_normal
from rtd_scale.model.modern import RotaryAngles
from rtd_scale.model.specs import encoder_layer_spec, encoder_norm_spec


def transformer_config(enc: EncoderConfig, *, init_std: float, tensor_model_parallel_size: int,
                       pipeline_model_parallel_size: int = 1,
                       pipeline_dtype: torch.dtype = torch.float32,
                       recompute_activations: bool = False,
                       model: Optional[ModelConfig] = None) -> TransformerConfig:
    """megatron-core TransformerConfig for one encoder.

    CPU-safe everywhere: parameters allocated on CPU and initialised by
    ``rtd_scale.model.weights.initialize`` (independent of the TP size), and no fused kernels
    that assume CUDA. Parameters are fp32; DeepSpeed
    casts to bf16 and keeps fp32 master weights. ``pipeline_dtype`` is the dtype of the
    activations sent between pipeline stages (bf16 under --bf16). ``recompute_activations``
    selects megatron-core's full-layer recompute (activation checkpointing, one layer at a time).
    With ``model`` in the modern block (rotary attention), its fields become megatron-core's:
    ``normalization``, ``add_bias_linear``, ``gated_linear_unit`` and ``activation_func``
    (GeGLU: exact GELU; SwiGLU: SiLU), ``window_size`` (left, right) = (w // 2, w // 2) with
    ``window_attn_skip_freq`` the per-layer list of ``ModelConfig.local_layer``.
    """
    recompute = dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1) if recompute_activations else {}
    block = {}
    if model is not None and model.attention_type.rotary:
        act = model.mlp_activation
        block = dict(normalization=model.normalization, add_bias_linear=model.add_bias_linear,
                     gated_linear_unit=act.gated,
                     activation_func=F.silu if act is MLPActivation.SWIGLU else F.gelu)
        if model.window_size > 0:
            half = model.window_size // 2
            block.update(window_size=(half, half), window_attn_skip_freq=[
                int(model.local_layer(n)) for n in range(1, enc.num_layers + 1)])
    return TransformerConfig(
        num_layers=enc.num_layers,
        hidden_size=enc.hidden_size,
        num_attention_heads=enc.num_attention_heads,
        ffn_hidden_size=enc.ffn_hidden_size,
        hidden_dropout=enc.hidden_dropout,
        attention_dropout=enc.attention_dropout,
        layernorm_epsilon=enc.layernorm_epsilon,
        init_method=init_normal(init_std),
        output_layer_init_method=scaled_init_normal(init_std, enc.num_layers),
        init_method_std=init_std,
        **{"activation_func": F.gelu, "add_bias_linear": True, **block},
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        use_cpu_initialization=True,
        # megatron-core's initialisation also marks the tensor-parallel attributes
        # (tensor_model_parallel, partition_dim) that rtd_scale.model.weights relies on; the
        # values are then redrawn TP-independently by rtd_scale.model.weights.initialize.
        perform_initialization=True,
        params_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        # megatron-core's fused bias-dropout-add: the same arithmetic, one kernel (CUDA only).
        # Its bias-GELU fusion stays off: it computes GELU's tanh approximation, not the exact
        # GELU of BERT/ELECTRA and Hugging Face's "gelu".
        bias_dropout_fusion=torch.cuda.is_available(),
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_query_key_layer_scaling=False,
        pipeline_dtype=pipeline_dtype,
        batch_p2p_sync=torch.cuda.is_available(),  # its torch.cuda.synchronize() is CUDA-only
        **recompute,
    )


class Encoder(torch.nn.Module):
    """One pipeline stage of an encoder: embeddings on the first stage, this stage's share of the
    TransformerBlock's layers, and (pre layout) the final LayerNorm on the last stage
    (megatron-core's ``pre_process`` / ``post_process``).

    forward(ids [b, s], pad_mask [b, s] bool, True at [PAD], or None for a micro-batch without
    padding, document_ids [b, s] under document-masked packing (attention within each document,
    absolute or rotary positions restarting at each: ``model/document_mask.py``) or None,
    position_ids [b, s] or None) -> hidden
    [s, b, H] (on the last
    stage: after the final LayerNorm, or after the last layer's LayerNorm in the post layout).
    On a stage without ``pre_process`` the input comes from ``set_input_tensor`` (the previous
    stage's output, set by the pipeline schedule) and ``ids`` is unused.

    Args:
        layernorm_position: "pre" or "post" (``LayerNormPosition``); the embeddings must match
            (a token-type row exactly in the post layout with BERT attention).
        attention_type: ``AttentionType`` (its traits decide): "bert", "disentangled"
            (post layout only), which builds DeBERTa's attention and this encoder's relative
            table (2·span rows), or "rotary" (pre layout only), the modern block
            (``model/modern.py``: rotary angles at ``rotary_base`` in global layers and
            ``local_rotary_base`` in local ones, norms with ``norm_bias`` or without, the final
            one included).
        position_buckets, max_relative_positions: disentangled attention's relative positions
            (``max_relative_positions`` resolved, > 0; the table has 2·span rows, span =
            ``ModelConfig.relative_span()``).
        disentangled_core: the implementation of disentangled attention's core
            (``disentangled.IMPLEMENTATIONS``; None: the device's default). Under "flash" where it
            runs, a document mask reaches the layers in its compact form ([b, s]), which
            flashdeberta's varlen kernel reads: no [b, s, s] tensor.
    """

    def __init__(self, embeddings: Optional[EncoderEmbeddings], config: TransformerConfig, *,
                 layernorm_position: LayerNormPosition = LayerNormPosition.PRE,
                 attention_type: AttentionType = AttentionType.BERT,
                 position_buckets: int = 256, max_relative_positions: int = 512,
                 disentangled_core: Optional[str] = None,
                 rotary_base: float = 10000.0, local_rotary_base: float = 10000.0,
                 norm_bias: bool = True, pre_process: bool = True, post_process: bool = True):
        super().__init__()
        assert pre_process == (embeddings is not None), "embeddings live on the first stage only"
        post = layernorm_position is LayerNormPosition.POST
        token_type = post and attention_type.absolute_positions
        assert embeddings is None or (embeddings.token_type is not None) == token_type, \
            "the token-type row belongs to the post-LayerNorm layout with absolute positions"
        assert embeddings is None or embeddings.relative == (not attention_type.absolute_positions)
        self.config = config
        self.layernorm_position = layernorm_position
        self.attention_type = attention_type
        self.disentangled_core = disentangled_core
        self.model_type = ModelType.encoder_or_decoder  # read by megatron-core's schedules
        self.embeddings = embeddings
        spec = encoder_layer_spec(layernorm_position, attention_type=attention_type,
                                  position_buckets=position_buckets,
                                  max_relative_positions=max_relative_positions,
                                  disentangled_core=disentangled_core, norm_bias=norm_bias)
        self.rotary: Optional[RotaryAngles] = None
        if attention_type.rotary:  # its final norm is the block's norm, not megatron-core's
            spec = TransformerBlockSubmodules(
                layer_specs=[spec] * get_num_layers_to_build(config),
                layer_norm=encoder_norm_spec(norm_bias))
            self.rotary = RotaryAngles(config, rotary_base=rotary_base,
                                       local_rotary_base=local_rotary_base)
        self.block = TransformerBlock(config=config, spec=spec, post_layer_norm=not post,
                                      pre_process=pre_process, post_process=post_process)
        self.rel_embeddings: Optional[torch.nn.Embedding] = None
        self.rel_embeddings_norm: Optional[torch.nn.LayerNorm] = None
        if attention_type.relative_table:
            span = position_buckets if position_buckets > 0 else max_relative_positions
            self.rel_embeddings = torch.nn.Embedding(2 * span, config.hidden_size)
            self.rel_embeddings_norm = torch.nn.LayerNorm(config.hidden_size,
                                                          eps=config.layernorm_epsilon)
            if not pre_process:
                # stage 0's copy counts in the gradient norm; the others are replicas
                for p in self.pipeline_replicated_parameters():
                    p.ds_pipe_replicated = True

    def pipeline_replicated_parameters(self) -> list[torch.nn.Parameter]:
        """Parameters every pipeline stage holds a copy of (the relative table and its norm);
        their gradients are summed over the pipeline group before each step."""
        if self.rel_embeddings is None:
            return []
        return [self.rel_embeddings.weight, *self.rel_embeddings_norm.parameters()]

    def set_input_tensor(self, input_tensor) -> None:
        """The previous stage's output [s, b, H] (megatron-core's schedules pass a 1-list)."""
        if isinstance(input_tensor, (list, tuple)):
            assert len(input_tensor) == 1, "an encoder stage takes one input tensor"
            input_tensor = input_tensor[0]
        self.block.set_input_tensor(input_tensor)

    def forward(self, ids: torch.Tensor, pad_mask: Optional[torch.Tensor],
                document_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` [b, s]: document-masked packing (``model/document_mask.py``):
        attention within each document, positions restarting at each. ``position_ids`` [b, s]:
        each token's position (the absolute table's or rotary attention's); None: 0..s-1 in
        every sample, or restarting per document under ``document_ids``."""
        if position_ids is None and document_ids is not None:
            position_ids = document_position_ids(document_ids)
        hidden = None  # [s, b, H]
        if self.embeddings is not None:
            hidden = self.embeddings(ids, pad_mask, position_ids)
        x = hidden if hidden is not None else self.block.input_tensor
        if document_mask.compact_on(x.device) and not self.attention_type.disentangled and (
                document_ids is not None or self.config.window_size is not None):
            # the compact mask: SDPACoreAttention runs FlexAttention over a block mask made
            # from it, no [b, s, s] tensor (model/document_mask.py)
            attention_mask = document_mask.document_keys(pad_mask, document_ids,
                                                         (x.shape[1], x.shape[0]), x.device)
        elif (document_ids is not None and self.attention_type.disentangled
              and self.disentangled_core == "flash" and disentangled_flash.runs_on(x.device)):
            # the compact mask: flashdeberta's varlen kernel runs each document as a sequence
            # (model/disentangled_flash.py), no [b, s, s] tensor
            attention_mask = document_mask.document_keys(pad_mask, document_ids,
                                                         (x.shape[1], x.shape[0]), x.device)
        else:
            # True = masked; None without padding or documents: attention without a mask
            # (flash kernels on GPU)
            attention_mask = make_attention_mask(pad_mask, document_ids)
        tables = {}  # what every layer reads besides the hidden states and the mask
        if self.rel_embeddings is not None:  # a relative table: P = LayerNorm(R) [2k, H]
            tables[RELATIVE_TABLE_BLOCK_ARG] = relative_embeddings(self.rel_embeddings,
                                                                   self.rel_embeddings_norm)
        if self.rotary is not None:  # both kinds' angles [2, s, b or 1, 1, d]
            tables["rotary_pos_emb"] = self.rotary(x.shape[0], position_ids, device=x.device)
        return self.block(hidden_states=hidden, attention_mask=attention_mask, **tables)
