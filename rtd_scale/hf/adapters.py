"""The Hugging Face target of each encoder layout: one adapter module per target, registered
under the config enums it exports. A new target is one module (``common.Adapter`` filled in) and
one line here.

- post-LayerNorm, BERT attention (``electra``): ``ElectraForPreTraining`` (RTD head included)
  at ``DIR``, ``ElectraForMaskedLM`` at ``DIR/generator``;
- pre-LayerNorm, BERT attention (``roberta_preln``): ``RobertaPreLayerNormModel`` (no pooler) +
  ``rtd_head.safetensors``, ``RobertaPreLayerNormForMaskedLM``;
- post-LayerNorm, disentangled attention (``debertav2``): ``DebertaV2Model`` +
  ``rtd_head.safetensors``, ``DebertaV2ForMaskedLM``;
- the modern block, rotary attention (``modernbert``): ``ModernBertModel`` +
  ``rtd_head.safetensors``, ``ModernBertForMaskedLM``.
"""
from __future__ import annotations

from rtd_scale.config import AttentionType, LayerNormPosition, ModelConfig
from rtd_scale.hf import debertav2, electra, modernbert, roberta_preln
from rtd_scale.hf.common import Adapter, ExportError

ADAPTERS: dict[tuple[LayerNormPosition, AttentionType], Adapter] = {
    (LayerNormPosition.POST, AttentionType.BERT): electra.ADAPTER,
    (LayerNormPosition.PRE, AttentionType.BERT): roberta_preln.ADAPTER,
    (LayerNormPosition.POST, AttentionType.DISENTANGLED): debertav2.ADAPTER,
    (LayerNormPosition.PRE, AttentionType.ROTARY): modernbert.ADAPTER,
}


def key_of(model: ModelConfig) -> tuple[LayerNormPosition, AttentionType]:
    return model.layernorm_position, model.attention_type


def adapter_for(model: ModelConfig) -> Adapter:
    """The target of ``model``'s layout.

    Raises:
        ExportError: no Hugging Face class holds this layout (one line: the flags, the fix).
    """
    layout, attention = key = key_of(model)
    adapter = ADAPTERS.get(key)
    if adapter is None:
        have = "; ".join(f"--layernorm-position {p.value} --attention-type {a.value} "
                         f"({a_.discriminator_class})" for (p, a), a_ in ADAPTERS.items())
        raise ExportError(f"cannot export: no Hugging Face class holds --layernorm-position "
                          f"{layout.value} with --attention-type {attention.value}; train with "
                          f"one that does: {have}")
    return adapter


def key_for_model_type(model_type: str) -> tuple[LayerNormPosition, AttentionType] | None:
    """The layout whose target reads checkpoints of transformers ``model_type`` (None: none)."""
    return next((k for k, a in ADAPTERS.items() if a.model_type == model_type), None)


def import_sources() -> str:
    """For messages: what ``--pretrained-checkpoint`` reads, every registered target named."""
    names = [f"{a.name} ({a.model_type})" for a in ADAPTERS.values()]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return (f"an export directory, a Hugging Face {listed} directory or an --export .pt "
            "file")
