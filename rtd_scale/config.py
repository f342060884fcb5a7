"""The typed config tree of rtd_scale: one section per component, validated at construction.
A section's enum fields hold their enum from the moment they are set (``_Section``), however they
are set: a preset (``presets.py``), a flag, ``--set``, a config file or a recorded config.

Precedence (lowest to highest): a preset or ``--config FILE`` (``config_file.py``) → command-line
flags → ``--set key=value`` overrides. The resolved tree is written to ``<save>/config.json``
before step 1; :meth:`RunConfig.from_dict` reads it back.

Every rule cites its source. Errors are ``ConfigError`` (a ``ValueError``) naming the field and
the fix; ``ConfigError.naming`` writes a field as the flag that set it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from rtd_scale.cli_errors import UserInputError

class ConfigError(UserInputError):
    """A config value is invalid; the message names the field and the fix.

    With ``fields``, ``message`` is a template whose ``{0}``, ``{1}``, … are those dotted field
    names (``"{0} must be > 0, got 0"``, ``"optim.lr"``): :meth:`naming` writes each as the flag
    or file that set it (``arguments.FLAG_FIELDS`` is the table of flags and fields)."""

    def __init__(self, message: str, *fields: str) -> None:
        self.template, self.fields = message, fields
        super().__init__(message.format(*fields) if fields else message)

    def naming(self, names: dict[str, str]) -> "ConfigError":
        """This error with each of its fields that ``names`` holds written as
        ``"<name> (<field>)"`` (``names``: field → the flag that set it)."""
        if not self.fields:
            return self
        shown = [(names[f] if names[f] == f"--set {f}" else f"{names[f]} ({f})")
                 if f in names else f for f in self.fields]
        return ConfigError(self.template.format(*shown))


# Megatron-LM rounds the vocabulary up to a multiple of --make-vocab-size-divisible-by (default
# 128) times the TP size (megatron/training/tokenizer: _vocab_size_with_padding).
VOCAB_PAD_MULTIPLE = 128


class Sharing(str, enum.Enum):
    """Embedding sharing between generator and discriminator (arXiv 2111.09543 §3.2–3.3). What
    each mode means is its rule in ``rtd_scale/model/sharing.py`` (``SHARING_RULES``); a new
    mode is a member here and a rule there."""

    ES = "es"  # one table, trained by L_MLM + λ L_RTD (ELECTRA)
    NES = "nes"  # two separate tables
    GDES = "gdes"  # E_D = stopgrad(E_G) + E_Δ, E_Δ zero-initialised (DeBERTaV3 default)


class SharingScope(str, enum.Enum):
    """What ES and GDES share besides the token table (``--sharing-scope``; the rules per mode
    are ``rtd_scale/model/sharing.py``'s).

    EMBEDDINGS (default): what the reference implementations share. ES: the whole embedding
    layer — token, position and token-type tables and the embedding LayerNorm; each model keeps
    its own ``embeddings_project`` (google-research/electra ``model/modeling.py``: every one of
    them is created under the one variable scope ``electra/embeddings``). GDES: the token and
    the absolute position table, each as stopgrad(E_G) + E_Δ; the token-type row and the
    LayerNorm stay the discriminator's own (microsoft/DeBERTa
    ``DeBERTa/apps/tasks/rtd_task.py``, ``RTDModel.register_discriminator_fw_hook``: the word
    and position embeddings, nothing else). TOKENS: the token table only, every other
    embedding parameter per model (rtd_scale's behaviour before this field existed).
    Disentangled attention has no position or token-type table and DeBERTa shares its
    LayerNorm under neither mode, so there the two scopes are the same model.
    """

    TOKENS = "tokens"
    EMBEDDINGS = "embeddings"


class LayerNormPosition(str, enum.Enum):
    """Where each encoder layer normalises (``--layernorm-position``; fairseq's
    ``encoder_normalize_before``).

    PRE: LayerNorm on each residual branch's input and a final LayerNorm after the last layer
    (megatron-core's default; Hugging Face ``RobertaPreLayerNorm``). POST: LayerNorm after each
    residual add, none at the end, and a one-row token-type embedding (BERT, ELECTRA; Hugging
    Face ``ElectraModel``; arXiv 1810.04805 §3, arXiv 2003.10555 §3.1).
    """

    PRE = "pre"
    POST = "post"


class AttentionType(str, enum.Enum):
    """The self-attention of both encoders (``--attention-type``).

    BERT: scaled dot-product attention over learned absolute positions added to the input
    (arXiv 1706.03762 §3.2; BERT, ELECTRA). DISENTANGLED: DeBERTa's disentangled attention,
    content-to-content + content-to-position + position-to-content over log-bucketed relative
    positions and no absolute position in the input (arXiv 2006.03654 §3.1; DeBERTaV3, arXiv
    2111.09543; Hugging Face ``DebertaV2Model``); needs the post-LayerNorm layout. ROTARY: the
    modern block (ModernBERT, arXiv 2412.13663 §2.1): rotary position embeddings on queries and
    keys (arXiv 2104.09864; megatron-core's ``RotaryEmbedding``), no position table, alternating
    sliding-window and global layers (``ModelConfig.window_size``,
    ``global_attn_every_n_layers``); needs the pre-LayerNorm layout, which it places as ModernBERT
    (``model/modern.py``).

    What a type means for the model is its row of ``ATTENTION_TRAITS`` (``AttentionTraits``),
    read through the properties below; a new type is a member and a row.
    """

    BERT = "bert"
    DISENTANGLED = "disentangled"
    ROTARY = "rotary"

    @property
    def absolute_positions(self) -> bool:
        """The embeddings add a learned absolute position table to the input (and, in the
        post-LayerNorm layout, BERT's token-type row); without it positions reach attention
        only, and the embeddings are DeBERTa's (``model/embeddings.py``)."""
        return ATTENTION_TRAITS[self].absolute_positions

    @property
    def relative_table(self) -> bool:
        """Each encoder holds one table of relative-position embeddings, with its LayerNorm,
        that every layer's attention reads (``model/encoder.py``; the argument it travels in:
        ``model/disentangled.py``)."""
        return ATTENTION_TRAITS[self].relative_table

    @property
    def disentangled(self) -> bool:
        """The layers' attention is DeBERTa's disentangled attention (``model/specs.py``)."""
        return ATTENTION_TRAITS[self].disentangled

    @property
    def rotary(self) -> bool:
        """Queries and keys are rotated by their positions (megatron-core's rotary arguments
        carry the angles, ``model/modern.py``), in the modern block's layout."""
        return ATTENTION_TRAITS[self].rotary


@dataclass(frozen=True)
class AttentionTraits:
    """What an ``AttentionType`` means for the model (its properties of the same names)."""

    absolute_positions: bool
    relative_table: bool
    disentangled: bool
    rotary: bool = False


ATTENTION_TRAITS = {
    AttentionType.BERT: AttentionTraits(absolute_positions=True, relative_table=False,
                                        disentangled=False),
    AttentionType.DISENTANGLED: AttentionTraits(absolute_positions=False, relative_table=True,
                                                disentangled=True),
    AttentionType.ROTARY: AttentionTraits(absolute_positions=False, relative_table=False,
                                          disentangled=False, rotary=True),
}


class DisentangledCore(str, enum.Enum):
    """Which kernel computes disentangled attention's core (``model.disentangled_core``;
    ``model/disentangled.py``'s ``IMPLEMENTATIONS``): the same attention, other speed and memory.

    AUTO: "sdpa" on CUDA, "explicit" elsewhere. EXPLICIT: scores [b, n, s, s] in PyTorch. SDPA:
    c2p + p2c as one float bias of PyTorch's ``scaled_dot_product_attention``. FLEX: one
    FlexAttention kernel (CUDA; no attention dropout, no document mask). FLASH: flashdeberta's
    Triton kernels (``model/disentangled_flash.py``; CUDA, ``pip install '.[gpu]'``; no
    attention dropout; key padding and document-masked packing without an [s, s] tensor); where
    flashdeberta is missing or the device is not CUDA, AUTO's choice runs, with one note.
    """

    AUTO = "auto"
    EXPLICIT = "explicit"
    SDPA = "sdpa"
    FLEX = "flex"
    FLASH = "flash"


class MLPActivation(str, enum.Enum):
    """The FFN of both encoders (``model.mlp_activation``; ``--swiglu``).

    GELU: fc1 → exact GELU → fc2 (BERT, ELECTRA, DeBERTa). GEGLU / SWIGLU: a gated linear unit,
    fc1 of width 2F split into halves (a, g), fc2(act(a) · g) with act GELU / SiLU (Shazeer,
    arXiv 2002.05202; ModernBERT's GeGLU, Megatron-LM's ``--swiglu``); rotary attention only.
    """

    GELU = "gelu"
    GEGLU = "geglu"
    SWIGLU = "swiglu"

    @property
    def gated(self) -> bool:
        return self is not MLPActivation.GELU


# Megatron-LM's --normalization values this system builds (torch.nn.LayerNorm / RMSNorm)
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class Precision(str, enum.Enum):
    """Compute precision (``--bf16``, ``--fp16``; default fp32 in every preset). bf16 and fp16
    keep fp32 master weights in DeepSpeed's optimizer; fp16 scales the loss with DeepSpeed's
    dynamic loss scaler (the ds_config's ``fp16`` section sets its knobs)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class LossSpikePolicy(str, enum.Enum):
    """What a loss spike does (``--loss-spike-policy``; the rule: ``training/spikes.py``).

    ROLLBACK (default): reload the newest checkpoint this run saved (or resumed from) before the
    spike, skip the samples of the spiking iterations from then on, and continue (PaLM's manual
    cure, arXiv 2204.02311 §5.1, done by the run). WARN: one line and a TensorBoard scalar, and
    training goes on. OFF: no detection."""

    OFF = "off"
    WARN = "warn"
    ROLLBACK = "rollback"


@functools.cache
def _enum_fields(section: type) -> dict[str, type]:
    """The fields of the section class ``section`` whose type is an enum: name → enum class."""
    return {name: kind for name, kind in typing.get_type_hints(section).items()
            if isinstance(kind, type) and issubclass(kind, enum.Enum)}


class FieldKind(str, enum.Enum):
    """What a config field describes. ``RUN``: the run itself — model, data, objective,
    schedule, layout, what is logged — which ``--config FILE`` repeats. ``LOCATION``: where this
    one run reads its starting state and writes its outputs (``--save``, ``--load`` and the
    permission that goes with that resume, the exports, the audit and analysis files, the
    TensorBoard and W&B directories), which ``--config`` never takes from another run's file:
    a recorded ``config.json`` would otherwise resume that run or write over its outputs
    (``config_file.read``)."""

    RUN = "run"
    LOCATION = "location"


RUN = {"kind": FieldKind.RUN}  # field(metadata=RUN)
LOCATION = {"kind": FieldKind.LOCATION}


class _Section:
    """A section of the tree. Its enum fields hold their enum from the moment they are set (at
    construction, by a flag, ``--set``, a config file or a resume), so no module converts a mode
    string again; a value that is no member is a :class:`ConfigError` naming the field.

    ``KIND``: the :class:`FieldKind` of every field of a section that holds only one kind; a
    section that holds both (``None``) names each field's kind in its ``metadata``
    (:func:`field_kinds`)."""

    SECTION: typing.ClassVar[str] = ""
    KIND: typing.ClassVar[Optional[FieldKind]] = FieldKind.RUN

    def __setattr__(self, name: str, value: Any) -> None:
        kind = _enum_fields(type(self)).get(name)
        if kind is not None and not isinstance(value, kind):
            try:
                value = kind(value)
            except ValueError:
                raise ConfigError(f"{{0}} {value!r}: choose one of "
                                  f"{', '.join(m.value for m in kind)}",
                                  f"{self.SECTION}.{name}") from None
        object.__setattr__(self, name, value)


def _positive(section: str, **values: float) -> None:
    for name, v in values.items():
        if v is None or v <= 0:
            raise ConfigError(f"{{0}} must be > 0, got {v!r}", f"{section}.{name}")


def divisors(*numbers: int) -> list[int]:
    """The positive integers that divide every one of ``numbers`` (for "use one of" hints)."""
    return [d for d in range(1, min(numbers) + 1) if all(n % d == 0 for n in numbers)]


def _nearest(candidates: list[int], value: int) -> str:
    """The candidates nearest ``value`` from below and above, as "4 or 6" (or one of them)."""
    below = [c for c in candidates if c < value][-1:]
    above = [c for c in candidates if c > value][:1]
    return " or ".join(str(c) for c in below + above)


def _probability(section: str, **values: float) -> None:
    for name, v in values.items():
        if not (0.0 <= v <= 1.0):
            raise ConfigError(f"{{0}} must be in [0, 1], got {v!r}", f"{section}.{name}")


@dataclass(kw_only=True)
class EncoderConfig(_Section):
    """One transformer encoder (generator or discriminator)."""

    SECTION = "model.encoder"

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-7  # DeBERTa's released configs

    def validate(self, name: str) -> None:
        _positive(name, num_layers=self.num_layers, hidden_size=self.hidden_size,
                  num_attention_heads=self.num_attention_heads,
                  ffn_hidden_size=self.ffn_hidden_size)
        _probability(name, hidden_dropout=self.hidden_dropout,
                     attention_dropout=self.attention_dropout)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"{{0}} ({self.hidden_size}) must be divisible by {{1}} "
                f"({self.num_attention_heads}); use "
                f"{_nearest(divisors(self.hidden_size), self.num_attention_heads)} heads (the "
                f"nearest counts that divide {self.hidden_size})",
                f"{name}.hidden_size", f"{name}.num_attention_heads")


@dataclass(kw_only=True)
class ModelConfig(_Section):
    """Generator, discriminator and their shared token table.

    ``embedding_size`` is the token table's width. DeBERTaV3 style: equal to both hidden sizes.
    ELECTRA style: smaller, and each model projects it to its hidden size (arXiv 2003.10555 §3.2).

    ``layernorm_position`` is the layout of both encoders (``LayerNormPosition``): "pre"
    (pre-LayerNorm, final LayerNorm; Hugging Face ``RobertaPreLayerNorm``) or "post" (BERT /
    ELECTRA post-LayerNorm with a one-row token-type embedding; Hugging Face ``ElectraModel``).
    """

    SECTION = "model"

    vocab_size: int = 8000  # real ids; replaced by the tokenizer's size at start-up
    embedding_size: int
    max_position_embeddings: int = 512
    generator: EncoderConfig
    discriminator: EncoderConfig
    sharing: Sharing = Sharing.GDES
    # --sharing-scope: ES / GDES share the token table only ("tokens") or what ELECTRA / DeBERTa
    # share ("embeddings": also positions, and under ES token type and LayerNorm); SharingScope
    sharing_scope: SharingScope = SharingScope.EMBEDDINGS
    layernorm_position: LayerNormPosition = LayerNormPosition.PRE
    # disentangled attention (AttentionType): relative distances in DeBERTa's log buckets,
    # 2·position_buckets relative embeddings (-1: none, one per distance up to
    # max_relative_positions); max_relative_positions -1 means max_position_embeddings
    # (Hugging Face DebertaV2Config's rules; DeBERTaV3's released configs use 256 and -1)
    attention_type: AttentionType = AttentionType.BERT
    position_buckets: int = 256
    max_relative_positions: int = -1
    # the kernel of disentangled attention's core (DisentangledCore; GPU speed, same values)
    disentangled_core: DisentangledCore = DisentangledCore.AUTO
    init_method_std: float = 0.02
    # --make-vocab-size-divisible-by: the vocabulary is padded to a multiple of this × TP size
    make_vocab_size_divisible_by: int = VOCAB_PAD_MULTIPLE
    recompute_activations: bool = False  # megatron-core full-layer recompute, both models
    # torch.compile of every encoder layer (in place: parameter names unchanged); GPU speed,
    # off by default (compilation takes minutes for large models)
    compile_layers: bool = False
    # The modern block (attention_type "rotary"; model/modern.py). Megatron-LM's names where it
    # has one (--rotary-base, --normalization, --disable-bias-linear, --swiglu, --window-size),
    # Hugging Face ModernBertConfig's otherwise. rotary_base: the global layers' RoPE base
    # (ModernBERT's global_rope_theta, 160,000); local_rotary_base: the sliding-window layers'
    # (local_rope_theta, 10,000). window_size: tokens a local layer sees, query i attending to
    # keys |i - j| <= window_size // 2 (ModernBERT's local_attention 128); -1: every layer
    # global. global_attn_every_n_layers: layer i (0-based) is global when i % n == 0 (layer 0
    # always; ModernBERT's 3). The rest apply to both encoders' layers, embedding norm and final
    # norm: normalization "LayerNorm" / "RMSNorm", norm_bias (ModernBERT: none), add_bias_linear
    # (the attention and FFN linears; ModernBERT: none), mlp_activation (MLPActivation).
    rotary_base: float = 10000.0
    local_rotary_base: float = 10000.0
    window_size: int = -1
    global_attn_every_n_layers: int = 1
    normalization: str = "LayerNorm"
    norm_bias: bool = True
    add_bias_linear: bool = True
    mlp_activation: MLPActivation = MLPActivation.GELU

    def padded_vocab_size(self, tensor_model_parallel_size: int) -> int:
        """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by`` (default 128)
        × TP: Megatron-LM's rule (``_vocab_size_with_padding``; DESIGN.md §3).

        Deterministic in (vocab_size, make_vocab_size_divisible_by, TP). Padded ids
        [vocab_size, padded) are never predicted, never sampled and carry no loss. With a
        multiple of 128 every TP shard holds whole blocks of the two-level sampler
        (``objectives/sampling.py``); a shard that does not is sampled in one level (the same
        distribution, slower, and other draws than a shard of whole blocks).
        """
        m = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // m) * m

    def relative_span(self) -> int:
        """k of disentangled attention: relative distances index 2k embeddings (Hugging Face
        ``DisentangledSelfAttention.pos_ebd_size``): position_buckets, or without buckets the
        resolved max_relative_positions."""
        if self.position_buckets > 0:
            return self.position_buckets
        return self.resolved_max_relative_positions()

    def resolved_max_relative_positions(self) -> int:
        """max_relative_positions, -1 resolved to max_position_embeddings (Hugging Face's rule)."""
        if self.max_relative_positions > 0:
            return self.max_relative_positions
        return self.max_position_embeddings

    def masked_lm(self) -> "ModelConfig":
        """The model ``rtd.objective=mlm`` builds: one encoder of the discriminator's shape in
        the generator's place (the masked LM; its MLM head tied to its own table), so the model
        code, the pipeline's generator pass and the export of a generator serve it unchanged.
        The sharing fields have nothing to share and no effect."""
        return dataclasses.replace(self, generator=dataclasses.replace(self.discriminator))

    def shares_embedding_layer(self) -> bool:
        """Whether the sharing reaches past the token table: ES or GDES with scope "embeddings"
        and absolute positions (``model/sharing.py`` says what each mode shares)."""
        return (self.sharing is not Sharing.NES
                and self.sharing_scope is SharingScope.EMBEDDINGS
                and self.attention_type.absolute_positions)

    def validate(self) -> None:
        if (self.attention_type.disentangled
                and self.layernorm_position is not LayerNormPosition.POST):
            raise ConfigError("--attention-type disentangled needs --layernorm-position post "
                              "(DeBERTa's layout, arXiv 2006.03654); add --layernorm-position post")
        self._validate_block()
        if self.sharing_scope is SharingScope.TOKENS and (
                self.sharing is Sharing.NES or not self.attention_type.absolute_positions):
            why = ("--sharing nes shares nothing" if self.sharing is Sharing.NES else
                   f"{self.attention_type.value} attention has no position or token-type "
                   "table")
            warnings.warn(f"--sharing-scope tokens has no effect: {why}")
        if (self.shares_embedding_layer() and self.sharing is Sharing.ES
                and self.generator.layernorm_epsilon != self.discriminator.layernorm_epsilon):
            raise ConfigError(
                f"--sharing es shares the embedding LayerNorm, but model.generator."
                f"layernorm_epsilon {self.generator.layernorm_epsilon} != model.discriminator."
                f"layernorm_epsilon {self.discriminator.layernorm_epsilon}; set both to one "
                f"value, or pass --sharing-scope tokens")
        self._validate_core()
        if self.position_buckets == 0 or self.position_buckets < -1:
            raise ConfigError(f"{{0}} must be > 0 or -1 (no buckets), got "
                              f"{self.position_buckets}; DeBERTaV3 uses 256", "model.position_buckets")
        if self.max_relative_positions == 0 or self.max_relative_positions < -1:
            raise ConfigError(f"{{0}} must be > 0 or -1 (= max_position_embeddings), got "
                              f"{self.max_relative_positions}", "model.max_relative_positions")
        _positive("model", vocab_size=self.vocab_size, embedding_size=self.embedding_size,
                  max_position_embeddings=self.max_position_embeddings,
                  init_method_std=self.init_method_std,
                  make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)
        # the discriminator first: Megatron's flags set it, and the generator follows it
        self.discriminator.validate("model.discriminator")
        self.generator.validate("model.generator")

    def _validate_core(self) -> None:
        """``disentangled_core``: no effect without disentangled attention; the cores without
        attention-probability dropout (FlexAttention's, flashdeberta's) refuse it."""
        core = self.disentangled_core
        if core is DisentangledCore.AUTO:
            return
        if not self.attention_type.disentangled:
            warnings.warn(f"model.disentangled_core {core.value!r} has no effect: "
                          f"{self.attention_type.value} attention is not disentangled")
            return
        if core in (DisentangledCore.FLEX, DisentangledCore.FLASH):
            # the discriminator first: --attention-dropout sets it, and the generator follows
            for name, enc in (("discriminator", self.discriminator),
                              ("generator", self.generator)):
                if enc.attention_dropout > 0:
                    fix = ("--generator-attention-dropout 0" if name == "generator" else
                           "--attention-dropout 0 (the generator follows it unless "
                           "--generator-attention-dropout is given)")
                    raise ConfigError(
                        f"model.disentangled_core {core.value!r} has no attention-probability "
                        f"dropout, but {{0}} is {enc.attention_dropout}: pass {fix}, or --set "
                        f"model.disentangled_core=sdpa",
                        f"model.{name}.attention_dropout")

    def local_layer(self, layer_number: int) -> bool:
        """Whether the layer ``layer_number`` (1-based, megatron-core's) attends within the
        sliding window: the modern block's layers but every ``global_attn_every_n_layers``-th,
        counted from layer 1 (Hugging Face ``ModernBertAttention``: local unless
        layer_id % global_attn_every_n_layers == 0)."""
        return (self.attention_type.rotary and self.window_size > 0
                and (layer_number - 1) % self.global_attn_every_n_layers != 0)

    def _validate_block(self) -> None:
        """The modern block's fields (``attention_type`` "rotary"): their values, and that they
        keep their defaults in the other layouts, which build none of them."""
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"{{0}} {self.normalization!r}: choose "
                              f"{' or '.join(NORMALIZATIONS)}", "model.normalization")
        _positive("model", rotary_base=self.rotary_base,
                  local_rotary_base=self.local_rotary_base,
                  global_attn_every_n_layers=self.global_attn_every_n_layers)
        if self.window_size == 0 or self.window_size < -1:
            raise ConfigError(f"{{0}} must be > 0 or -1 (every layer global), got "
                              f"{self.window_size}; ModernBERT uses 128", "model.window_size")
        if self.attention_type.rotary:
            if self.layernorm_position is not LayerNormPosition.PRE:
                raise ConfigError("--position-embedding-type rope (the modern block) needs "
                                  "--layernorm-position pre (ModernBERT's layout, arXiv "
                                  "2412.13663); add --layernorm-position pre")
            return
        default = ModelConfig.__dataclass_fields__
        changed = [name for name in ("window_size", "normalization", "norm_bias",
                                     "add_bias_linear", "mlp_activation")
                   if getattr(self, name) != default[name].default]
        if changed:
            name = changed[0]
            value, was = (getattr(v, "value", v) for v in (getattr(self, name),
                                                             default[name].default))
            raise ConfigError(f"{{0}} {value!r} belongs to the modern block; add "
                              f"--position-embedding-type rope, or leave it at {was!r} for "
                              f"{self.attention_type.value} attention", f"model.{name}")


class MaskStrategy(str, enum.Enum):
    """What the masking selects (``--mask-strategy``; ``objectives/masking.py``).

    TOKEN: single tokens (BERT, ELECTRA, DeBERTaV3). WHOLE_WORD: every token of a word together
    (BERT's whole-word masking, words from the tokenizer's word-start pieces). SPAN: runs of
    whole words with truncated-geometric lengths (SpanBERT, arXiv 1907.10529 §3.1).
    """

    TOKEN = "token"
    WHOLE_WORD = "whole_word"
    SPAN = "span"


class Objective(str, enum.Enum):
    """What a run trains (``rtd.objective``).

    RTD: the generator + discriminator pair, L_MLM + rtd_lambda · L_RTD (arXiv 2111.09543 §3.1).
    MLM: one encoder of the discriminator's shape with the masked-LM loss alone and its MLM head
    tied to its own token table (BERT, arXiv 1810.04805 §3.1; ModernBERT, arXiv 2412.13663, masks
    30%: ``rtd.mask_prob=0.3``) — the masked-LM control at equal compute. The encoder takes the
    generator's place in the model (``generator.*``, ``mlm_head.*``; ``ModelConfig.masked_lm``),
    so it exports as its layout's masked-LM class, as a generator does.
    """

    RTD = "rtd"
    MLM = "mlm"


@dataclass(kw_only=True)
class RTDConfig(_Section):
    """The objective (arXiv 2111.09543 §3.1)."""

    SECTION = "rtd"

    # arXiv 2111.09543 §3.1 / ELECTRA use λ = 50; DeBERTa's released code defaults to 10.
    rtd_lambda: float = 50.0
    mask_prob: float = 0.15
    mask_token_prob: float = 0.8  # BERT's 80/10/10 (also DeBERTa's released code)
    random_token_prob: float = 0.1
    temperature: float = 1.0
    disallow_correct: bool = False  # ELECTRA option: never sample the original token
    # negative control: each sample's RTD labels permuted over its non-pad tokens (keyed by
    # seed, step, sample index), so the discriminator sees the replaced fraction but not where
    # the replacements are; a learning test's control must then fail its thresholds
    shuffle_labels: bool = False
    mask_strategy: MaskStrategy = MaskStrategy.TOKEN
    # span lengths in words: P(l) ∝ p·(1-p)^(l-1) for l = 1..span_max_words (SpanBERT §3.1)
    span_geometric_p: float = 0.2
    span_max_words: int = 10
    # what the run trains (Objective): the RTD pair, or the masked-LM control ("mlm")
    objective: Objective = Objective.RTD

    def validate(self) -> None:
        if not 0 < self.span_geometric_p <= 1:
            raise ConfigError(f"{{0}} must be in (0, 1], got {self.span_geometric_p}; "
                              "SpanBERT uses 0.2", "rtd.span_geometric_p")
        if self.span_max_words < 1:
            raise ConfigError(f"{{0}} must be >= 1, got {self.span_max_words}; "
                              "SpanBERT uses 10", "rtd.span_max_words")
        _positive("rtd", temperature=self.temperature)
        if self.rtd_lambda < 0:
            raise ConfigError(f"{{0}} must be >= 0, got {self.rtd_lambda}", "rtd.rtd_lambda")
        _probability("rtd", mask_prob=self.mask_prob, mask_token_prob=self.mask_token_prob,
                     random_token_prob=self.random_token_prob)
        if self.mask_prob == 0:
            raise ConfigError("{0} must be > 0 (nothing would be masked); e.g. 0.15",
                              "rtd.mask_prob")
        if self.mask_token_prob + self.random_token_prob > 1.0 + 1e-9:
            raise ConfigError(
                "rtd.mask_token_prob + rtd.random_token_prob must be <= 1, got "
                f"{self.mask_token_prob} + {self.random_token_prob}")
        if self.objective is Objective.MLM and self.shuffle_labels:
            raise ConfigError("{0} permutes RTD labels, which rtd.objective=mlm has none of; "
                              "drop it or use rtd.objective=rtd", "rtd.shuffle_labels")


def parse_blend(tokens: Sequence[str], flag: str) -> list[tuple[float, list[str]]]:
    """A data-path flag's values as (normalised weight, [entries]) pairs: plain prefixes are
    one dataset of weight 1; ``W1 P1 W2 P2 …`` is a blend (Megatron-LM's syntax).

    Raises:
        ConfigError: naming ``flag``, for a mix of weights and prefixes or a weight <= 0.
    """
    tokens = list(tokens)
    if not tokens:
        return []

    def weight(t: str) -> Optional[float]:
        try:
            w = float(t)
        except ValueError:
            return None
        return w if math.isfinite(w) else -1.0  # inf / nan: not a valid weight

    if weight(tokens[0]) is None:
        return [(1.0, tokens)]
    pairs = list(zip(tokens[0::2], tokens[1::2]))
    bad = (len(tokens) % 2 or any(weight(w) is None or not weight(w) > 0 for w, _ in pairs)
           or any(weight(p) is not None for _, p in pairs))
    if bad:
        raise ConfigError(f"{flag} {' '.join(tokens)}: expected either prefixes only, or "
                          f"positive WEIGHT PREFIX pairs (e.g. {flag} 0.7 A 0.3 B)")
    total = sum(float(w) for w, _ in pairs)
    return [(float(w) / total, [p]) for w, p in pairs]


@dataclass(kw_only=True)
class DataConfig(_Section):
    """Data, packing and loading (Megatron-LM's flag names; rtd_scale/data/*.py)."""

    SECTION = "data"
    KIND = None  # each field names its kind

    # --data-path as typed: shard or dataset prefixes (one dataset, concatenated), or
    # WEIGHT PREFIX pairs (a blend, weights normalised), e.g. ["0.7", "A", "0.3", "B"]
    data_path: list[str] = field(default_factory=list, metadata=RUN)
    # --valid-data-path / --test-data-path (Megatron-LM's): held-out corpora in --data-path's
    # syntax, each read whole as the validation / test split (none: that split of data_path)
    valid_data_path: list[str] = field(default_factory=list, metadata=RUN)
    test_data_path: list[str] = field(default_factory=list, metadata=RUN)
    tokenizer_model: Optional[str] = field(default=None, metadata=RUN)
    seq_length: int = field(default=512, metadata=RUN)
    # train,valid,test document shares of each dataset (Megatron-LM)
    split: str = field(default="969,30,1", metadata=RUN)
    # sample-index cache; default index-cache/ by the shards
    data_cache_path: Optional[str] = field(default=None, metadata=RUN)
    # DataLoader worker processes per rank (Megatron-LM's default)
    num_workers: int = field(default=2, metadata=RUN)
    # micro-batches read ahead per worker (with num_workers > 0)
    prefetch_factor: int = field(default=2, metadata=RUN)
    # document-masked packing (--reset-attention-mask): attention never crosses a document
    # boundary inside a packed sample and positions restart at each document (Megatron-LM's
    # --reset-attention-mask and --reset-position-ids, one switch here); the samples, their
    # order and their masks are the same either way (data/packed.py, model/document_mask.py).
    # A preset whose layout packs this way sets it.
    document_masking: bool = field(default=False, metadata=RUN)

    def split_weights(self) -> tuple[float, float, float]:
        """``split`` as three non-negative floats (missing trailing shares are 0)."""
        try:
            w = [float(x) for x in self.split.replace("/", ",").split(",") if x.strip()]
        except ValueError:
            w = []
        if not 1 <= len(w) <= 3 or min(w) < 0 or w[0] <= 0 or not all(math.isfinite(x) for x in w):
            raise ConfigError(f"{{0}} {self.split!r}: expected up to three non-negative "
                              "train,valid,test shares with a positive train share, e.g. "
                              "969,30,1", "data.split")
        return tuple(w + [0.0] * (3 - len(w)))  # type: ignore[return-value]

    def sources(self) -> list[tuple[float, list[str]]]:
        """The datasets of ``data_path``: (normalised weight, [entries]) pairs. Plain prefixes
        are one dataset of weight 1; ``W1 P1 W2 P2 …`` is a blend (Megatron-LM's syntax)."""
        return parse_blend(self.data_path, "--data-path")

    def valid_sources(self) -> list[tuple[float, list[str]]]:
        """``valid_data_path`` (``--valid-data-path``, the same syntax) as :meth:`sources`."""
        return parse_blend(self.valid_data_path, "--valid-data-path")

    def test_sources(self) -> list[tuple[float, list[str]]]:
        """``test_data_path`` (``--test-data-path``, the same syntax) as :meth:`sources`."""
        return parse_blend(self.test_data_path, "--test-data-path")

    def train_split_weights(self) -> tuple[float, float, float]:
        """The train,valid,test shares of ``data_path``'s documents: ``split``, with the share of
        a split that a corpus of its own holds (``valid_data_path`` / ``test_data_path``) set to
        0, so those documents are trained on instead of left unread. (Megatron-LM reads a
        --valid-data-path / --test-data-path corpus whole, as here.)"""
        train, valid, test = self.split_weights()
        return (train, 0.0 if self.valid_data_path else valid,
                0.0 if self.test_data_path else test)

    def validate(self, model: ModelConfig) -> None:
        _positive("data", seq_length=self.seq_length)
        if self.seq_length < 3:
            raise ConfigError(f"{{0}} must be >= 3 ([CLS] x [SEP]), got {self.seq_length}",
                              "data.seq_length")
        if self.seq_length > model.max_position_embeddings:
            raise ConfigError(
                f"{{0}} {self.seq_length} exceeds {{1}} {model.max_position_embeddings}; lower "
                "the sequence length or raise the position table", "data.seq_length",
                "model.max_position_embeddings")
        self.split_weights()
        self.sources()
        self.valid_sources()
        self.test_sources()
        if self.num_workers < 0:
            raise ConfigError(f"{{0}} must be >= 0 (0: load in the training process), "
                              f"got {self.num_workers}", "data.num_workers")
        if self.prefetch_factor < 1:
            raise ConfigError(f"{{0}} must be >= 1, got {self.prefetch_factor}",
                              "data.prefetch_factor")


@dataclass(kw_only=True)
class ParallelConfig(_Section):
    SECTION = "parallel"

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # --distributed-timeout-minutes: torch.distributed's and megatron-core's process-group
    # timeout (Megatron-LM's flag and default, megatron/training/arguments.py)
    distributed_timeout_minutes: int = 10

    def validate(self, model: ModelConfig) -> None:
        _positive("parallel", tensor_model_parallel_size=self.tensor_model_parallel_size,
                  pipeline_model_parallel_size=self.pipeline_model_parallel_size,
                  distributed_timeout_minutes=self.distributed_timeout_minutes)
        encoders = (("discriminator", model.discriminator), ("generator", model.generator))
        pp = self.pipeline_model_parallel_size
        layers = [enc.num_layers for _, enc in encoders]
        for name, enc in encoders:
            if enc.num_layers % pp:
                fits = ", ".join(map(str, divisors(*layers)))
                raise ConfigError(
                    f"{{0}} ({enc.num_layers}) cannot be divided evenly over "
                    f"--pipeline-model-parallel-size {pp} (both models are split over the same "
                    f"stages); use a pipeline size that divides both layer counts "
                    f"({' and '.join(map(str, layers))}): {fits}", f"model.{name}.num_layers")
        tp = self.tensor_model_parallel_size
        split = [v for _, enc in encoders for v in (enc.num_attention_heads, enc.ffn_hidden_size)]
        for name, enc in encoders:
            for what, v in (("num_attention_heads", enc.num_attention_heads),
                            ("ffn_hidden_size", enc.ffn_hidden_size)):
                if v % tp:
                    raise ConfigError(
                        f"{{0}} ({v}) must be divisible by "
                        f"--tensor-model-parallel-size ({tp}); the sizes that divide both "
                        f"models' head counts and FFN sizes: "
                        f"{', '.join(map(str, divisors(*split)))}", f"model.{name}.{what}")


class LRDecayStyle(str, enum.Enum):
    """``--lr-decay-style``: megatron-core's ``OptimizerParamScheduler`` styles after warm-up."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    INVERSE_SQUARE_ROOT = "inverse-square-root"
    WSD = "WSD"  # warmup-stable-decay: the peak until the last lr_wsd_decay_* of the decay


class WSDDecayStyle(str, enum.Enum):
    """``--lr-wsd-decay-style``: the annealing of a WSD schedule's last phase (megatron-core)."""

    EXPONENTIAL = "exponential"
    LINEAR = "linear"
    COSINE = "cosine"
    MINUS_SQRT = "minus_sqrt"


@dataclass(kw_only=True)
class OptimConfig(_Section):
    """AdamW and megatron-core's learning-rate schedule (``training/lr_schedule.py``): warm-up
    from ``lr_warmup_init`` to ``lr``, then ``lr_decay_style`` down to ``min_lr`` (linear by
    default, arXiv 2111.09543 Table 10). Lengths are Megatron-LM's: ``*_iters`` in optimizer
    steps, ``*_samples`` in samples, ``lr_warmup_fraction`` of the decay length."""

    SECTION = "optim"

    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0  # optimizer steps, never micro-batches (Megatron-LM)
    lr_decay_iters: Optional[int] = None  # default: train_iters
    lr_decay_style: LRDecayStyle = LRDecayStyle.LINEAR
    lr_warmup_fraction: Optional[float] = None  # of the decay length; not with *_warmup_iters
    lr_warmup_samples: int = 0  # samples; not with lr_warmup_iters
    lr_decay_samples: Optional[int] = None  # samples; not with lr_decay_iters
    lr_warmup_init: float = 0.0  # the lr of the first update when warming up
    lr_wsd_decay_style: WSDDecayStyle = WSDDecayStyle.EXPONENTIAL
    lr_wsd_decay_iters: Optional[int] = None  # WSD's annealing phase, in optimizer steps
    lr_wsd_decay_samples: Optional[int] = None  # ... or in samples
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-6
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    # On --load, when any field above differs from the checkpoint's (Megatron-LM's flags and
    # meaning, for the schedule and AdamW's values alike): the flags' values win from the first
    # resumed iteration, or the checkpoint's are kept; a difference with neither is an error.
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False

    def validate(self) -> None:
        _positive("optim", lr=self.lr)
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"{{0}} must be in [0, lr={self.lr}], got {self.min_lr}",
                              "optim.min_lr")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"{{0}} must be >= 0, got {self.lr_warmup_iters}",
                              "optim.lr_warmup_iters")
        if self.lr_decay_iters is not None and self.lr_decay_iters < self.lr_warmup_iters:
            raise ConfigError(
                f"{{0}} ({self.lr_decay_iters}) must be >= {{1}} ({self.lr_warmup_iters})",
                "optim.lr_decay_iters", "optim.lr_warmup_iters")
        self._validate_schedule()
        if self.clip_grad < 0:
            raise ConfigError(f"{{0}} must be >= 0 (0 disables), got {self.clip_grad}",
                              "optim.clip_grad")
        _probability("optim", adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2)
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler contradict each other; "
                              "pass one of them")

    def _validate_schedule(self) -> None:
        pairs = (("--lr-warmup-iters", self.lr_warmup_iters > 0, "--lr-warmup-samples",
                  self.lr_warmup_samples > 0),
                 ("--lr-warmup-fraction", self.lr_warmup_fraction is not None,
                  "--lr-warmup-iters/--lr-warmup-samples",
                  self.lr_warmup_iters > 0 or self.lr_warmup_samples > 0),
                 ("--lr-decay-iters", self.lr_decay_iters is not None, "--lr-decay-samples",
                  self.lr_decay_samples is not None),
                 ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters is not None,
                  "--lr-wsd-decay-samples", self.lr_wsd_decay_samples is not None))
        for a, has_a, b, has_b in pairs:  # Megatron-LM's validate_args allows one of each
            if has_a and has_b:
                raise ConfigError(f"{a} and {b} both give the same length; pass one of them")
        if self.lr_warmup_fraction is not None and not 0.0 <= self.lr_warmup_fraction < 1.0:
            raise ConfigError(f"{{0}} must be in [0, 1), got {self.lr_warmup_fraction}",
                              "optim.lr_warmup_fraction")
        for name in ("lr_warmup_samples", "lr_decay_samples", "lr_wsd_decay_iters",
                     "lr_wsd_decay_samples"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"{{0}} must be >= 0, got {v}", f"optim.{name}")
        if self.lr_decay_samples == 0:
            raise ConfigError("{0} must be > 0; omit it to decay over the run",
                              "optim.lr_decay_samples")
        if not 0.0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"{{0}} must be in [0, {{1}} {self.lr}], got "
                              f"{self.lr_warmup_init}", "optim.lr_warmup_init", "optim.lr")
        if (self.lr_decay_style is LRDecayStyle.WSD and self.lr_wsd_decay_iters is None
                and self.lr_wsd_decay_samples is None):
            raise ConfigError("--lr-decay-style WSD needs the length of its annealing phase: "
                              "add --lr-wsd-decay-iters N (or --lr-wsd-decay-samples N)")

    def schedule_samples(self, train_iters: int,
                         global_batch_size: int) -> tuple[float, int, Optional[int]]:
        """(warm-up, decay, WSD annealing) lengths in samples, as Megatron-LM's
        ``get_optimizer_param_scheduler`` derives them: ``*_iters`` × global batch size,
        ``*_samples`` as given, the decay defaulting to ``train_iters`` and the warm-up
        fraction applying to the decay length (so it may be fractional)."""
        g = global_batch_size
        if self.lr_decay_samples is not None:
            decay = self.lr_decay_samples
        else:
            decay = (self.lr_decay_iters or train_iters) * g
        if self.lr_warmup_fraction is not None:
            warmup: float = self.lr_warmup_fraction * decay
        elif self.lr_warmup_samples:
            warmup = self.lr_warmup_samples
        else:
            warmup = self.lr_warmup_iters * g
        wsd = (self.lr_wsd_decay_samples if self.lr_wsd_decay_samples is not None else
               None if self.lr_wsd_decay_iters is None else self.lr_wsd_decay_iters * g)
        return warmup, decay, wsd


@dataclass(kw_only=True)
class TrainConfig(_Section):
    SECTION = "train"
    KIND = None  # each field names its kind

    train_iters: int = field(default=1000, metadata=RUN)  # optimizer steps
    micro_batch_size: int = field(default=8, metadata=RUN)  # samples per rank per forward
    # samples per optimizer step, all data-parallel ranks
    global_batch_size: int = field(default=8, metadata=RUN)
    precision: Precision = field(default=Precision.FP32, metadata=RUN)
    seed: int = field(default=1234, metadata=RUN)
    save: Optional[str] = field(default=None, metadata=LOCATION)
    load: Optional[str] = field(default=None, metadata=LOCATION)
    save_interval: int = field(default=0, metadata=RUN)  # steps; 0: only at the end
    log_interval: int = field(default=10, metadata=RUN)
    # per-phase timers in the log line and TensorBoard (training/timers.py), Megatron-LM's
    # --timing-log-level: 0 none, 1 coarse (data, forward, backward, step), 2 fine (+ the
    # forward's mask, generator forward, sample, discriminator forward)
    timing_log_level: int = field(default=0, metadata=RUN)
    tensorboard_dir: Optional[str] = field(default=None, metadata=LOCATION)
    ds_config: Optional[str] = field(default=None, metadata=RUN)
    # consolidated TP-agnostic weights written after the last step
    export: Optional[str] = field(default=None, metadata=LOCATION)
    # Hugging Face export directory written after the last step (rtd_scale/hf/export.py)
    export_hf: Optional[str] = field(default=None, metadata=LOCATION)
    # weights only (optimizer and schedule start fresh), any TP/PP/DP layout: an export
    # directory, a Hugging Face directory of an export target (rtd_scale/hf/adapters.py) or an
    # --export .pt file (rtd_scale/hf/pretrained.py); RUN: the initial weights are part of
    # what is trained (a read-only input, as --data-path), unlike --load's whole resumed state
    pretrained_checkpoint: Optional[str] = field(default=None, metadata=RUN)
    # steps between validations (Megatron-LM's default); 0: never
    eval_interval: int = field(default=1000, metadata=RUN)
    # global batches per validation; 0: never validate
    eval_iters: int = field(default=100, metadata=RUN)
    # audit: per-step jsonl of sample ids, mask and loss hashes
    data_digest: Optional[str] = field(default=None, metadata=LOCATION)
    # analysis: each validation's original ids, masks, corrupted ids and discriminator logits,
    # one torch.save file per evaluation and data-parallel rank (training/loop.py evaluate)
    eval_dump_dir: Optional[str] = field(default=None, metadata=LOCATION)
    # stop after this many iterations in a row with a non-finite loss or gradient norm (each
    # is skipped); checked at the log interval and before a save; 0: never stop
    max_consecutive_nonfinite_iters: int = field(default=5, metadata=RUN)
    # loss spikes (training/spikes.py): a step whose L_MLM or L_RTD exceeds its median over the
    # last loss_spike_window_iters steps by more than loss_spike_threshold robust standard
    # deviations of the logarithm and by more than loss_spike_min_rise of the median
    loss_spike_policy: LossSpikePolicy = field(default=LossSpikePolicy.ROLLBACK, metadata=RUN)
    loss_spike_window_iters: int = field(default=100, metadata=RUN)
    loss_spike_threshold: float = field(default=6.0, metadata=RUN)
    loss_spike_min_rise: float = field(default=0.1, metadata=RUN)
    # rollbacks in the whole run (kept in the checkpoints) after which a spike stops it
    max_loss_spike_rollbacks: int = field(default=5, metadata=RUN)
    # a device's peak TFLOP/s, MFU's denominator in the log (--peak-tflops-per-device or
    # --device-peak); None: the GPU's bf16 dense datasheet value when its name is known
    peak_tflops_per_device: Optional[float] = field(default=None, metadata=RUN)
    # with --load: accept another --seed than the checkpoint's, or other training data than it
    # was trained on; the data order (and masks, sampling noise) start anew at the resumed
    # sample (training/checkpoint/compat.py, check_compatible and check_same_data); LOCATION:
    # a permission for the one resume --load names, not taken from another run's file
    override_data_order: bool = field(default=False, metadata=LOCATION)

    @property
    def evaluates(self) -> bool:
        return self.eval_interval > 0 and self.eval_iters > 0

    def validate(self) -> None:
        _positive("train", train_iters=self.train_iters, micro_batch_size=self.micro_batch_size,
                  global_batch_size=self.global_batch_size, log_interval=self.log_interval)
        if self.timing_log_level not in (0, 1, 2):
            raise ConfigError("{0} must be 0 (no timers), 1 (data wait, forward, backward, "
                              "optimizer step) or 2 (also the forward's phases), got "
                              f"{self.timing_log_level!r}", "train.timing_log_level")
        if self.save_interval < 0:
            raise ConfigError(f"{{0}} must be >= 0, got {self.save_interval}",
                              "train.save_interval")
        if not 0 <= self.seed <= 2**32 - 1:
            # numpy's seeds (the masking streams' default_rng, transformers.set_seed) are
            # non-negative; 2**32 - 1 is the legacy np.random.seed bound Megatron-LM's seeds keep
            raise ConfigError(f"{{0}} must be in [0, 2**32 - 1], got {self.seed}", "train.seed")
        if self.max_consecutive_nonfinite_iters < 0:
            raise ConfigError("{0} must be >= 0 (0: never stop), "
                              f"got {self.max_consecutive_nonfinite_iters}",
                              "train.max_consecutive_nonfinite_iters")
        if self.loss_spike_window_iters < 10:
            raise ConfigError("{0} must be >= 10 (the iterations a spike is measured "
                              "against; the spread of fewer is no estimate), got "
                              f"{self.loss_spike_window_iters}", "train.loss_spike_window_iters")
        if not self.loss_spike_threshold > 0 or not self.loss_spike_min_rise >= 0:
            raise ConfigError("--loss-spike-threshold must be > 0 (robust standard deviations) "
                              "and train.loss_spike_min_rise >= 0 (a fraction of the median), "
                              f"got {self.loss_spike_threshold} and {self.loss_spike_min_rise}")
        if self.max_loss_spike_rollbacks < 0:
            raise ConfigError("{0} must be >= 0 (0: the first spike stops the run), got "
                              f"{self.max_loss_spike_rollbacks}", "train.max_loss_spike_rollbacks")
        if self.peak_tflops_per_device is not None and not self.peak_tflops_per_device > 0:
            raise ConfigError("{0} must be > 0 (TFLOP/s of one device), "
                              f"got {self.peak_tflops_per_device}", "train.peak_tflops_per_device")
        if self.eval_interval < 0 or self.eval_iters < 0:
            raise ConfigError(f"--eval-interval and --eval-iters must be >= 0 (0 disables "
                              f"validation), got {self.eval_interval} and {self.eval_iters}")


@dataclass(kw_only=True)
class MonitorConfig(_Section):
    """Weights & Biases and the step profiler, with Megatron-LM's flags (``--wandb-*``,
    ``--profile*``; defaults as in its ``megatron/training/arguments.py``)."""

    SECTION = "monitor"
    KIND = None  # each field names its kind

    # log to W&B (from the logging rank) when set
    wandb_project: Optional[str] = field(default=None, metadata=RUN)
    # the W&B run's name; None: W&B picks one
    wandb_exp_name: Optional[str] = field(default=None, metadata=RUN)
    # team or user; None: W&B's default entity
    wandb_entity: Optional[str] = field(default=None, metadata=RUN)
    # W&B's local files; None: <save>/wandb
    wandb_save_dir: Optional[str] = field(default=None, metadata=LOCATION)
    # torch.profiler trace of iterations [profile_step_start, _end)
    profile: bool = field(default=False, metadata=RUN)
    # the first traced iteration (1-based, as in the log)
    profile_step_start: int = field(default=10, metadata=RUN)
    # the iteration after the last traced one
    profile_step_end: int = field(default=12, metadata=RUN)
    # global ranks traced
    profile_ranks: list[int] = field(default_factory=lambda: [0], metadata=RUN)
    # Python stacks and module names (nn.Module: Encoder_0, …) in the trace; ~100× larger
    # (268 MB for two tiny-preset CPU steps under ZeRO-3, tests/e2e/test_monitoring_launcher.py)
    profile_with_stack: bool = field(default=False, metadata=RUN)

    @property
    def uses_wandb(self) -> bool:
        return bool(self.wandb_project)

    @property
    def profiled_iterations(self) -> range:
        return range(self.profile_step_start, self.profile_step_end)

    def validate(self, train_iters: int) -> None:
        try:
            self.profile_ranks = [int(r) for r in self.profile_ranks]
        except ValueError:
            raise ConfigError(f"--profile-ranks {' '.join(map(str, self.profile_ranks))}: "
                              "expected global rank numbers, e.g. --profile-ranks 0 1") from None
        if not self.profile:
            return
        if self.profile_step_start < 1 or self.profile_step_end <= self.profile_step_start:
            raise ConfigError(f"--profile-step-start {self.profile_step_start} "
                              f"--profile-step-end {self.profile_step_end}: the traced "
                              "iterations are start … end − 1 (1-based); pass 1 <= start < end, "
                              "e.g. --profile-step-start 10 --profile-step-end 12")
        if any(r < 0 for r in self.profile_ranks) or not self.profile_ranks:
            raise ConfigError(f"--profile-ranks {' '.join(map(str, self.profile_ranks))}: "
                              "pass one or more global ranks >= 0, e.g. --profile-ranks 0")
        if self.profile_step_start > train_iters:
            warnings.warn(f"--profile-step-start {self.profile_step_start} is after the last "
                          f"iteration ({train_iters}): --profile has no effect")


@dataclass(kw_only=True)
class FaultToleranceConfig(_Section):
    """The per-rank heartbeat and the straggler report (``training/heartbeat.py``,
    ``training/stragglers.py``). Budgets are seconds without a finished step before a rank is
    declared hung, one per section as in NVIDIA's resiliency extension (its ft_launcher's
    ``--ft-rank-section-timeouts setup:600,step:180,checkpointing:420``, NeMo's defaults):
    ``setup`` from the start of the training loop to the first finished step (and a validation),
    ``step`` between two steps, ``checkpointing`` for a save. None: derived while the run goes,
    ``safety_factor`` × the measured median step (or the longest save) with the floor below; 0:
    that budget is off."""

    SECTION = "fault_tolerance"

    setup_timeout_s: Optional[float] = 600.0
    step_timeout_s: Optional[float] = None
    checkpointing_timeout_s: Optional[float] = None
    step_timeout_floor_s: float = 180.0
    checkpointing_timeout_floor_s: float = 420.0
    # NVIDIA resiliency extension's FaultToleranceConfig.safety_factor: observed × 5
    safety_factor: float = 5.0
    # a rank whose own work per step is slower than this fraction of the median rank's is named
    # (Megatron-LM's StragglerDetector and the resiliency extension report ranks below 0.7);
    # 0: name none
    straggler_threshold: float = 0.7

    def validate(self) -> None:
        for name in ("setup_timeout_s", "step_timeout_s", "checkpointing_timeout_s"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"--ft-rank-section-timeouts: fault_tolerance.{name} must be "
                                  f">= 0 seconds (0: off; auto: derived), got {v}")
        _positive("fault_tolerance", step_timeout_floor_s=self.step_timeout_floor_s,
                  checkpointing_timeout_floor_s=self.checkpointing_timeout_floor_s,
                  safety_factor=self.safety_factor)
        if not 0 <= self.straggler_threshold < 1:
            raise ConfigError("{0} must be in [0, 1) (a fraction of the median rank's speed; "
                              f"0: name none), got {self.straggler_threshold}",
                              "fault_tolerance.straggler_threshold")


@dataclass(kw_only=True)
class RunConfig(_Section):
    """The whole tree. Builders get only their section."""

    SECTION = ""

    preset: str = "tiny"
    model: ModelConfig
    rtd: RTDConfig = field(default_factory=RTDConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        self.validate()

    def trained_model(self) -> ModelConfig:
        """The model the run builds: ``model``, or under ``rtd.objective=mlm`` its masked LM
        alone (``ModelConfig.masked_lm``: the discriminator's shape in the generator's place).
        What counts the step (``flops.py``, ``memory.py``) and what an export's classes are
        made from read this one."""
        return self.model.masked_lm() if self.rtd.objective is Objective.MLM else self.model

    def dumps_evaluations(self) -> bool:
        """Whether ``--eval-dump-dir`` is ever written: by a validation, or by the test
        evaluation after the last step (``--test-data-path`` with ``--eval-iters`` > 0, run
        even with ``--eval-interval 0``; training/loop.py)."""
        return self.train.evaluates or bool(self.train.eval_iters > 0 and self.data.test_data_path)

    def validate(self) -> None:
        self.model.validate()
        self.rtd.validate()
        self.data.validate(self.model)
        self.parallel.validate(self.trained_model())
        self.optim.validate()
        self.train.validate()
        self.monitor.validate(self.train.train_iters)
        self.fault_tolerance.validate()
        train = self.train
        if train.eval_dump_dir and self.rtd.objective is Objective.MLM:
            warnings.warn(f"--eval-dump-dir {train.eval_dump_dir} has no effect under "
                          "rtd.objective=mlm: the dumps hold the discriminator's replacements "
                          "and logits, which a masked LM has none of; drop the flag")
        elif train.eval_dump_dir and not self.dumps_evaluations():
            warnings.warn(f"--eval-dump-dir {train.eval_dump_dir} has no effect: validation is "
                          f"off (--eval-interval {train.eval_interval}, --eval-iters "
                          f"{train.eval_iters}); pass both > 0 to write the dumps")
        if (self.train.evaluates and not self.data.valid_data_path
                and self.data.split_weights()[1] == 0):
            warnings.warn(f"--split {self.data.split} gives validation no documents: "
                          "--eval-interval has no effect (give the second share a weight, "
                          "e.g. --split 969,30,1, or pass --valid-data-path)")
        warmup, decay, wsd = self.optim.schedule_samples(self.train.train_iters,
                                                         self.train.global_batch_size)
        if warmup >= self.train.train_iters * self.train.global_batch_size:
            # megatron-core's scheduler reaches the peak at the update after the warm-up
            warnings.warn(
                f"the learning-rate warm-up ({warmup:g} samples) is not shorter than the run "
                f"(--train-iters {self.train.train_iters} × --global-batch-size "
                f"{self.train.global_batch_size}): the peak learning rate is never reached")
        if wsd is not None and wsd > decay:
            raise ConfigError(f"--lr-wsd-decay-iters/-samples ({wsd} samples) exceeds the decay "
                              f"length ({decay} samples); use at most --lr-decay-iters")

    def to_dict(self) -> dict[str, Any]:
        def conv(o: Any) -> Any:
            if isinstance(o, enum.Enum):
                return o.value
            if dataclasses.is_dataclass(o):
                return {f.name: conv(getattr(o, f.name)) for f in dataclasses.fields(o)}
            if isinstance(o, list):
                return [conv(x) for x in o]
            return o

        return conv(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        """The inverse of :meth:`to_dict` (a run's ``config.json``, a checkpoint's
        ``rtd_meta.json``): every section built from its recorded fields, validated.

        Validated without its warnings: a recorded config was warned about when its run
        started, and a config file is warned about with the flags beside it
        (``arguments.config_from_args``).

        Raises:
            ConfigError: naming a field that is unknown, missing or of the wrong kind.
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _build(cls, d, "")


@functools.cache
def field_kinds(section: type = RunConfig, path: str = "") -> dict[str, FieldKind]:
    """The :class:`FieldKind` of every leaf field under ``section``, by dotted path
    (``"train.load"``): the field's ``metadata`` kind, else its section's ``KIND``.

    Raises:
        AssertionError: a field of a section that holds both kinds names none (a new field
            says what it is: tests/unit/test_config_file.py).
    """
    out: dict[str, FieldKind] = {}
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        dotted = _dotted(path, f.name)
        kind = hints[f.name]
        if isinstance(kind, type) and issubclass(kind, _Section):
            out.update(field_kinds(kind, dotted))
            continue
        named = f.metadata.get("kind", section.KIND)
        assert named is not None, (f"{dotted}: {section.__name__} holds fields of both kinds; "
                                   "give it metadata=RUN or metadata=LOCATION")
        out[dotted] = named
    return out


def location_fields() -> list[str]:
    """The dotted paths of the :attr:`FieldKind.LOCATION` fields, in the tree's order."""
    return [p for p, k in field_kinds().items() if k is FieldKind.LOCATION]


def _build(kind: type, values: Any, path: str) -> Any:
    """The section class ``kind`` (``path``: its dotted name) from a mapping of its fields:
    nested sections from nested mappings, every other value through :func:`_typed`; a field
    the mapping lacks takes its default."""
    if not isinstance(values, dict):
        raise ConfigError(f"{{0}}: expected a mapping of fields, got {values!r}",
                          path or "the config")
    fields = {f.name: f for f in dataclasses.fields(kind)}
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise ConfigError(f"{{0}}: no such field{_did_you_mean(unknown[0], fields)}; "
                          f"{path or 'the config'} has {', '.join(fields)}",
                          _dotted(path, unknown[0]))
    hints = typing.get_type_hints(kind)
    kwargs = {name: (_build(hints[name], value, _dotted(path, name))
                     if dataclasses.is_dataclass(hints[name])
                     else _typed(hints[name], value, _dotted(path, name)))
              for name, value in values.items()}
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError("{0}: missing (a field without a default must be given)",
                          _dotted(path, missing[0]))
    return kind(**kwargs)


def _dotted(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _typed(kind: Any, value: Any, path: str) -> Any:
    """``value`` (from a config file, or a ``--set`` string) as a value of the annotation
    ``kind`` of the field ``path``: a string is parsed as ``--set`` parses it, an int stands
    for a float; anything else of the wrong kind is an error naming the field.

    Raises:
        ConfigError: naming the field, the value and the kind expected.
    """
    optional = type(None) in typing.get_args(kind)
    if optional:  # Optional[X]: the field's default may be None, so its type comes from X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
            return None
    try:
        if isinstance(value, str) and kind is not str:
            return _parse_value(kind, value)
        if typing.get_origin(kind) is list:
            item = typing.get_args(kind)[0]
            if isinstance(value, list):
                return [_typed(item, v, path) for v in value]
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            return kind(value)
        elif kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            if math.isfinite(value):
                return float(value)
        elif isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
    except ValueError:
        pass
    raise ConfigError(f"{{0}} {value!r}: expected {_expected(kind)}"
                      + (" or none" if optional else ""), path)


def _expected(kind: Any) -> str:
    """What a value of the annotation ``kind`` is, for an error (Optional[X]: X's)."""
    if type(None) in typing.get_args(kind):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return f"one of {', '.join(m.value for m in kind)}"
    if kind is float:
        return "a finite value of type float"
    if typing.get_origin(kind) is list:
        return f"a list of {getattr(typing.get_args(kind)[0], '__name__', 'values')}"
    return f"a value of type {getattr(kind, '__name__', kind)}"


def _parse_value(kind: Any, raw: str) -> Any:
    """``raw`` (a ``--set`` value) as an instance of the annotation ``kind``.

    Raises:
        ValueError: ``raw`` is not a value of ``kind``.
    """
    if kind is bool:
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(raw)
        return raw.lower() in ("true", "1")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(raw)
    if kind is int:
        return int(raw)
    if kind is float:
        value = float(raw)
        if not math.isfinite(value):
            raise ValueError(raw)
        return value
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return [_parse_value(item, x) for x in raw.split(",") if x]
    return raw


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the known name closest to a mistyped one (difflib's ratio at
    least 0.6, as git and argparse suggest), else ``""``."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _closest_leaf(section: Any, path: list[str], name: str) -> str:
    """`` (did you mean P?)`` for a mistyped ``--set`` field ``name`` under ``section`` (at the
    dotted ``path``): the fields of the section and of the sections inside it, by their own
    names (``model.hidden_size`` is ``model.discriminator.hidden_size``; ``objective`` is
    ``rtd.objective``), exact names first, then difflib's closest, else ``""``."""
    import difflib

    leaves: dict[str, list[str]] = {}

    def walk(obj: Any, where: list[str]) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, [*where, f.name])
            else:
                leaves.setdefault(f.name, []).append(".".join([*where, f.name]))

    if not dataclasses.is_dataclass(section):
        return ""
    walk(section, path)
    close = [name] if name in leaves else difflib.get_close_matches(name, list(leaves), n=1)
    if not close:
        return ""
    found = sorted(leaves[close[0]], key=lambda p: (p.count("."), p))
    return f" (did you mean {' or '.join(found)}?)"


def apply_override(cfg: RunConfig, assignment: str) -> str:
    """Apply one ``section.field=value`` override (``--set``), the value typed as a config
    file's is (:func:`_typed`). Returns the field's dotted name.

    Raises:
        ConfigError: malformed assignment, unknown field, or a value of the wrong type.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. rtd.mask_prob=0.2")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    obj: Any = cfg
    for p in parts[:-1]:
        if not dataclasses.is_dataclass(obj) or not hasattr(obj, p):
            sections = ([f.name for f in dataclasses.fields(obj)
                         if dataclasses.is_dataclass(getattr(obj, f.name))]
                        if dataclasses.is_dataclass(obj) else [])
            raise ConfigError(f"--set {key}: no config section {p!r}"
                              f"{_did_you_mean(p, sections)}"
                              + (f"; sections: {', '.join(sections)}" if sections else ""))
        obj = getattr(obj, p)
    name = parts[-1]
    fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    if name not in fields or dataclasses.is_dataclass(getattr(obj, name)):
        raise ConfigError(f"--set {key}: unknown field{_closest_leaf(obj, parts[:-1], name)}; "
                          f"known: {', '.join(fields) or 'none'}")
    kind = typing.get_type_hints(type(obj))[name]
    try:
        value = _typed(kind, raw, key)
    except ConfigError:
        current = getattr(obj, name)
        example = current.value if isinstance(current, enum.Enum) else current
        optional = type(None) in typing.get_args(kind)
        raise ConfigError(f"--set {key}={raw}: expected {_expected(kind)}"
                          + (" or none" if optional else "")
                          + (f", e.g. --set {key}={example}" if example is not None
                             else "")) from None
    setattr(obj, name, value)
    return key
