"""Our canonical state dict ↔ Hugging Face transformers state dicts and configs, through the
target's adapter (``adapters.adapter_for``: one module per target, the table in ``adapters``)
and the sharing mode's rule (``rtd_scale/model/sharing.py``, ``SHARING_RULES``).

The canonical state is ``rtd_scale.model.weights.full_state_dict``'s: fp32 tensors, tensor-parallel
shards gathered, vocabulary padding removed, a layer's index its global number − 1. Its names, for
``E`` = ``generator`` / ``discriminator`` (see ``model/encoder.py``, ``model/layers.py``):

    E.embeddings.{table.weight | table.delta, position.weight | position.delta,
                  token_type.weight (post), norm.{weight,bias}, projection.{weight,bias} (E ≠ H)}

(a tensor the discriminator shares with the generator is there once, under the generator's name:
ES with ``sharing_scope`` "embeddings" has no ``discriminator.embeddings.{position, token_type,
norm}``; GDES has ``discriminator.embeddings.position.delta`` in place of its own table.)
    E.block.layers.{i}.self_attention.linear_qkv.{weight [3H, H], bias [3H]}
    E.block.layers.{i}.self_attention.linear_proj.*, mlp.linear_fc1.*, mlp.linear_fc2.*
    E.block.layers.{i}.{input_layernorm, pre_mlp_layernorm}.*         (pre)
    E.block.layers.{i}.{post_self_attn_layernorm, post_mlp_layernorm}.* (post)
    E.block.final_layernorm.*                                          (pre)
    E.rel_embeddings.weight [2k, H], E.rel_embeddings_norm.*           (disentangled)
    mlm_head.{dense.*, norm.*, bias}, rtd_head.{dense.*, out.*}

(disentangled: no ``position`` or ``token_type`` table; ``projection`` has no bias.)

Rules, each exact (a renaming or a reshaping, never an approximation):

- **Fused QKV.** megatron-core's ``linear_qkv`` output for multi-head attention (one query group per
  head) is ordered per head: rows [3d·h, 3d·h + d) are head h's query, then its key, then its
  value (d = H / heads; megatron-core ``SelfAttention.get_query_key_value_tensors`` splits the
  output viewed as [.., heads, 3·d]). Hugging Face keeps ``query``, ``key``, ``value`` [H, H]
  with head h at rows [d·h, d·(h+1)). Tested against a forward pass
  (tests/unit/test_hf_export.py).
- **Sharing.** The export holds each model's tensors as its forward reads them: the sharing
  rule's ``export_state`` materialises the discriminator's (ES: the generator's table and, with
  ``sharing_scope`` "embeddings", its position table, token-type row and embedding LayerNorm;
  GDES: E_G + E_Δ and P_G + P_Δ, summed in fp32 as the lookup sums the rows). Import splits them
  back with ``import_state`` (ES takes one copy and refuses a generator whose copy differs;
  GDES gives E_Δ = E_D − E_G exactly). Padded vocabulary rows are already gone from the
  canonical state.
- **Foreign token tables** with up to a multiple of 128 rows more than the tokenizer's ids
  (released DeBERTaV3: 128,100 rows for 128,001 ids) lose those padding rows on import, with a
  note; no token id reaches them.
- **Heads.** RTD head = ELECTRA's ``discriminator_predictions`` (dense H→H, GELU, dense H→1),
  in the class (ELECTRA) or beside it in ``rtd_head.safetensors`` under those names. MLM head:
  each target's (its module), the decoder tied to the generator's table.
- **The masked-LM control** (``rtd.objective=mlm``): its one encoder sits in the generator's
  place (``generator.*``, ``mlm_head.*``), so ``masked_lm_to_hf`` / ``masked_lm_from_hf`` are the
  generator's half alone, as the layout's masked-LM class (``Adapter.generator_class``) at the
  discriminator's shape (``ModelConfig.masked_lm``); no sharing rule applies.
"""
from __future__ import annotations

from typing import Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import ModelConfig, SharingScope
from rtd_scale.hf.adapters import adapter_for
from rtd_scale.hf.common import (  # noqa: F401  (the public names of the export)
    GENERATOR_DIR,
    RTD_HEAD_FILE,
    RTD_HEAD_NAMES,
    RTD_HEAD_PREFIX,
    TE_NAMES,
    ExportError,
    HFModel,
    HFSource,
    check_config,
    encoder_from_hf,
    encoder_to_hf,
    fuse_qkv,
    split_qkv,
    unfused_names,
)
from rtd_scale.model.sharing import SharingConflict, sharing_rule


def class_names(model: ModelConfig) -> tuple[str, str]:
    """(discriminator class, generator class) of the export for this model's layout."""
    adapter = adapter_for(model)
    return adapter.discriminator_class, adapter.generator_class


def check_exportable(model: ModelConfig) -> None:
    """Refuse, before any work, a model the layout's Hugging Face classes cannot hold.

    Raises:
        ExportError: a layout no target holds; the pre layout with an embedding size other
            than a hidden size.
    """
    adapter_for(model).check_exportable(model)


def hf_config(model: ModelConfig, which: str, *, pad_id: int, cls_id: Optional[int] = None,
              sep_id: Optional[int] = None):
    """The transformers config of the ``which`` ("discriminator" / "generator") export."""
    return adapter_for(model).hf_config(model, which, pad_id=pad_id, cls_id=cls_id,
                                        sep_id=sep_id)


def _sharing(model: ModelConfig, scope: Optional[SharingScope] = None):
    """(rule, scope, relative) of ``model``'s embedding sharing (``scope``: another than its
    own); relative: positions enter as relative distances, no position table."""
    return (sharing_rule(model.sharing), scope or model.sharing_scope,
            not model.attention_type.absolute_positions)


def shared_components(model: ModelConfig, scope: Optional[SharingScope] = None
                      ) -> tuple[str, ...]:
    """The embedding components past the token table that the discriminator shares (under
    ``scope``, by default ``model.sharing_scope``)."""
    rule, scope, relative = _sharing(model, scope)
    return rule.layer_components(scope, relative)


def to_hf(state: dict[str, torch.Tensor], model: ModelConfig, *, pad_id: int,
          cls_id: Optional[int] = None, sep_id: Optional[int] = None) -> tuple[HFModel, HFModel]:
    """(discriminator, generator) Hugging Face models of a canonical state.

    Args:
        state: ``full_state_dict`` of a whole ``RTDModel`` (all pipeline stages merged).
        model: its config section (dims, sharing, layout, vocab_size = the real vocabulary).
        pad_id, cls_id, sep_id: the tokenizer's ids (``pad_token_id``; RoBERTa's position offset).
    Raises:
        ExportError: a shape the target class cannot hold (pre layout with E ≠ H).
        ValueError: ``state`` holds a tensor no target takes (never dropped silently).
    """
    adapter = adapter_for(model)
    adapter.check_exportable(model)
    rule, scope, relative = _sharing(model)
    state = rule.export_state(unfused_names(state), scope, relative)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return state[name]

    ids = dict(pad_id=pad_id, cls_id=cls_id, sep_id=sep_id)
    hf = {}
    for which in ("discriminator", "generator"):
        enc = getattr(model, which)
        tensors = encoder_to_hf(adapter, lambda n, w=which: take(f"{w}.{n}"), enc,
                                model.embedding_size != enc.hidden_size, pad_id,
                                has=lambda n, w=which: f"{w}.{n}" in state)
        base = adapter.base_of(which)
        hf[which] = {base + k: v for k, v in tensors.items()}
    rtd_head = {theirs: take(ours) for ours, theirs in RTD_HEAD_NAMES.items()}
    extra = {}
    if adapter.rtd_head_in_model:
        hf["discriminator"].update(rtd_head)
    else:
        extra = {RTD_HEAD_FILE: rtd_head}
    disc = HFModel(adapter.discriminator_class, hf_config(model, "discriminator", **ids),
                   hf["discriminator"], extra_files=extra, model_kwargs=dict(adapter.model_kwargs))
    gen = _masked_lm_model(adapter, state, take, hf["generator"], model, ids)
    _check_all_used(state, used)
    return disc, gen


def _masked_lm_model(adapter, state, take, g_state: dict[str, torch.Tensor], model: ModelConfig,
                     ids: dict) -> HFModel:
    """The generator class's model: ``g_state`` (its encoder, Hugging Face's names) with the
    MLM head and the tied copies of the table and bias."""
    head = {theirs: take(f"mlm_head.{ours}") for ours, theirs in adapter.mlm_head_maps[0].items()}
    adapter.mlm_head_to_hf(head, state["generator.embeddings.table.weight"], model)
    g_state.update(head)
    g_state.update({name: state["generator.embeddings.table.weight"]
                    for name in adapter.tied_to_table})
    g_state.update({name: state["mlm_head.bias"] for name in adapter.tied_to_bias})
    return HFModel(adapter.generator_class, hf_config(model, "generator", **ids), g_state)


def _check_all_used(state: dict[str, torch.Tensor], used: set[str]) -> None:
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"no Hugging Face target for {left}; extend its adapter "
                         "(rtd_scale/hf/adapters.py)")


def masked_lm_to_hf(state: dict[str, torch.Tensor], model: ModelConfig, *, pad_id: int,
                    cls_id: Optional[int] = None, sep_id: Optional[int] = None) -> HFModel:
    """The Hugging Face masked-LM model (``Adapter.generator_class``: ``ElectraForMaskedLM``,
    ``RobertaPreLayerNormForMaskedLM``, ``DebertaV2ForMaskedLM``, ``ModernBertForMaskedLM``) of
    an ``rtd.objective=mlm`` run's canonical state.

    Args:
        state: ``full_state_dict`` of the whole model: ``generator.*`` and ``mlm_head.*``.
        model: ``RunConfig.trained_model()`` (the discriminator's shape in the generator's place).
    Raises:
        ExportError: a shape the target class cannot hold.
        ValueError: ``state`` holds a tensor no target takes (never dropped silently).
    """
    adapter = adapter_for(model)
    adapter.check_exportable(model)
    state = unfused_names(state)
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return state[name]

    enc = model.generator
    tensors = encoder_to_hf(adapter, lambda n: take(f"generator.{n}"), enc,
                            model.embedding_size != enc.hidden_size, pad_id,
                            has=lambda n: f"generator.{n}" in state)
    g_state = {adapter.generator_base + k: v for k, v in tensors.items()}
    out = _masked_lm_model(adapter, state, take, g_state, model,
                           dict(pad_id=pad_id, cls_id=cls_id, sep_id=sep_id))
    _check_all_used(state, used)
    return out


def _mlm_head_from_hf(adapter, source: HFSource, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Our ``mlm_head.*`` from a generator class's state (either of its head layouts)."""
    gs = adapter.mlm_head_from_hf(source.state, model)
    names = next((m for m in adapter.mlm_head_maps if m["bias"] in gs), adapter.mlm_head_maps[0])
    out = {f"mlm_head.{ours}": gs[theirs] for ours, theirs in names.items()}
    out["mlm_head.bias"] = out["mlm_head.bias"][:model.vocab_size]  # padding rows dropped
    return out


def masked_lm_from_hf(model: ModelConfig, source: HFSource, *, pad_id: int,
                      flag: str = "--pretrained-checkpoint"
                      ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Inverse of ``masked_lm_to_hf``: the canonical state of an ``rtd.objective=mlm`` model
    (``model``: ``RunConfig.trained_model()``) from a masked-LM class's model, its MLM head
    kept, and notes for the user.

    Raises:
        UserInputError: a config this model cannot take (naming the discriminator's field: the
            shape ``rtd.objective=mlm`` builds).
    """
    adapter = adapter_for(model)
    notes = check_config(adapter, source, model, "generator", flag=flag,
                         fields_of="discriminator")
    out = encoder_from_hf(adapter, source, adapter.generator_base, "generator", model, pad_id,
                          notes)
    out.update(_mlm_head_from_hf(adapter, source, model))
    return {k: v.detach().float().contiguous() for k, v in out.items()}, notes


def from_hf(model: ModelConfig, *, discriminator: HFSource, generator: Optional[HFSource],
            pad_id: int, flag: str = "--pretrained-checkpoint"
            ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A canonical state (possibly partial) from Hugging Face models, and notes for the user.

    Missing from the result, to be taken from the freshly initialised model: the whole generator
    (its table only under NES) when ``generator`` is None, and the RTD head when the source has
    none. Under ES and GDES without a generator, the generator's table starts as the
    discriminator's (E_Δ = 0), and so do the rest of its shared embedding layer (sharing_scope
    "embeddings": ES's position table, token-type row and LayerNorm; GDES's position table,
    P_Δ = 0): the sharing rule's ``import_state``.

    Raises:
        UserInputError: a config this model cannot take, or a pair the sharing mode cannot hold
            (ES: two different tables or, with sharing_scope "embeddings", two different shared
            embedding tensors).
    """
    adapter = adapter_for(model)
    notes = check_config(adapter, discriminator, model, "discriminator", flag=flag)
    out = encoder_from_hf(adapter, discriminator, adapter.discriminator_base, "discriminator",
                          model, pad_id, notes)
    found = {**discriminator.state, **discriminator.extra}
    if any(k.startswith(RTD_HEAD_PREFIX) for k in found):  # a partial head: KeyError
        out.update({ours: found[theirs] for ours, theirs in RTD_HEAD_NAMES.items()})
    else:
        notes.append("no RTD head found (discriminator_predictions.*): it starts fresh")
    if generator is not None:
        notes += check_config(adapter, generator, model, "generator", flag=flag)
        out.update(encoder_from_hf(adapter, generator, adapter.generator_base, "generator",
                                   model, pad_id, notes))
        out.update(_mlm_head_from_hf(adapter, generator, model))
    rule, scope, relative = _sharing(model)
    try:
        out = rule.import_state(out, scope, relative, with_generator=generator is not None)
    except SharingConflict as e:
        raise UserInputError(f"{flag} {discriminator.where}: {e}") from None
    return {k: v.detach().float().contiguous() for k, v in out.items()}, notes
