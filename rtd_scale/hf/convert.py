"""Our canonical state dict ↔ Hugging Face transformers state dicts and configs.

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
- **Token tables.** ES: one table; NES: the discriminator's own; GDES: the discriminator's table
  is E_G + E_Δ (arXiv 2111.09543 §3.3), summed in fp32 as the discriminator's lookup sums the rows.
  Padded vocabulary rows are already gone from the canonical state.
- **The rest of the embedding layer** (``sharing_scope`` "embeddings", absolute positions; the
  rules are ``model/embeddings.py``'s): the discriminator's export gets the tensors its forward
  reads — ES: the generator's position table, token-type row and embedding LayerNorm; GDES:
  P_G + P_Δ, summed in fp32 as its forward sums the rows. On import they are split back: ES
  takes one copy (and refuses a generator whose copy differs), GDES gives P_Δ = P_D − P_G exactly
  (``gdes_delta``).
- **Post-LN → ELECTRA** (``ElectraForPreTraining`` / ``ElectraForMaskedLM``, transformers
  ``models/electra/modeling_electra.py``): embedding LayerNorm, ``embeddings_project`` when
  E ≠ H, LayerNorm after each residual add; positions 0…s−1 as ours.
- **Pre-LN → RoBERTa-PreLayerNorm** (``RobertaPreLayerNormModel`` / ``…ForMaskedLM``,
  ``models/roberta_prelayernorm/``): the one Hugging Face encoder with an embedding LayerNorm,
  a LayerNorm on each residual branch's input and a final LayerNorm — our pre layout exactly.
  It has no embedding projection, so E must equal H. Its position ids start at ``pad_id + 1``
  (RoBERTa's ``create_position_ids_from_input_ids``: a non-pad token at index i gets
  ``pad_id + 1 + i`` when padding only trails, as in our packed samples), so our position row i
  is written to row ``pad_id + 1 + i`` and rows 0…pad_id are zero; ``max_position_embeddings``
  grows by ``pad_id + 1``. At pad positions RoBERTa reads row ``pad_id`` where we read row i:
  hidden states differ there (only there — keys at pads are masked) unless ``position_ids =
  pad_id + 1 + arange(s)`` are passed, with which every position agrees. Its one token-type row
  is written as zeros (we have none).
- **Disentangled attention → DeBERTaV3** (``DebertaV2Model`` / ``DebertaV2ForMaskedLM``,
  ``models/deberta_v2/``; ``model.attention_type = "disentangled"``, post layout). The config is
  DeBERTaV3's (arXiv 2111.09543; the released ``microsoft/deberta-v3-*`` configs):
  ``relative_attention``, ``position_buckets`` / ``max_relative_positions`` as ours,
  ``pos_att_type`` [p2c, c2p], ``norm_rel_ebd`` layer_norm, ``share_att_key``,
  ``position_biased_input`` false, ``type_vocab_size`` 0, ``embedding_size`` E. Names:
  ``linear_qkv`` split per head into ``attention.self.{query,key,value}_proj``; the encoder's
  relative table and its LayerNorm → ``encoder.rel_embeddings`` / ``encoder.LayerNorm``;
  ``embeddings.projection`` (E ≠ H, no bias, before the LayerNorm as in DebertaV2Embeddings)
  → ``embeddings.embed_proj``; the rest under BERT's sub-module names. MLM head →
  the ``legacy`` head ``cls.predictions.{transform.dense, transform.LayerNorm, bias}`` with the
  decoder tied to the table (dense H→E, GELU, LayerNorm(E) as ours, so E ≠ H works); import
  also reads DeBERTa's own ``lm_predictions.lm_head.*`` (``legacy=False``, E = H). The RTD head
  goes to ``rtd_head.safetensors`` as for the pre layout (DebertaV2 has no RTD class, and the
  released checkpoints' ``mask_predictions`` head has another shape: dense, LayerNorm,
  classifier); ``DebertaV2ForTokenClassification`` reads the discriminator with only its
  fresh ``classifier``. One difference from transformers is kept (``model/disentangled.py``):
  outputs at [PAD] positions, which no loss reads — transformers zeroes the embedding there
  (as we do) but lets a pad query attend to every key; our pad rows attend to the real keys.
  Every real token's output is equal (tests/unit/test_hf_deberta.py).
- **Foreign token tables** with up to a multiple of 128 rows more than the tokenizer's ids
  (released DeBERTaV3: 128,100 rows for 128,001 ids) lose those padding rows on import, with a
  note; no token id reaches them.
- **Heads.** RTD head = ELECTRA's ``discriminator_predictions`` (dense H→H, GELU, dense H→1);
  for the pre layout it is written beside the model in ``rtd_head.safetensors`` under those
  names. MLM head = ELECTRA's ``generator_predictions`` (dense H→E, GELU, LayerNorm) +
  ``generator_lm_head`` tied to the table, with bias; RoBERTa's ``lm_head`` (dense, GELU,
  ``layer_norm``, decoder tied, ``bias``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import EncoderConfig, ModelConfig, Sharing

PRE, POST = "pre", "post"
GENERATOR_DIR = "generator"  # the generator's export, under the discriminator's directory
RTD_HEAD_FILE = "rtd_head.safetensors"  # pre layout: the RTD head beside RobertaPreLayerNormModel
RTD_HEAD_PREFIX = "discriminator_predictions."  # its tensors carry ELECTRA's names

ELECTRA_DISCRIMINATOR = "ElectraForPreTraining"
ELECTRA_GENERATOR = "ElectraForMaskedLM"
ROBERTA_PRE_DISCRIMINATOR = "RobertaPreLayerNormModel"
ROBERTA_PRE_GENERATOR = "RobertaPreLayerNormForMaskedLM"
DEBERTA_DISCRIMINATOR = "DebertaV2Model"
DEBERTA_GENERATOR = "DebertaV2ForMaskedLM"

# Hugging Face base-model prefix of each class's encoder ("" : the class is the base model).
_BASE = {ELECTRA_DISCRIMINATOR: "electra.", ELECTRA_GENERATOR: "electra.",
         ROBERTA_PRE_DISCRIMINATOR: "", ROBERTA_PRE_GENERATOR: "roberta_prelayernorm.",
         DEBERTA_DISCRIMINATOR: "", DEBERTA_GENERATOR: "deberta."}

BERT_ATTENTION, DISENTANGLED = "bert", "disentangled"


class ExportError(UserInputError):
    """The model has a shape the Hugging Face target class cannot hold."""


def layout(model: ModelConfig) -> str:
    """"pre" or "post": the encoders' LayerNorm layout (``model.layernorm_position``)."""
    value = getattr(model, "layernorm_position", PRE)
    return getattr(value, "value", value)


def attention_type(model: ModelConfig) -> str:
    """"bert" or "disentangled": the encoders' attention (``model.attention_type``)."""
    value = getattr(model, "attention_type", BERT_ATTENTION)
    return getattr(value, "value", value)


def is_deberta(model: ModelConfig) -> bool:
    """True when the export targets Hugging Face's DebertaV2 classes (disentangled attention)."""
    return attention_type(model) == DISENTANGLED


def relative_positions(model: ModelConfig) -> tuple[int, int]:
    """(position_buckets, max_relative_positions) of a disentangled model, as DebertaV2Config
    holds them (arXiv 2111.09543 §4: 256 buckets; the span is the maximum position)."""
    buckets = getattr(model, "position_buckets", 256)
    span = getattr(model, "max_relative_positions", -1)
    if span is None or span < 1:
        span = model.max_position_embeddings
    return buckets, span


def class_names(model: ModelConfig) -> tuple[str, str]:
    """(discriminator class, generator class) of the export for this model's layout."""
    if is_deberta(model):
        return DEBERTA_DISCRIMINATOR, DEBERTA_GENERATOR
    if layout(model) == POST:
        return ELECTRA_DISCRIMINATOR, ELECTRA_GENERATOR
    return ROBERTA_PRE_DISCRIMINATOR, ROBERTA_PRE_GENERATOR


@dataclass
class HFModel:
    """One model of an export: the class, its config, its full state dict (tied copies
    included) and extra safetensors files written beside it (file name → tensors)."""

    class_name: str
    config: Any  # transformers PretrainedConfig
    state: dict[str, torch.Tensor]
    extra_files: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # keyword arguments the class is built / loaded with (RobertaPreLayerNormModel: no pooler)
    model_kwargs: dict[str, Any] = field(default_factory=dict)


# (our name under ``block.layers.{i}.``, Hugging Face's under ``encoder.layer.{i}.``)
_LAYER_LINEARS = [("self_attention.linear_proj", "attention.output.dense"),
                  ("mlp.linear_fc1", "intermediate.dense"),
                  ("mlp.linear_fc2", "output.dense")]
_LAYER_NORMS = {
    POST: [("post_self_attn_layernorm", "attention.output.LayerNorm"),
           ("post_mlp_layernorm", "output.LayerNorm")],
    PRE: [("input_layernorm", "attention.LayerNorm"),
          ("pre_mlp_layernorm", "intermediate.LayerNorm")],
}


def _wb(ours: str, theirs: str) -> list[tuple[str, str]]:
    return [(f"{ours}.weight", f"{theirs}.weight"), (f"{ours}.bias", f"{theirs}.bias")]


def _encoder_pairs(enc: EncoderConfig, lay: str, projected: bool,
                   deberta: bool = False) -> list[tuple[str, str]]:
    """1:1 tensor pairs (ours relative to the encoder, theirs relative to the base model)."""
    pairs = _wb("embeddings.norm", "embeddings.LayerNorm")
    if deberta:  # post-LN layers under BERT's sub-module names, one relative table per encoder
        if projected:  # DebertaV2Embeddings.embed_proj: E → H before the LayerNorm, no bias
            pairs.append(("embeddings.projection.weight", "embeddings.embed_proj.weight"))
        pairs.append(("rel_embeddings.weight", "encoder.rel_embeddings.weight"))
        pairs += _wb("rel_embeddings_norm", "encoder.LayerNorm")
        for i in range(enc.num_layers):
            for ours, theirs in _LAYER_LINEARS + _LAYER_NORMS[POST]:
                pairs += _wb(f"block.layers.{i}.{ours}", f"encoder.layer.{i}.{theirs}")
        return pairs
    if projected:
        pairs += _wb("embeddings.projection", "embeddings_project")
    if lay == POST:
        pairs.append(("embeddings.token_type.weight", "embeddings.token_type_embeddings.weight"))
    for i in range(enc.num_layers):
        for ours, theirs in _LAYER_LINEARS + _LAYER_NORMS[lay]:
            pairs += _wb(f"block.layers.{i}.{ours}", f"encoder.layer.{i}.{theirs}")
    if lay == PRE:
        pairs += _wb("block.final_layernorm", "LayerNorm")
    return pairs


# TransformerEngine fuses the pre-layout norms into the next linear (``model/specs.py``); the
# canonical names are the unfused ones.
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
            "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}


def unfused_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with TransformerEngine's fused-norm names replaced by the plain ones."""
    out = {}
    for k, v in state.items():
        for te, plain in TE_NAMES.items():
            if k.endswith("." + te):
                k = k[: -len(te)] + plain
                break
        out[k] = v
    return out


def split_qkv(fused: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, ...]:
    """megatron-core's fused QKV ([3H, H] weight or [3H] bias, per head q, k, v) → (q, k, v),
    each [H, H] / [H] with head h at rows [d·h, d·(h+1))."""
    rest = fused.shape[1:]
    per_head = fused.reshape(num_heads, 3, fused.shape[0] // (3 * num_heads), *rest)
    return tuple(per_head[:, j].reshape(-1, *rest).contiguous() for j in range(3))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of ``split_qkv``."""
    rest = q.shape[1:]
    heads = [t.reshape(num_heads, q.shape[0] // num_heads, *rest) for t in (q, k, v)]
    return torch.stack(heads, dim=1).reshape(3 * q.shape[0], *rest).contiguous()


def discriminator_table(state: dict[str, torch.Tensor], sharing: Sharing) -> torch.Tensor:
    """The discriminator's token table [V, E] as its lookup sees it (GDES: E_G + E_Δ)."""
    gen = state["generator.embeddings.table.weight"]
    if Sharing(sharing) is Sharing.ES:
        return gen
    if Sharing(sharing) is Sharing.NES:
        return state["discriminator.embeddings.table.weight"]
    return gen + state["discriminator.embeddings.table.delta"]


# The discriminator's embedding tensors, besides its token table, that ES with sharing_scope
# "embeddings" takes from the generator (ELECTRA's ``electra/embeddings`` scope; the names exist
# only in the layouts that have them: token_type in the post layout with BERT attention).
ES_SHARED_LEAVES = ("position.weight", "token_type.weight", "norm.weight", "norm.bias")


def shared_embedding_layer(model: ModelConfig) -> bool:
    """Whether ES / GDES share more than the token table (``ModelConfig.shares_embedding_layer``
    for a config that may predate ``sharing_scope``: none then)."""
    scope = getattr(getattr(model, "sharing_scope", "tokens"), "value",
                    getattr(model, "sharing_scope", "tokens"))
    return (Sharing(model.sharing) is not Sharing.NES and scope == "embeddings"
            and not is_deberta(model))


def effective_embeddings(state: dict[str, torch.Tensor], model: ModelConfig
                         ) -> dict[str, torch.Tensor]:
    """``state`` with the discriminator's position table, token-type row and embedding LayerNorm
    under its own names, as its forward sees them: ES → the generator's tensors; GDES →
    ``P_G + P_Δ`` (fp32) in place of ``position.delta``. Unchanged when nothing past the token
    table is shared."""
    if not shared_embedding_layer(model):
        return state
    out = dict(state)
    gen, disc = "generator.embeddings.", "discriminator.embeddings."
    if Sharing(model.sharing) is Sharing.ES:
        for leaf in ES_SHARED_LEAVES:
            if gen + leaf in state:
                out[disc + leaf] = state[gen + leaf]
    else:
        out[disc + "position.weight"] = (state[gen + "position.weight"]
                                         + out.pop(disc + "position.delta"))
    return out


def check_exportable(model: ModelConfig) -> None:
    """Refuse, before any work, a model the layout's Hugging Face classes cannot hold.

    Raises:
        ExportError: the pre layout with an embedding size other than a hidden size;
            disentangled attention in the pre layout (DebertaV2 is post-LayerNorm).
    """
    if is_deberta(model):
        if layout(model) != POST:
            raise ExportError("cannot export: Hugging Face's DebertaV2 is post-LayerNorm, but "
                              "this disentangled model has --layernorm-position pre; train with "
                              "--layernorm-position post")
        return
    if layout(model) != PRE:
        return
    for name in ("discriminator", "generator"):
        h = getattr(model, name).hidden_size
        if h != model.embedding_size:
            raise ExportError(
                f"cannot export: the pre-LayerNorm layout's Hugging Face class "
                f"(RobertaPreLayerNorm) has no embedding projection, but model.embedding_size "
                f"{model.embedding_size} != model.{name}.hidden_size {h}; train with "
                f"--layernorm-position post (ELECTRA classes) or an embedding size equal to "
                f"both hidden sizes")


def hf_config(model: ModelConfig, which: str, *, pad_id: int, cls_id: Optional[int] = None,
              sep_id: Optional[int] = None):
    """The transformers config of the ``which`` ("discriminator" / "generator") export."""
    from transformers import DebertaV2Config, ElectraConfig, RobertaPreLayerNormConfig

    enc: EncoderConfig = getattr(model, which)
    disc_cls, gen_cls = class_names(model)
    common = dict(vocab_size=model.vocab_size, hidden_size=enc.hidden_size,
                  num_hidden_layers=enc.num_layers, num_attention_heads=enc.num_attention_heads,
                  intermediate_size=enc.ffn_hidden_size, hidden_act="gelu",  # exact (erf) GELU
                  hidden_dropout_prob=enc.hidden_dropout,
                  attention_probs_dropout_prob=enc.attention_dropout, type_vocab_size=1,
                  initializer_range=model.init_method_std, layer_norm_eps=enc.layernorm_epsilon,
                  pad_token_id=pad_id,
                  architectures=[disc_cls if which == "discriminator" else gen_cls])
    if is_deberta(model):
        buckets, span = relative_positions(model)
        common.update(type_vocab_size=0, bos_token_id=cls_id, eos_token_id=sep_id)
        # DeBERTaV3's released configuration (arXiv 2111.09543; microsoft/deberta-v3-*):
        # relative attention in log buckets, c2p and p2c, the relative table LayerNorm'd and
        # projected by each layer's own query / key (share_att_key), no absolute positions in
        # the input; legacy=True is the MLM head with the embedding-width transform (ours).
        return DebertaV2Config(
            max_position_embeddings=model.max_position_embeddings, relative_attention=True,
            position_buckets=buckets, max_relative_positions=span,
            pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
            position_biased_input=False, embedding_size=model.embedding_size, legacy=True,
            **common)
    if layout(model) == POST:
        return ElectraConfig(embedding_size=model.embedding_size,
                             max_position_embeddings=model.max_position_embeddings, **common)
    return RobertaPreLayerNormConfig(
        max_position_embeddings=model.max_position_embeddings + pad_id + 1,
        bos_token_id=cls_id, eos_token_id=sep_id, **common)


def _encoder_to_hf(state: dict[str, torch.Tensor], used: set[str], which: str,
                   model: ModelConfig, table: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    enc: EncoderConfig = getattr(model, which)
    lay = layout(model)

    def take(name: str) -> torch.Tensor:
        used.add(f"{which}.{name}")
        return state[f"{which}.{name}"]

    deberta = is_deberta(model)
    out = {theirs: take(ours)
           for ours, theirs in _encoder_pairs(enc, lay, model.embedding_size != enc.hidden_size,
                                              deberta)}
    out["embeddings.word_embeddings.weight"] = table
    if deberta:  # no absolute positions, no token type; DebertaV2's q/k/v are *_proj
        for i in range(enc.num_layers):
            for leaf in ("weight", "bias"):
                q, k, v = split_qkv(take(f"block.layers.{i}.self_attention.linear_qkv.{leaf}"),
                                    enc.num_attention_heads)
                for part, t in zip(("query_proj", "key_proj", "value_proj"), (q, k, v)):
                    out[f"encoder.layer.{i}.attention.self.{part}.{leaf}"] = t
        return out
    position = take("embeddings.position.weight")  # [P, E]
    if lay == PRE:
        shifted = position.new_zeros(position.shape[0] + pad_id + 1, position.shape[1])
        shifted[pad_id + 1:] = position
        out["embeddings.position_embeddings.weight"] = shifted
        out["embeddings.token_type_embeddings.weight"] = position.new_zeros(1, position.shape[1])
    else:
        out["embeddings.position_embeddings.weight"] = position
    for i in range(enc.num_layers):
        for leaf in ("weight", "bias"):
            q, k, v = split_qkv(take(f"block.layers.{i}.self_attention.linear_qkv.{leaf}"),
                                enc.num_attention_heads)
            for part, t in zip(("query", "key", "value"), (q, k, v)):
                out[f"encoder.layer.{i}.attention.self.{part}.{leaf}"] = t
    return out


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
    check_exportable(model)
    state = effective_embeddings(unfused_names(state), model)
    lay = layout(model)
    disc_cls, gen_cls = class_names(model)
    used: set[str] = set()
    gen_table = state["generator.embeddings.table.weight"]
    used.add("generator.embeddings.table.weight")
    disc_table = discriminator_table(state, model.sharing)
    used.update(k for k in ("discriminator.embeddings.table.weight",
                            "discriminator.embeddings.table.delta") if k in state)
    ids = dict(pad_id=pad_id, cls_id=cls_id, sep_id=sep_id)

    def take(name: str) -> torch.Tensor:
        used.add(name)
        return state[name]

    rtd_head = {f"{RTD_HEAD_PREFIX}dense.weight": take("rtd_head.dense.weight"),
                f"{RTD_HEAD_PREFIX}dense.bias": take("rtd_head.dense.bias"),
                f"{RTD_HEAD_PREFIX}dense_prediction.weight": take("rtd_head.out.weight"),
                f"{RTD_HEAD_PREFIX}dense_prediction.bias": take("rtd_head.out.bias")}
    base = _BASE[disc_cls]
    d_state = {base + k: v for k, v in
               _encoder_to_hf(state, used, "discriminator", model, disc_table, pad_id).items()}
    if lay == POST and not is_deberta(model):
        disc = HFModel(disc_cls, hf_config(model, "discriminator", **ids), {**d_state, **rtd_head})
    elif is_deberta(model):
        disc = HFModel(disc_cls, hf_config(model, "discriminator", **ids), d_state,
                       extra_files={RTD_HEAD_FILE: rtd_head})
    else:
        disc = HFModel(disc_cls, hf_config(model, "discriminator", **ids), d_state,
                       extra_files={RTD_HEAD_FILE: rtd_head},
                       model_kwargs={"add_pooling_layer": False})

    base = _BASE[gen_cls]
    g_state = {base + k: v for k, v in
               _encoder_to_hf(state, used, "generator", model, gen_table, pad_id).items()}
    bias = take("mlm_head.bias")
    if is_deberta(model):  # DebertaV2ForMaskedLM's legacy head: transform, tied decoder
        g_state.update({
            "cls.predictions.transform.dense.weight": take("mlm_head.dense.weight"),
            "cls.predictions.transform.dense.bias": take("mlm_head.dense.bias"),
            "cls.predictions.transform.LayerNorm.weight": take("mlm_head.norm.weight"),
            "cls.predictions.transform.LayerNorm.bias": take("mlm_head.norm.bias"),
            "cls.predictions.bias": bias, "cls.predictions.decoder.weight": gen_table,
            "cls.predictions.decoder.bias": bias})
    elif lay == POST:
        g_state.update({
            "generator_predictions.dense.weight": take("mlm_head.dense.weight"),
            "generator_predictions.dense.bias": take("mlm_head.dense.bias"),
            "generator_predictions.LayerNorm.weight": take("mlm_head.norm.weight"),
            "generator_predictions.LayerNorm.bias": take("mlm_head.norm.bias"),
            "generator_lm_head.weight": gen_table, "generator_lm_head.bias": bias})
    else:
        g_state.update({
            "lm_head.dense.weight": take("mlm_head.dense.weight"),
            "lm_head.dense.bias": take("mlm_head.dense.bias"),
            "lm_head.layer_norm.weight": take("mlm_head.norm.weight"),
            "lm_head.layer_norm.bias": take("mlm_head.norm.bias"),
            "lm_head.bias": bias, "lm_head.decoder.weight": gen_table,
            "lm_head.decoder.bias": bias})
    gen = HFModel(gen_cls, hf_config(model, "generator", **ids), g_state)
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"no Hugging Face target for {left}; extend rtd_scale/hf/convert.py")
    return disc, gen


# ------------------------------------------------------------------------------------------
# Hugging Face → canonical
# ------------------------------------------------------------------------------------------

def gdes_delta(disc_table: torch.Tensor, gen_table: torch.Tensor) -> torch.Tensor:
    """E_Δ with ``gen_table + E_Δ == disc_table`` bitwise in fp32, so that HF → rtd_scale → HF
    gives back the discriminator's table exactly.

    ``disc − gen`` rounded to fp32 can miss by one unit in the last place after the add; such
    entries are stepped one ulp at a time (``torch.nextafter``) toward the target. An exact E_Δ
    exists whenever the table was some fp32 E_G + E_Δ (every GDES export); for unrelated foreign
    tables an entry may stay one ulp of E_G away.
    """
    target = disc_table.float()
    base = gen_table.float()
    delta = target - base
    for _ in range(64):
        miss = (base + delta) != target
        if not bool(miss.any()):
            break
        toward = torch.where((base + delta) < target, torch.full_like(delta, float("inf")),
                             torch.full_like(delta, float("-inf")))
        delta = torch.where(miss, torch.nextafter(delta, toward), delta)
    return delta


@dataclass
class HFSource:
    """A loaded Hugging Face model: its config, its state dict (``state_dict()`` of the class,
    tied copies included) and the extra tensors found beside it (RTD head)."""

    config: Any
    state: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    where: str = ""  # for messages: the directory it came from


def check_config(src: HFSource, model: ModelConfig, which: str, *, flag: str) -> list[str]:
    """Refuse a Hugging Face config this model cannot take; return notes for harmless
    differences.

    Raises:
        UserInputError: one line naming the field, both values and the ``--set`` that fixes it.
    """
    enc: EncoderConfig = getattr(model, which)
    c = src.config
    checks = [("num_hidden_layers", enc.num_layers, f"model.{which}.num_layers"),
              ("hidden_size", enc.hidden_size, f"model.{which}.hidden_size"),
              ("num_attention_heads", enc.num_attention_heads,
               f"model.{which}.num_attention_heads"),
              ("intermediate_size", enc.ffn_hidden_size, f"model.{which}.ffn_hidden_size")]
    if is_deberta(model):
        _check_deberta(src, model, which, flag=flag)
        checks.append(("embedding_size", model.embedding_size, "model.embedding_size"))
    elif layout(model) == POST:
        checks.append(("embedding_size", model.embedding_size, "model.embedding_size"))
    for key, ours, field_name in checks:
        theirs = getattr(c, key, c.hidden_size if key == "embedding_size" else None)
        if theirs != ours:
            raise UserInputError(
                f"{flag} {src.where}: the {which}'s {key} is {theirs} there but {ours} in this "
                f"model; pass --set {field_name}={theirs} (or the preset it was trained with)")
    if getattr(c, "hidden_act", "gelu") != "gelu":
        raise UserInputError(f"{flag} {src.where}: hidden_act {c.hidden_act!r}; rtd_scale's "
                             "encoders use the exact GELU ('gelu') only")
    notes = []
    if model.vocab_size < c.vocab_size <= padded_rows(model.vocab_size):
        # padding rows past the tokenizer's ids, as the released DeBERTaV3 tables hold (128,100
        # rows for 128,001 ids): no token reaches them, so dropping them changes no output
        notes.append(f"the {which}'s token table has {c.vocab_size} rows there, the tokenizer "
                     f"{model.vocab_size} ids: rows {model.vocab_size}…{c.vocab_size - 1} "
                     "(padding) are dropped")
    elif c.vocab_size != model.vocab_size:
        raise UserInputError(
            f"{flag} {src.where}: vocabulary of {c.vocab_size} ids there, {model.vocab_size} "
            f"in --tokenizer-model; pass the tokenizer the checkpoint was trained with "
            f"(an export holds it: tokenizer.json / spm.model in {src.where})")
    if abs(getattr(c, "layer_norm_eps", enc.layernorm_epsilon) - enc.layernorm_epsilon) > 0:
        notes.append(f"the {which}'s layer_norm_eps is {c.layer_norm_eps} there, "
                     f"{enc.layernorm_epsilon} here (--set model.{which}.layernorm_epsilon="
                     f"{c.layer_norm_eps} to keep it)")
    return notes


def padded_rows(vocab_size: int, multiple: int = 128) -> int:
    """The most rows a foreign token table may have for ``vocab_size`` ids and still count as
    that vocabulary plus padding: ``vocab_size`` rounded up to a multiple of 128 (Megatron's
    padding at TP = 1)."""
    return -(-vocab_size // multiple) * multiple


def _check_deberta(src: HFSource, model: ModelConfig, which: str, *, flag: str) -> None:
    """Refuse a DebertaV2 config whose attention is not DeBERTaV3's (the one rtd_scale's
    disentangled attention computes).

    Raises:
        UserInputError: one line naming the config field, its value and the fix.
    """
    c = src.config
    where = f"{flag} {src.where}: the {which}'s"
    fixed = [("relative_attention", True), ("position_biased_input", False),
             ("share_att_key", True)]
    for key, want in fixed:
        if bool(getattr(c, key, None)) != want:
            raise UserInputError(
                f"{where} {key} is {getattr(c, key, None)} there; rtd_scale's disentangled "
                f"attention is DeBERTaV3's ({key}={want}): pass a DeBERTaV3 checkpoint")
    att = getattr(c, "pos_att_type", None) or []
    att = [a.strip() for a in att.lower().split("|")] if isinstance(att, str) else list(att)
    if sorted(att) != ["c2p", "p2c"]:
        raise UserInputError(f"{where} pos_att_type is {att} there; rtd_scale's disentangled "
                             "attention computes both c2p and p2c: pass a DeBERTaV3 checkpoint")
    norm = [x.strip() for x in str(getattr(c, "norm_rel_ebd", "none")).lower().split("|")]
    if "layer_norm" not in norm:
        raise UserInputError(f"{where} norm_rel_ebd is {getattr(c, 'norm_rel_ebd', None)!r} "
                             "there; rtd_scale LayerNorms the relative table ('layer_norm'): "
                             "pass a DeBERTaV3 checkpoint")
    if getattr(c, "conv_kernel_size", 0) or getattr(c, "type_vocab_size", 0):
        key = "conv_kernel_size" if getattr(c, "conv_kernel_size", 0) else "type_vocab_size"
        raise UserInputError(f"{where} {key} is {getattr(c, key)} there; rtd_scale's encoders "
                             f"have no {'convolution layer' if key[0] == 'c' else 'token types'}"
                             " (DeBERTaV3 has neither): pass a DeBERTaV3 checkpoint")
    head = getattr(c, "attention_head_size", None)
    if head is not None and head * c.num_attention_heads != c.hidden_size:
        raise UserInputError(f"{where} attention_head_size {head} × {c.num_attention_heads} "
                             f"heads != hidden_size {c.hidden_size}; rtd_scale's heads split "
                             "the hidden size")
    buckets, span = relative_positions(model)
    theirs_span = getattr(c, "max_relative_positions", -1)
    if theirs_span is None or theirs_span < 1:
        theirs_span = c.max_position_embeddings
    for key, theirs, ours in (("position_buckets", getattr(c, "position_buckets", -1), buckets),
                              ("max_relative_positions", theirs_span, span)):
        if theirs != ours:
            raise UserInputError(f"{where} {key} is {theirs} there but {ours} in this model; "
                                 f"pass --set model.{key}={theirs}")


def _encoder_from_hf(src: HFSource, base: str, which: str, model: ModelConfig, pad_id: int,
                     notes: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(canonical tensors of one encoder except its token table, that encoder's word table)."""
    enc: EncoderConfig = getattr(model, which)
    lay = layout(model)
    s = {k[len(base):]: v for k, v in src.state.items() if k.startswith(base)}
    out: dict[str, torch.Tensor] = {}
    layers = src.config.num_hidden_layers
    deberta = is_deberta(model)
    projected = ("embeddings.embed_proj.weight" if deberta else "embeddings_project.weight") in s
    pairs = _encoder_pairs(dataclasses.replace(enc, num_layers=layers), lay, projected, deberta)
    for ours, theirs in pairs:
        if ours == "embeddings.token_type.weight":
            continue
        out[f"{which}.{ours}"] = s[theirs]
    if deberta:
        for i in range(layers):
            for leaf in ("weight", "bias"):
                q, k, v = (s[f"encoder.layer.{i}.attention.self.{p}_proj.{leaf}"]
                           for p in ("query", "key", "value"))
                out[f"{which}.block.layers.{i}.self_attention.linear_qkv.{leaf}"] = fuse_qkv(
                    q, k, v, src.config.num_attention_heads)
        return out, s["embeddings.word_embeddings.weight"][:model.vocab_size]
    position = s["embeddings.position_embeddings.weight"]
    token_type = s["embeddings.token_type_embeddings.weight"]
    if lay == PRE:
        position = position[pad_id + 1:]
        if bool(token_type[0].ne(0).any()):  # fold the type-0 row into every position
            position = position + token_type[0]
            notes.append(f"the {which}'s token-type row 0 is folded into its position table")
    else:
        if token_type.shape[0] > 1:
            notes.append(f"the {which}'s token-type rows 1…{token_type.shape[0] - 1} are dropped "
                         "(rtd_scale's encoders have one token type)")
        out[f"{which}.embeddings.token_type.weight"] = token_type[:1]
    out[f"{which}.embeddings.position.weight"] = position
    for i in range(layers):
        for leaf in ("weight", "bias"):
            q, k, v = (s[f"encoder.layer.{i}.attention.self.{p}.{leaf}"]
                       for p in ("query", "key", "value"))
            out[f"{which}.block.layers.{i}.self_attention.linear_qkv.{leaf}"] = fuse_qkv(
                q, k, v, src.config.num_attention_heads)
    return out, s["embeddings.word_embeddings.weight"][:model.vocab_size]


def from_hf(model: ModelConfig, *, discriminator: HFSource, generator: Optional[HFSource],
            pad_id: int, flag: str = "--pretrained-checkpoint"
            ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A canonical state (possibly partial) from Hugging Face models, and notes for the user.

    Missing from the result, to be taken from the freshly initialised model: the whole generator
    (its table only under NES) when ``generator`` is None, and the RTD head when the source has
    none. Under ES and GDES without a generator, the generator's table starts as the
    discriminator's (E_Δ = 0), and so do the rest of its shared embedding layer (sharing_scope
    "embeddings": ES's position table, token-type row and LayerNorm; GDES's position table,
    P_Δ = 0).

    Raises:
        UserInputError: a config this model cannot take, or two different tables (or, with
            sharing_scope "embeddings", two different shared embedding tensors) under ES.
    """
    lay = layout(model)
    disc_cls, gen_cls = class_names(model)
    notes = check_config(discriminator, model, "discriminator", flag=flag)
    out, disc_table = _encoder_from_hf(discriminator, _BASE[disc_cls], "discriminator", model,
                                       pad_id, notes)
    head = {k[len(RTD_HEAD_PREFIX):]: v for k, v in
            {**discriminator.state, **discriminator.extra}.items()
            if k.startswith(RTD_HEAD_PREFIX)}
    if head:
        out.update({"rtd_head.dense.weight": head["dense.weight"],
                    "rtd_head.dense.bias": head["dense.bias"],
                    "rtd_head.out.weight": head["dense_prediction.weight"],
                    "rtd_head.out.bias": head["dense_prediction.bias"]})
    else:
        notes.append("no RTD head found (discriminator_predictions.*): it starts fresh")
    sharing = Sharing(model.sharing)
    gen_table = None
    if generator is not None:
        notes += check_config(generator, model, "generator", flag=flag)
        g, gen_table = _encoder_from_hf(generator, _BASE[gen_cls], "generator", model, pad_id,
                                        notes)
        out.update(g)
        gs = generator.state
        if is_deberta(model) and "lm_predictions.lm_head.bias" in gs:
            # DebertaV2ForMaskedLM with legacy=False (DeBERTa's own head names), E = H
            names = {"dense.weight": "lm_predictions.lm_head.dense.weight",
                     "dense.bias": "lm_predictions.lm_head.dense.bias",
                     "norm.weight": "lm_predictions.lm_head.LayerNorm.weight",
                     "norm.bias": "lm_predictions.lm_head.LayerNorm.bias",
                     "bias": "lm_predictions.lm_head.bias"}
        elif is_deberta(model):
            names = {"dense.weight": "cls.predictions.transform.dense.weight",
                     "dense.bias": "cls.predictions.transform.dense.bias",
                     "norm.weight": "cls.predictions.transform.LayerNorm.weight",
                     "norm.bias": "cls.predictions.transform.LayerNorm.bias",
                     "bias": "cls.predictions.bias"}
        elif lay == POST:
            names = {"dense.weight": "generator_predictions.dense.weight",
                     "dense.bias": "generator_predictions.dense.bias",
                     "norm.weight": "generator_predictions.LayerNorm.weight",
                     "norm.bias": "generator_predictions.LayerNorm.bias",
                     "bias": "generator_lm_head.bias"}
        else:
            names = {"dense.weight": "lm_head.dense.weight", "dense.bias": "lm_head.dense.bias",
                     "norm.weight": "lm_head.layer_norm.weight",
                     "norm.bias": "lm_head.layer_norm.bias", "bias": "lm_head.bias"}
        out.update({f"mlm_head.{ours}": gs[theirs] for ours, theirs in names.items()})
        out["mlm_head.bias"] = out["mlm_head.bias"][:model.vocab_size]  # padding rows dropped
    elif sharing is not Sharing.NES:
        gen_table = disc_table  # the generator's table starts as the discriminator's
    if sharing is Sharing.ES:
        if generator is not None and not torch.equal(gen_table, disc_table):
            raise UserInputError(
                f"{flag} {discriminator.where}: the discriminator's and the generator's token "
                "tables differ, which one shared table (--sharing es) cannot hold; pass "
                "--sharing nes or --sharing gdes")
        out["generator.embeddings.table.weight"] = disc_table
    elif sharing is Sharing.NES:
        out["discriminator.embeddings.table.weight"] = disc_table
        if gen_table is not None:
            out["generator.embeddings.table.weight"] = gen_table
    else:
        out["generator.embeddings.table.weight"] = gen_table
        out["discriminator.embeddings.table.delta"] = gdes_delta(disc_table, gen_table)
    if shared_embedding_layer(model):
        _share_embedding_layer(out, sharing, generator is not None, discriminator.where, flag)
    return {k: v.detach().float().contiguous() for k, v in out.items()}, notes


def _share_embedding_layer(out: dict[str, torch.Tensor], sharing: Sharing, with_generator: bool,
                           where: str, flag: str) -> None:
    """In place: the discriminator's embedding tensors past its token table folded into what
    the model shares (inverse of ``effective_embeddings``). Without a generator its shared
    tensors start as the discriminator's (ES: the one copy; GDES: P_G = P_D, P_Δ = 0), as its
    token table does.

    Raises:
        UserInputError: under ES, a generator whose tensor differs from the discriminator's.
    """
    gen, disc = "generator.embeddings.", "discriminator.embeddings."
    if sharing is Sharing.ES:
        for leaf in ES_SHARED_LEAVES:
            if disc + leaf not in out:
                continue
            mine = out.pop(disc + leaf)
            if with_generator and not torch.equal(out[gen + leaf], mine):
                raise UserInputError(
                    f"{flag} {where}: the discriminator's and the generator's embeddings.{leaf} "
                    "differ, which one shared embedding layer (--sharing es) cannot hold; pass "
                    "--sharing-scope tokens (only the token table shared), --sharing nes or "
                    "--sharing gdes")
            out[gen + leaf] = mine
        return
    position = out.pop(disc + "position.weight")
    if not with_generator:
        out[gen + "position.weight"] = position
    out[disc + "position.delta"] = gdes_delta(position, out[gen + "position.weight"])
