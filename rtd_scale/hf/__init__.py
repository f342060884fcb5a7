"""Hugging Face transformers in and out: export with exact parity, import for
``--pretrained-checkpoint``.

- ``convert``: our canonical state dict (``rtd_scale.model.weights.full_state_dict``: TP shards
  gathered, vocabulary padding removed, names independent of the pipeline split) ↔ Hugging Face
  state dicts and configs, driven by the target's adapter and the sharing mode's rule
  (``rtd_scale/model/sharing.py``, ``SHARING_RULES``).
- ``adapters``: the registry, (``LayerNormPosition``, ``AttentionType``) → the target's adapter;
  ``electra``, ``roberta_preln``, ``debertav2``: one module per target, each stating its name
  maps once (ours → Hugging Face's; import inverts them); ``common``: what they share (fused
  QKV, TransformerEngine names, the encoder walk, the RTD head, the config checks).
- ``export``: writes an export directory (safetensors, config.json, tokenizer files).
- ``pretrained``: reads an export directory, an ``--export`` .pt file or a Hugging Face ELECTRA,
  RoBERTa-PreLayerNorm or DeBERTaV3 directory into a canonical state dict and loads it into a
  model at any TP / PP layout.
- ``consolidate``: the export's read of a DeepSpeed checkpoint of any TP × PP × ZeRO layout
  (``training/checkpoint/convert.py``'s restart of its world).

Targets: the table in ``adapters``.
"""
