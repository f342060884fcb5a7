"""What every Hugging Face target shares: the export / import records, the fused-QKV and
TransformerEngine renamings, the encoder's tensor walk, the RTD head's names, the config checks
common to all targets, and ``Adapter``, the one interface a target module (``electra.py``,
``roberta_preln.py``, ``debertav2.py``, ``modernbert.py``) fills in. ``convert.py`` drives an adapter both ways.

A target states each name once, as a ``Pair`` (ours, Hugging Face's) or a head map (ours →
Hugging Face's); export reads the pairs one way, import the other (``encoder_to_hf`` /
``encoder_from_hf``, ``convert.to_hf`` / ``convert.from_hf``). Names: ours relative to an
encoder (``generator.`` / ``discriminator.`` stripped), Hugging Face's relative to the class's
base model (``Adapter.discriminator_base`` / ``generator_base`` stripped), heads relative to the
class.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import EncoderConfig, ModelConfig

GENERATOR_DIR = "generator"  # the generator's export, under the discriminator's directory
RTD_HEAD_FILE = "rtd_head.safetensors"  # the RTD head beside a class that has none
RTD_HEAD_PREFIX = "discriminator_predictions."  # its tensors carry ELECTRA's names
# RTD head = ELECTRA's ``discriminator_predictions`` (dense H→H, GELU, dense H→1), every target
RTD_HEAD_NAMES = {"rtd_head.dense.weight": RTD_HEAD_PREFIX + "dense.weight",
                  "rtd_head.dense.bias": RTD_HEAD_PREFIX + "dense.bias",
                  "rtd_head.out.weight": RTD_HEAD_PREFIX + "dense_prediction.weight",
                  "rtd_head.out.bias": RTD_HEAD_PREFIX + "dense_prediction.bias"}


class ExportError(UserInputError):
    """The model has a shape the Hugging Face target class cannot hold."""


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


@dataclass
class HFSource:
    """A loaded Hugging Face model: its config, its state dict (``state_dict()`` of the class,
    tied copies included) and the extra tensors found beside it (RTD head)."""

    config: Any
    state: dict[str, torch.Tensor]
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    where: str = ""  # for messages: the directory it came from


class Pair(NamedTuple):
    """One tensor of an encoder under both names: ``ours`` is ``theirs``, or a block of its
    rows, from row ``pad_id + 1`` when ``after_pad`` (RoBERTa's positions) else 0, ``rows`` of
    them (None: to the end). Export writes ours there in a zero table that many rows longer;
    import reads the block back and notes the rows past it that it drops (``dropped``: what
    they are, why)."""

    ours: str
    theirs: str
    after_pad: bool = False
    rows: Optional[int] = None
    dropped: tuple[str, str] = ("", "")
    optional: bool = False  # a bias a bias-free block lacks: mapped where the source has it

    def to_hf(self, ours: torch.Tensor, pad_id: int) -> torch.Tensor:
        if not self.after_pad:
            return ours
        theirs = ours.new_zeros(pad_id + 1 + ours.shape[0], *ours.shape[1:])
        theirs[pad_id + 1:] = ours
        return theirs

    def from_hf(self, theirs: torch.Tensor, pad_id: int, which: str,
                notes: list[str]) -> torch.Tensor:
        first = pad_id + 1 if self.after_pad else 0
        end = theirs.shape[0] if self.rows is None else first + self.rows
        if end < theirs.shape[0]:
            what, why = self.dropped
            notes.append(f"the {which}'s {what} rows {end}…{theirs.shape[0] - 1} are dropped "
                         f"({why})")
        return theirs[first:end]


def wb(ours: str, theirs: str) -> list[Pair]:
    """The (weight, bias) pairs of one module."""
    return [Pair(f"{ours}.weight", f"{theirs}.weight"), Pair(f"{ours}.bias", f"{theirs}.bias")]


# the token table (``Adapter.word_table``), and the fused QKV (``qkv_parts``: one of ours, three
# of theirs; ``Adapter.fused_qkv``: one of theirs)
WORD_TABLE = Pair("embeddings.table.weight", "embeddings.word_embeddings.weight")
OUR_QKV = "block.layers.{i}.self_attention.linear_qkv.{leaf}"
THEIR_QKV = "encoder.layer.{i}.attention.self.{part}.{leaf}"


# (our name under ``block.layers.{i}.``, Hugging Face's under ``encoder.layer.{i}.``): BERT's
# sub-module names, which every target uses
LAYER_LINEARS = [("self_attention.linear_proj", "attention.output.dense"),
                 ("mlp.linear_fc1", "intermediate.dense"),
                 ("mlp.linear_fc2", "output.dense")]
POST_LN_NORMS = [("post_self_attn_layernorm", "attention.output.LayerNorm"),
                 ("post_mlp_layernorm", "output.LayerNorm")]


def layer_pairs(num_layers: int, norms: list[tuple[str, str]]) -> list[Pair]:
    """The 1:1 pairs of every layer's linears and ``norms`` (all but the fused QKV)."""
    return [pair for i in range(num_layers) for ours, theirs in LAYER_LINEARS + norms
            for pair in wb(f"block.layers.{i}.{ours}", f"encoder.layer.{i}.{theirs}")]


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


def base_config_kwargs(model: ModelConfig, enc: EncoderConfig, *, pad_id: int,
                       architecture: str) -> dict[str, Any]:
    """The transformers config fields every target's config takes alike."""
    return dict(vocab_size=model.vocab_size, hidden_size=enc.hidden_size,
                num_hidden_layers=enc.num_layers, num_attention_heads=enc.num_attention_heads,
                intermediate_size=enc.ffn_hidden_size, hidden_act="gelu",  # exact (erf) GELU
                hidden_dropout_prob=enc.hidden_dropout,
                attention_probs_dropout_prob=enc.attention_dropout, type_vocab_size=1,
                initializer_range=model.init_method_std, layer_norm_eps=enc.layernorm_epsilon,
                pad_token_id=pad_id, architectures=[architecture])


def mlm_head_names(transform: str, norm: str, bias: str) -> dict[str, str]:
    """Our MLM head's names (``model/heads.py``: the transform's dense and LayerNorm, the output
    bias) → a target's, given the target's transform prefix, its LayerNorm's name there and its
    bias: ``mlm_head_names("lm_head", "layer_norm", "lm_head.bias")``."""
    return {"dense.weight": f"{transform}.dense.weight", "dense.bias": f"{transform}.dense.bias",
            "norm.weight": f"{transform}.{norm}.weight", "norm.bias": f"{transform}.{norm}.bias",
            "bias": bias}


class Adapter:
    """One Hugging Face target: its classes, config, name maps and the few rules that are not
    renamings. A target module makes one instance, ``ADAPTER``; ``adapters.ADAPTERS`` registers
    it under the (LayerNormPosition, AttentionType) it exports."""

    name: str  # for messages: the family users know ("ELECTRA", "DeBERTaV3")
    model_type: str  # the transformers ``model_type`` an import reads
    attention_words: str  # for messages: "BERT-style" / "disentangled"
    discriminator_class: str
    generator_class: str
    discriminator_base: str  # the class's base-model prefix ("" : the class is the base model)
    generator_base: str
    rtd_head_in_model: bool = False  # ELECTRA: in the class; else RTD_HEAD_FILE beside it
    model_kwargs: dict[str, Any] = {}  # the discriminator class's, to build and load it
    qkv_parts: tuple[str, str, str] = ("query", "key", "value")  # THEIR_QKV's ``part``
    # the class's one fused QKV ({i}, {leaf}), q | k | v blocks of heads (ModernBERT's Wqkv),
    # in place of THEIR_QKV's three tensors
    fused_qkv: Optional[str] = None
    word_table: Pair = WORD_TABLE
    # ours (under ``mlm_head.``) → theirs (the generator class's); the first map is the
    # export's, the others are read too (import takes the first whose bias is there)
    mlm_head_maps: tuple[dict[str, str], ...] = ()
    tied_to_table: tuple[str, ...] = ()  # generator names that hold the token table (decoder)
    tied_to_bias: tuple[str, ...] = ()  # and copies of the MLM bias
    # prefixes of unexpected keys a discriminator import leaves aside (heads of another class)
    ignored_heads: tuple[str, ...] = ()
    checks_embedding_size: bool = True  # whether the config holds embedding_size
    slow_tokenizer_file: Optional[str] = None  # SentencePiece model copy for a slow tokenizer
    # what the tokenizer returns, where the classes take no token_type_ids (None: the default)
    tokenizer_inputs: Optional[list[str]] = None

    def class_of(self, which: str) -> str:
        """The class of the ``which`` ("discriminator" / "generator") export."""
        return self.discriminator_class if which == "discriminator" else self.generator_class

    def base_of(self, which: str) -> str:
        return self.discriminator_base if which == "discriminator" else self.generator_base

    def check_exportable(self, model: ModelConfig) -> None:
        """Refuse a model this target cannot hold (one line: ``ExportError``)."""

    def hf_config(self, model: ModelConfig, which: str, *, pad_id: int,
                  cls_id: Optional[int], sep_id: Optional[int]):
        raise NotImplementedError

    def encoder_pairs(self, num_layers: int, projected: bool) -> list[Pair]:
        """Every tensor of one encoder but its token table and fused QKV, each once: export
        reads the pairs ours → theirs, import theirs → ours. ``projected`` (E ≠ H) adds the
        embedding projection's, whose presence an import reads."""
        raise NotImplementedError

    def extra_to_hf(self, hf: dict[str, torch.Tensor]) -> None:
        """Add the tensors the class has and our encoders lack (``hf``: one encoder's, under
        Hugging Face's names); import folds them into ours with ``extra_from_hf``."""

    def extra_from_hf(self, theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor],
                      which: str, notes: list[str]) -> None:
        """Fold into ``ours`` (read through ``encoder_pairs``) what ``extra_to_hf`` writes."""

    def check_source(self, src: HFSource, model: ModelConfig, where: str) -> None:
        """Refuse a config whose computation is not ours (``where``: "FLAG PATH: the X's")."""

    def mlm_head_to_hf(self, head: dict[str, torch.Tensor], table: torch.Tensor,
                       model: ModelConfig) -> None:
        """Rewrite, in place, the generator's MLM head (``head``: ``mlm_head_maps[0]``'s names)
        where the class holds fewer tensors than ours (``table``: the generator's token table,
        the tied decoder); ``mlm_head_from_hf`` gives import the missing ones back."""

    def mlm_head_from_hf(self, state: dict[str, torch.Tensor],
                         model: ModelConfig) -> dict[str, torch.Tensor]:
        """The generator class's ``state`` with every tensor ``mlm_head_maps`` names."""
        return state


def projection_of(adapter: Adapter, num_layers: int) -> set[str]:
    """Hugging Face's names of the embedding projection: the pairs ``projected`` adds."""
    plain = {p.theirs for p in adapter.encoder_pairs(num_layers, False)}
    return {p.theirs for p in adapter.encoder_pairs(num_layers, True)} - plain


def encoder_to_hf(adapter: Adapter, take: Callable[[str], torch.Tensor], enc: EncoderConfig,
                  projected: bool, pad_id: int,
                  has: Callable[[str], bool] = lambda name: True) -> dict[str, torch.Tensor]:
    """One encoder's tensors under the target's base-model names (``take``: ours, relative to
    the encoder; its token table at ``WORD_TABLE.ours`` is the effective one; ``has``: whether
    ours has an optional pair's tensor or the QKV bias)."""
    out = {p.theirs: p.to_hf(take(p.ours), pad_id)
           for p in adapter.encoder_pairs(enc.num_layers, projected) + [adapter.word_table]
           if not p.optional or has(p.ours)}
    adapter.extra_to_hf(out)
    for i in range(enc.num_layers):
        for leaf in ("weight", "bias"):
            if leaf == "bias" and not has(OUR_QKV.format(i=i, leaf=leaf)):  # bias-free linears
                continue
            qkv = split_qkv(take(OUR_QKV.format(i=i, leaf=leaf)), enc.num_attention_heads)
            if adapter.fused_qkv:
                out[adapter.fused_qkv.format(i=i, leaf=leaf)] = torch.cat(qkv)
                continue
            for part, t in zip(adapter.qkv_parts, qkv):
                out[THEIR_QKV.format(i=i, part=part, leaf=leaf)] = t
    return out


def encoder_from_hf(adapter: Adapter, src: HFSource, base: str, which: str, model: ModelConfig,
                    pad_id: int, notes: list[str]) -> dict[str, torch.Tensor]:
    """Inverse of ``encoder_to_hf``: one encoder's canonical tensors (``which.``-prefixed), its
    token table the effective one (padding rows past the tokenizer's ids dropped)."""
    s = {k[len(base):]: v for k, v in src.state.items() if k.startswith(base)}
    layers, heads = src.config.num_hidden_layers, src.config.num_attention_heads
    projection = projection_of(adapter, layers)
    projected = bool(projection) and projection <= s.keys()
    out = {p.ours: p.from_hf(s[p.theirs], pad_id, which, notes)
           for p in adapter.encoder_pairs(layers, projected) if not p.optional or p.theirs in s}
    out[WORD_TABLE.ours] = s[adapter.word_table.theirs][:model.vocab_size]
    adapter.extra_from_hf(s, out, which, notes)
    for i in range(layers):
        for leaf in ("weight", "bias"):
            if adapter.fused_qkv:
                fused = s.get(adapter.fused_qkv.format(i=i, leaf=leaf))
                if fused is None:  # bias-free linears
                    continue
                q, k, v = fused.chunk(3)
            else:
                q, k, v = (s[THEIR_QKV.format(i=i, part=part, leaf=leaf)]
                           for part in adapter.qkv_parts)
            out[OUR_QKV.format(i=i, leaf=leaf)] = fuse_qkv(q, k, v, heads)
    return {f"{which}.{k}": v for k, v in out.items()}


def padded_rows(vocab_size: int, multiple: int = 128) -> int:
    """The most rows a foreign token table may have for ``vocab_size`` ids and still count as
    that vocabulary plus padding: ``vocab_size`` rounded up to a multiple of 128 (Megatron's
    padding at TP = 1)."""
    return -(-vocab_size // multiple) * multiple


def check_config(adapter: Adapter, src: HFSource, model: ModelConfig, which: str, *,
                 flag: str, fields_of: Optional[str] = None) -> list[str]:
    """Refuse a Hugging Face config this model cannot take; return notes for harmless
    differences. ``fields_of``: the encoder whose config fields set ``which``'s shape, when
    another (``rtd.objective=mlm``: the discriminator's set its one encoder's).

    Raises:
        UserInputError: one line naming the field, both values and the ``--set`` that fixes it.
    """
    enc: EncoderConfig = getattr(model, which)
    c = src.config
    own = fields_of or which
    label = "masked LM" if fields_of else which  # rtd.objective=mlm: one encoder, not a generator
    checks = [("num_hidden_layers", enc.num_layers, f"model.{own}.num_layers"),
              ("hidden_size", enc.hidden_size, f"model.{own}.hidden_size"),
              ("num_attention_heads", enc.num_attention_heads,
               f"model.{own}.num_attention_heads"),
              ("intermediate_size", enc.ffn_hidden_size, f"model.{own}.ffn_hidden_size")]
    adapter.check_source(src, model, f"{flag} {src.where}: the {label}'s")
    if adapter.checks_embedding_size:
        checks.append(("embedding_size", model.embedding_size, "model.embedding_size"))
    for key, ours, field_name in checks:
        theirs = getattr(c, key, c.hidden_size if key == "embedding_size" else None)
        if theirs != ours:
            raise UserInputError(
                f"{flag} {src.where}: the {label}'s {key} is {theirs} there but {ours} in this "
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
                     f"{enc.layernorm_epsilon} here (--set model.{own}.layernorm_epsilon="
                     f"{c.layer_norm_eps} to keep it)")
    return notes
