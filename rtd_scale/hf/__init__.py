"""Hugging Face transformers in and out: export with exact parity, import for
``--pretrained-checkpoint``.

- ``convert``: our canonical state dict (``rtd_scale.model.weights.full_state_dict``: TP shards
  gathered, vocabulary padding removed, names independent of the pipeline split) ↔ Hugging Face
  state dicts and configs, one mapping per target class. Pure torch, no megatron-core.
- ``export``: writes an export directory (safetensors, config.json, tokenizer files).
- ``pretrained``: reads an export directory, an ``--export`` .pt file or a Hugging Face ELECTRA
  or DeBERTaV3 directory into a canonical state dict and loads it into a model at any TP / PP
  layout.

Targets, by ``model.attention_type`` and ``model.layernorm_position``:

| attention, layout | discriminator (``DIR``)                               | generator (``DIR/generator``)   |
|-------------------|-------------------------------------------------------|---------------------------------|
| bert, post   | ``ElectraForPreTraining`` (RTD head included)          | ``ElectraForMaskedLM``          |
| bert, pre    | ``RobertaPreLayerNormModel`` (no pooler) + ``rtd_head.safetensors`` | ``RobertaPreLayerNormForMaskedLM`` |
| disentangled, post | ``DebertaV2Model`` + ``rtd_head.safetensors``   | ``DebertaV2ForMaskedLM``        |
"""
