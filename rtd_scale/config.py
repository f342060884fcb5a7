"""The typed config tree of rtd_scale: one section per component, validated at construction.

Precedence (lowest to highest): preset defaults → command-line flags → ``--set key=value``
overrides. The resolved tree is written to ``<save>/config.json`` before step 1.

Every rule cites its source. Errors are ``ConfigError`` (a ``ValueError``) naming the field and the fix.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from rtd_scale.cli_errors import UserInputError

class ConfigError(UserInputError):
    """A config value is invalid; the message names the field or flag and the fix."""


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


def _positive(section: str, **values: float) -> None:
    for name, v in values.items():
        if v is None or v <= 0:
            raise ConfigError(f"{section}.{name} must be > 0, got {v!r}")


def _divisors(*numbers: int) -> list[int]:
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
            raise ConfigError(f"{section}.{name} must be in [0, 1], got {v!r}")


@dataclass(kw_only=True)
class EncoderConfig:
    """One transformer encoder (generator or discriminator)."""

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
                f"{name}.hidden_size ({self.hidden_size}) must be divisible by "
                f"{name}.num_attention_heads ({self.num_attention_heads}); use "
                f"{_nearest(_divisors(self.hidden_size), self.num_attention_heads)} heads (the "
                f"nearest counts that divide {self.hidden_size})")


@dataclass(kw_only=True)
class ModelConfig:
    """Generator, discriminator and their shared token table.

    ``embedding_size`` is the token table's width. DeBERTaV3 style: equal to both hidden sizes.
    ELECTRA style: smaller, and each model projects it to its hidden size (arXiv 2003.10555 §3.2).

    ``layernorm_position`` is the layout of both encoders (``LayerNormPosition``): "pre"
    (pre-LayerNorm, final LayerNorm; Hugging Face ``RobertaPreLayerNorm``) or "post" (BERT /
    ELECTRA post-LayerNorm with a one-row token-type embedding; Hugging Face ``ElectraModel``).
    """

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

    def shares_embedding_layer(self) -> bool:
        """Whether the sharing reaches past the token table: ES or GDES with scope "embeddings"
        and absolute positions (``model/sharing.py`` says what each mode shares)."""
        return (self.sharing is not Sharing.NES
                and self.sharing_scope is SharingScope.EMBEDDINGS
                and AttentionType(self.attention_type).absolute_positions)

    def validate(self) -> None:
        self.sharing = Sharing(self.sharing)
        try:
            self.sharing_scope = SharingScope(self.sharing_scope)
        except ValueError:
            raise ConfigError(f"model.sharing_scope (--sharing-scope) {self.sharing_scope!r}: "
                              f"choose {' or '.join(repr(s.value) for s in SharingScope)}"
                              ) from None
        try:
            self.layernorm_position = LayerNormPosition(self.layernorm_position)
        except ValueError:
            raise ConfigError(f"--layernorm-position {self.layernorm_position!r}: choose "
                              "'pre' or 'post'") from None
        try:
            self.attention_type = AttentionType(self.attention_type)
        except ValueError:
            raise ConfigError(f"--attention-type {self.attention_type!r}: choose "
                              f"{' or '.join(repr(a.value) for a in AttentionType)}") from None
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
        if self.position_buckets == 0 or self.position_buckets < -1:
            raise ConfigError(f"model.position_buckets must be > 0 or -1 (no buckets), got "
                              f"{self.position_buckets}; DeBERTaV3 uses 256")
        if self.max_relative_positions == 0 or self.max_relative_positions < -1:
            raise ConfigError(f"model.max_relative_positions must be > 0 or -1 "
                              f"(= max_position_embeddings), got {self.max_relative_positions}")
        _positive("model", vocab_size=self.vocab_size, embedding_size=self.embedding_size,
                  max_position_embeddings=self.max_position_embeddings,
                  init_method_std=self.init_method_std,
                  make_vocab_size_divisible_by=self.make_vocab_size_divisible_by)
        # the discriminator first: Megatron's flags set it, and the generator follows it
        self.discriminator.validate("model.discriminator")
        self.generator.validate("model.generator")

    def local_layer(self, layer_number: int) -> bool:
        """Whether the layer ``layer_number`` (1-based, megatron-core's) attends within the
        sliding window: the modern block's layers but every ``global_attn_every_n_layers``-th,
        counted from layer 1 (Hugging Face ``ModernBertAttention``: local unless
        layer_id % global_attn_every_n_layers == 0)."""
        return (AttentionType(self.attention_type).rotary and self.window_size > 0
                and (layer_number - 1) % self.global_attn_every_n_layers != 0)

    def _validate_block(self) -> None:
        """The modern block's fields (``attention_type`` "rotary"): their values, and that they
        keep their defaults in the other layouts, which build none of them."""
        try:
            self.mlp_activation = MLPActivation(self.mlp_activation)
        except ValueError:
            raise ConfigError(f"model.mlp_activation {self.mlp_activation!r}: choose "
                              f"{' or '.join(repr(a.value) for a in MLPActivation)}") from None
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError(f"model.normalization {self.normalization!r}: choose "
                              f"{' or '.join(NORMALIZATIONS)}")
        _positive("model", rotary_base=self.rotary_base,
                  local_rotary_base=self.local_rotary_base,
                  global_attn_every_n_layers=self.global_attn_every_n_layers)
        if self.window_size == 0 or self.window_size < -1:
            raise ConfigError(f"model.window_size must be > 0 or -1 (every layer global), got "
                              f"{self.window_size}; ModernBERT uses 128")
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
            raise ConfigError(f"model.{name} {value!r} belongs to the modern block; add "
                              f"--position-embedding-type rope, or leave it at {was!r} for "
                              f"{self.attention_type.value} attention")


class MaskStrategy(str, enum.Enum):
    """What the masking selects (``--mask-strategy``; ``objectives/masking.py``).

    TOKEN: single tokens (BERT, ELECTRA, DeBERTaV3). WHOLE_WORD: every token of a word together
    (BERT's whole-word masking, words from the tokenizer's word-start pieces). SPAN: runs of
    whole words with truncated-geometric lengths (SpanBERT, arXiv 1907.10529 §3.1).
    """

    TOKEN = "token"
    WHOLE_WORD = "whole_word"
    SPAN = "span"


@dataclass(kw_only=True)
class RTDConfig:
    """The objective (arXiv 2111.09543 §3.1)."""

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

    def validate(self) -> None:
        try:
            self.mask_strategy = MaskStrategy(self.mask_strategy)
        except ValueError:
            raise ConfigError(f"--mask-strategy {self.mask_strategy!r}: choose "
                              f"{', '.join(s.value for s in MaskStrategy)}") from None
        if not 0 < self.span_geometric_p <= 1:
            raise ConfigError(f"rtd.span_geometric_p must be in (0, 1], got {self.span_geometric_p}; "
                              "SpanBERT uses 0.2")
        if self.span_max_words < 1:
            raise ConfigError(f"rtd.span_max_words must be >= 1, got {self.span_max_words}; "
                              "SpanBERT uses 10")
        _positive("rtd", temperature=self.temperature)
        if self.rtd_lambda < 0:
            raise ConfigError(f"rtd.rtd_lambda must be >= 0, got {self.rtd_lambda}")
        _probability("rtd", mask_prob=self.mask_prob, mask_token_prob=self.mask_token_prob,
                     random_token_prob=self.random_token_prob)
        if self.mask_prob == 0:
            raise ConfigError("rtd.mask_prob must be > 0 (nothing would be masked); e.g. 0.15")
        if self.mask_token_prob + self.random_token_prob > 1.0 + 1e-9:
            raise ConfigError(
                "rtd.mask_token_prob + rtd.random_token_prob must be <= 1, got "
                f"{self.mask_token_prob} + {self.random_token_prob}")


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
class DataConfig:
    """Data, packing and loading (Megatron-LM's flag names; rtd_scale/data/*.py)."""

    # --data-path as typed: shard or dataset prefixes (one dataset, concatenated), or
    # WEIGHT PREFIX pairs (a blend, weights normalised), e.g. ["0.7", "A", "0.3", "B"]
    data_path: list[str] = field(default_factory=list)
    # --valid-data-path / --test-data-path (Megatron-LM's): held-out corpora in --data-path's
    # syntax, each read whole as the validation / test split (none: that split of data_path)
    valid_data_path: list[str] = field(default_factory=list)
    test_data_path: list[str] = field(default_factory=list)
    tokenizer_model: Optional[str] = None
    seq_length: int = 512
    split: str = "969,30,1"  # train,valid,test document shares of each dataset (Megatron-LM)
    data_cache_path: Optional[str] = None  # sample-index cache; default index-cache/ by the shards
    num_workers: int = 2  # DataLoader worker processes per rank (Megatron-LM's default)
    prefetch_factor: int = 2  # micro-batches read ahead per worker (with num_workers > 0)
    # document-masked packing (--reset-attention-mask): attention never crosses a document
    # boundary inside a packed sample and positions restart at each document (Megatron-LM's
    # --reset-attention-mask and --reset-position-ids, one switch here); the samples, their
    # order and their masks are the same either way (data/packed.py, model/document_mask.py).
    # A preset whose layout packs this way sets it.
    document_masking: bool = False

    def split_weights(self) -> tuple[float, float, float]:
        """``split`` as three non-negative floats (missing trailing shares are 0)."""
        try:
            w = [float(x) for x in self.split.replace("/", ",").split(",") if x.strip()]
        except ValueError:
            w = []
        if not 1 <= len(w) <= 3 or min(w) < 0 or w[0] <= 0 or not all(math.isfinite(x) for x in w):
            raise ConfigError(f"--split {self.split!r}: expected up to three non-negative "
                              "train,valid,test shares with a positive train share, e.g. 969,30,1")
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
            raise ConfigError(f"data.seq_length must be >= 3 ([CLS] x [SEP]), got {self.seq_length}")
        if self.seq_length > model.max_position_embeddings:
            raise ConfigError(
                f"--seq-length {self.seq_length} exceeds model.max_position_embeddings "
                f"{model.max_position_embeddings}; lower --seq-length or raise "
                "model.max_position_embeddings")
        self.split_weights()
        self.sources()
        self.valid_sources()
        self.test_sources()
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must be >= 0 (0: load in the training process), "
                              f"got {self.num_workers}")
        if self.prefetch_factor < 1:
            raise ConfigError(f"data.prefetch_factor must be >= 1, got {self.prefetch_factor}")


@dataclass(kw_only=True)
class ParallelConfig:
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
                fits = ", ".join(map(str, _divisors(*layers)))
                raise ConfigError(
                    f"model.{name}.num_layers ({enc.num_layers}) cannot be divided evenly over "
                    f"--pipeline-model-parallel-size {pp} (both models are split over the same "
                    f"stages); use a pipeline size that divides both layer counts "
                    f"({' and '.join(map(str, layers))}): {fits}")
        tp = self.tensor_model_parallel_size
        split = [v for _, enc in encoders for v in (enc.num_attention_heads, enc.ffn_hidden_size)]
        for name, enc in encoders:
            for what, v in (("num_attention_heads", enc.num_attention_heads),
                            ("ffn_hidden_size", enc.ffn_hidden_size)):
                if v % tp:
                    raise ConfigError(
                        f"model.{name}.{what} ({v}) must be divisible by "
                        f"--tensor-model-parallel-size ({tp}); the sizes that divide both "
                        f"models' head counts and FFN sizes: "
                        f"{', '.join(map(str, _divisors(*split)))}")


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
class OptimConfig:
    """AdamW and megatron-core's learning-rate schedule (``training/lr_schedule.py``): warm-up
    from ``lr_warmup_init`` to ``lr``, then ``lr_decay_style`` down to ``min_lr`` (linear by
    default, arXiv 2111.09543 Table 10). Lengths are Megatron-LM's: ``*_iters`` in optimizer
    steps, ``*_samples`` in samples, ``lr_warmup_fraction`` of the decay length."""

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
            raise ConfigError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        if self.lr_decay_iters is not None and self.lr_decay_iters < self.lr_warmup_iters:
            raise ConfigError(
                f"--lr-decay-iters ({self.lr_decay_iters}) must be >= --lr-warmup-iters "
                f"({self.lr_warmup_iters})")
        self._validate_schedule()
        if self.clip_grad < 0:
            raise ConfigError(f"--clip-grad must be >= 0 (0 disables), got {self.clip_grad}")
        _probability("optim", adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2)
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt_param-scheduler and "
                              "--use-checkpoint-opt_param-scheduler contradict each other; "
                              "pass one of them")

    def _validate_schedule(self) -> None:
        for flag, kind, attr in (("--lr-decay-style", LRDecayStyle, "lr_decay_style"),
                                 ("--lr-wsd-decay-style", WSDDecayStyle, "lr_wsd_decay_style")):
            try:
                setattr(self, attr, kind(getattr(self, attr)))
            except ValueError:
                choices = ", ".join(e.value for e in kind)
                raise ConfigError(f"{flag} {getattr(self, attr)!r}: choose one of "
                                  f"{choices}") from None
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
            raise ConfigError(f"--lr-warmup-fraction must be in [0, 1), got "
                              f"{self.lr_warmup_fraction}")
        for flag, v in (("--lr-warmup-samples", self.lr_warmup_samples),
                        ("--lr-decay-samples", self.lr_decay_samples),
                        ("--lr-wsd-decay-iters", self.lr_wsd_decay_iters),
                        ("--lr-wsd-decay-samples", self.lr_wsd_decay_samples)):
            if v is not None and v < 0:
                raise ConfigError(f"{flag} must be >= 0, got {v}")
        if self.lr_decay_samples == 0:
            raise ConfigError("--lr-decay-samples must be > 0; omit it to decay over the run")
        if not 0.0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"--lr-warmup-init must be in [0, --lr {self.lr}], got "
                              f"{self.lr_warmup_init}")
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
class TrainConfig:
    train_iters: int = 1000  # optimizer steps
    micro_batch_size: int = 8  # samples per rank per forward
    global_batch_size: int = 8  # samples per optimizer step, all data-parallel ranks
    precision: Precision = Precision.FP32
    seed: int = 1234
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: int = 0  # steps; 0: only at the end
    log_interval: int = 10
    # per-phase timers in the log line and TensorBoard (training/timers.py), Megatron-LM's
    # --timing-log-level: 0 none, 1 coarse (data, forward, backward, step), 2 fine (+ the
    # forward's mask, generator forward, sample, discriminator forward)
    timing_log_level: int = 0
    tensorboard_dir: Optional[str] = None
    ds_config: Optional[str] = None
    export: Optional[str] = None  # consolidated TP-agnostic weights written after the last step
    # Hugging Face export directory written after the last step (rtd_scale/hf/export.py)
    export_hf: Optional[str] = None
    # weights only (optimizer and schedule start fresh), any TP/PP/DP layout: an export
    # directory, a Hugging Face directory of an export target (rtd_scale/hf/adapters.py) or an
    # --export .pt file (rtd_scale/hf/pretrained.py)
    pretrained_checkpoint: Optional[str] = None
    eval_interval: int = 1000  # steps between validations (Megatron-LM's default); 0: never
    eval_iters: int = 100  # global batches per validation; 0: never validate
    data_digest: Optional[str] = None  # audit: per-step jsonl of sample ids, mask and loss hashes
    # analysis: each validation's original ids, masks, corrupted ids and discriminator logits,
    # one torch.save file per evaluation and data-parallel rank (training/loop.py evaluate)
    eval_dump_dir: Optional[str] = None
    # stop after this many iterations in a row with a non-finite loss or gradient norm (each
    # is skipped); checked at the log interval and before a save; 0: never stop
    max_consecutive_nonfinite_iters: int = 5
    # loss spikes (training/spikes.py): a step whose L_MLM or L_RTD exceeds its median over the
    # last loss_spike_window_iters steps by more than loss_spike_threshold robust standard
    # deviations of the logarithm and by more than loss_spike_min_rise of the median
    loss_spike_policy: LossSpikePolicy = LossSpikePolicy.ROLLBACK
    loss_spike_window_iters: int = 100
    loss_spike_threshold: float = 6.0
    loss_spike_min_rise: float = 0.1
    # rollbacks in the whole run (kept in the checkpoints) after which a spike stops it
    max_loss_spike_rollbacks: int = 5
    # a device's peak TFLOP/s, MFU's denominator in the log (--peak-tflops-per-device or
    # --device-peak); None: the GPU's bf16 dense datasheet value when its name is known
    peak_tflops_per_device: Optional[float] = None
    # with --load: accept another --seed than the checkpoint's, or other training data than it
    # was trained on; the data order (and masks, sampling noise) start anew at the resumed
    # sample (training/checkpoint/compat.py, check_compatible and check_same_data)
    override_data_order: bool = False

    @property
    def evaluates(self) -> bool:
        return self.eval_interval > 0 and self.eval_iters > 0

    def validate(self) -> None:
        self.precision = Precision(self.precision)
        _positive("train", train_iters=self.train_iters, micro_batch_size=self.micro_batch_size,
                  global_batch_size=self.global_batch_size, log_interval=self.log_interval)
        if self.timing_log_level not in (0, 1, 2):
            raise ConfigError("--timing-log-level must be 0 (no timers), 1 (data wait, forward, "
                              "backward, optimizer step) or 2 (also the forward's phases), got "
                              f"{self.timing_log_level!r}")
        if self.save_interval < 0:
            raise ConfigError(f"--save-interval must be >= 0, got {self.save_interval}")
        if self.max_consecutive_nonfinite_iters < 0:
            raise ConfigError("--max-consecutive-nonfinite-iters must be >= 0 (0: never stop), "
                              f"got {self.max_consecutive_nonfinite_iters}")
        self.loss_spike_policy = LossSpikePolicy(self.loss_spike_policy)
        if self.loss_spike_window_iters < 10:
            raise ConfigError("--loss-spike-window-iters must be >= 10 (the iterations a spike "
                              "is measured against; the spread of fewer is no estimate), got "
                              f"{self.loss_spike_window_iters}")
        if not self.loss_spike_threshold > 0 or not self.loss_spike_min_rise >= 0:
            raise ConfigError("--loss-spike-threshold must be > 0 (robust standard deviations) "
                              "and train.loss_spike_min_rise >= 0 (a fraction of the median), "
                              f"got {self.loss_spike_threshold} and {self.loss_spike_min_rise}")
        if self.max_loss_spike_rollbacks < 0:
            raise ConfigError("--max-loss-spike-rollbacks must be >= 0 (0: the first spike "
                              f"stops the run), got {self.max_loss_spike_rollbacks}")
        if self.peak_tflops_per_device is not None and not self.peak_tflops_per_device > 0:
            raise ConfigError("--peak-tflops-per-device must be > 0 (TFLOP/s of one device), "
                              f"got {self.peak_tflops_per_device}")
        if self.eval_interval < 0 or self.eval_iters < 0:
            raise ConfigError(f"--eval-interval and --eval-iters must be >= 0 (0 disables "
                              f"validation), got {self.eval_interval} and {self.eval_iters}")


@dataclass(kw_only=True)
class MonitorConfig:
    """Weights & Biases and the step profiler, with Megatron-LM's flags (``--wandb-*``,
    ``--profile*``; defaults as in its ``megatron/training/arguments.py``)."""

    wandb_project: Optional[str] = None  # log to W&B (from the logging rank) when set
    wandb_exp_name: Optional[str] = None  # the W&B run's name; None: W&B picks one
    wandb_entity: Optional[str] = None  # team or user; None: W&B's default entity
    wandb_save_dir: Optional[str] = None  # W&B's local files; None: <save>/wandb
    profile: bool = False  # torch.profiler trace of iterations [profile_step_start, _end)
    profile_step_start: int = 10  # the first traced iteration (1-based, as in the log)
    profile_step_end: int = 12  # the iteration after the last traced one
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # global ranks traced
    # Python stacks and module names (nn.Module: Encoder_0, …) in the trace; ~100× larger
    # (268 MB for two tiny-preset CPU steps under ZeRO-3, tests/e2e/test_monitoring_launcher.py)
    profile_with_stack: bool = False

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
class FaultToleranceConfig:
    """The per-rank heartbeat and the straggler report (``training/heartbeat.py``,
    ``training/stragglers.py``). Budgets are seconds without a finished step before a rank is
    declared hung, one per section as in NVIDIA's resiliency extension (its ft_launcher's
    ``--ft-rank-section-timeouts setup:600,step:180,checkpointing:420``, NeMo's defaults):
    ``setup`` from the start of the training loop to the first finished step (and a validation),
    ``step`` between two steps, ``checkpointing`` for a save. None: derived while the run goes,
    ``safety_factor`` × the measured median step (or the longest save) with the floor below; 0:
    that budget is off."""

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
            raise ConfigError("--straggler-threshold must be in [0, 1) (a fraction of the "
                              f"median rank's speed; 0: name none), got {self.straggler_threshold}")


@dataclass(kw_only=True)
class RunConfig:
    """The whole tree. Builders get only their section."""

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

    def dumps_evaluations(self) -> bool:
        """Whether ``--eval-dump-dir`` is ever written: by a validation, or by the test
        evaluation after the last step (``--test-data-path`` with ``--eval-iters`` > 0, run
        even with ``--eval-interval 0``; training/loop.py)."""
        return self.train.evaluates or bool(self.train.eval_iters > 0 and self.data.test_data_path)

    def validate(self) -> None:
        self.model.validate()
        self.rtd.validate()
        self.data.validate(self.model)
        self.parallel.validate(self.model)
        self.optim.validate()
        self.train.validate()
        self.monitor.validate(self.train.train_iters)
        self.fault_tolerance.validate()
        train = self.train
        if train.eval_dump_dir and not self.dumps_evaluations():
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

    def batch_arithmetic(self, world_size: int) -> tuple[int, int]:
        """(data_parallel_size, gradient_accumulation_steps) for ``world_size`` ranks
        (:func:`batch_layout` with pretrain.py's flag names).

        Raises:
            ConfigError: naming the flags, when the numbers do not divide.
        """
        return batch_layout(world_size, self.train.global_batch_size,
                            self.train.micro_batch_size,
                            tp=self.parallel.tensor_model_parallel_size,
                            pp=self.parallel.pipeline_model_parallel_size)

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
        ``rtd_meta.json``): its preset, then every recorded field, validated (fields this
        version does not know are ignored)."""
        cfg = preset(d.get("preset", "tiny"))

        def fill(obj: Any, values: dict[str, Any]) -> None:
            for f in dataclasses.fields(obj):
                if f.name not in values:
                    continue
                current, value = getattr(obj, f.name), values[f.name]
                if dataclasses.is_dataclass(current) and isinstance(value, dict):
                    fill(current, value)
                elif isinstance(current, enum.Enum):
                    setattr(obj, f.name, type(current)(value))
                else:
                    setattr(obj, f.name, value)

        fill(cfg, d)
        cfg.validate()
        return cfg


@dataclass(frozen=True)
class BatchNames:
    """How :func:`batch_layout`'s errors name its numbers: a format per value ("{}" is the
    value), what a rank is called in the job as a whole and on one node, and what each error
    suggests changing."""

    global_batch: str = "--global-batch-size {}"
    micro_batch: str = "--micro-batch-size {}"
    tp: str = "--tensor-model-parallel-size {}"
    pp: str = "--pipeline-model-parallel-size {}"
    ranks: str = "ranks"
    ranks_per_node: str = "ranks"
    global_fix: str = "change --global-batch-size or the number of ranks"
    per_node_fix: str = ""


def batch_layout(world_size: int, global_batch: int, micro_batch: int, *, tp: int = 1,
                 pp: int = 1, ranks_per_node: Optional[int] = None,
                 names: BatchNames = BatchNames()) -> tuple[int, int]:
    """(data-parallel size, gradient-accumulation steps) of ``world_size`` ranks at
    tensor × pipeline parallel size ``tp`` × ``pp``: DP = world / (TP × PP) and
    global = micro × accumulation × DP. The one implementation of that arithmetic: pretrain.py
    (:meth:`RunConfig.batch_arithmetic`), the Slurm job before it starts its tasks
    (``python -m rtd_scale.launch_env batch-arithmetic``) and tools/estimate_cost.py; where DP
    is already known (the loader, the training loop, the resolved ds_config) the split is
    :func:`rank_share`'s.
    With ``ranks_per_node`` (a job of several nodes), TP must divide it too: megatron-core puts
    consecutive ranks in one TP group and Slurm numbers ranks node by node, so otherwise a TP
    group would span two nodes.

    Raises:
        ConfigError: one line, in ``names``' words, when the numbers do not divide, with the
            sizes that would.
    """
    mp = tp * pp
    tp_name = names.tp.format(tp)
    if world_size % mp:
        what = (f"{tp_name} (tensor-parallel size)" if pp == 1 else
                f"{tp_name} × {names.pp.format(pp)} (model-parallel size {mp})")
        raise ConfigError(f"{world_size} {names.ranks} are not divisible by {what}; launch a "
                          f"multiple of {mp} {names.ranks}")
    if ranks_per_node is not None and ranks_per_node % tp:
        raise ConfigError(f"{tp_name} does not divide the {ranks_per_node} "
                          f"{names.ranks_per_node} per node: tensor-parallel groups would span "
                          f"nodes{names.per_node_fix}")
    dp = world_size // mp
    model_parallel = f"TP {tp}" + (f" × PP {pp}" if pp > 1 else "")
    if global_batch % dp:
        fix = names.global_fix
        if ranks_per_node is not None and (ranks_per_node * 1024) % mp == 0:
            nodes = [n for n in range(1, 1025) if (n * ranks_per_node) % mp == 0
                     and global_batch % (n * ranks_per_node // mp) == 0][:8]
            fix += (f" (node counts that work at {ranks_per_node} {names.ranks_per_node} per "
                    f"node: {' '.join(map(str, nodes))})" if nodes else "")
        raise ConfigError(f"{names.global_batch.format(global_batch)} is not divisible by the "
                          f"data-parallel size {dp} (= {world_size} {names.ranks} / "
                          f"{model_parallel}): no micro-batch and accumulation give exactly "
                          f"{global_batch}; {fix}")
    per_rank = global_batch // dp
    if per_rank % micro_batch:
        raise ConfigError(f"{names.micro_batch.format(micro_batch)} does not divide the "
                          f"{per_rank} samples per data-parallel rank per step (global "
                          f"{global_batch} / DP {dp}); micro-batch sizes that do: "
                          f"{' '.join(map(str, _divisors(per_rank)))}")
    return dp, rank_share(global_batch, micro_batch, dp)[1]


def rank_share(global_batch: int, micro_batch: int, data_parallel_size: int) -> tuple[int, int]:
    """(samples, micro-batches) of one data-parallel rank in one optimizer step: its
    global / DP samples, run as global / (micro × DP) micro-batches — the gradient-accumulation
    steps. For numbers :func:`batch_layout` accepts (it explains, in the user's words, those
    that do not divide); anything else is a programming error.
    """
    per_rank, rest = divmod(global_batch, data_parallel_size)
    assert rest == 0 and per_rank % micro_batch == 0, (global_batch, micro_batch,
                                                       data_parallel_size)
    return per_rank, per_rank // micro_batch


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------

def _enc(layers: int, hidden: int, heads: int, **kw: Any) -> EncoderConfig:
    return EncoderConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         ffn_hidden_size=4 * hidden, **kw)


def _tiny() -> RunConfig:
    """CPU-sized: discriminator 4×96, generator 2×96 (DeBERTaV3 style: same width, half depth;
    both layer counts divide by 2, so it also runs at --pipeline-model-parallel-size 2)."""
    return RunConfig(
        preset="tiny",
        model=ModelConfig(vocab_size=8000, embedding_size=96, max_position_embeddings=128,
                          generator=_enc(2, 96, 2), discriminator=_enc(4, 96, 2)),
        # no loader workers: the tiny model steps faster than worker start-up pays back on CPU
        data=DataConfig(seq_length=128, num_workers=0),
        optim=OptimConfig(lr=1e-3, lr_warmup_iters=30),
        train=TrainConfig(train_iters=300, micro_batch_size=16, global_batch_size=32,
                          eval_interval=100, eval_iters=2),
    )


def _debertav3_tiny() -> RunConfig:
    """The main job's model (``tools/run_default.sh``): ``tiny``'s dimensions in DeBERTaV3's
    layout (disentangled attention, no absolute positions, post-LayerNorm, GDES), with 25% of
    tokens masked (ELECTRA-large's rate, arXiv 2003.10555 Table 6) and no dropout. Measured with
    ``bench/lever_study.py`` on the sample corpus (README, "What the main job shows"): BERT
    attention stays on the RTD plateau for 600 steps (held-out AUC 0.55); with disentangled
    attention the run leaves it, after about 400 steps at mask 0.15 and dropout 0.1, and by
    step 300 with both levers (0.65 and 0.69 for two seeds, 0.70 and 0.69 at step 600)."""
    cfg = _tiny()
    cfg.preset = "debertav3-tiny"
    cfg.model.layernorm_position = LayerNormPosition.POST
    cfg.model.attention_type = AttentionType.DISENTANGLED
    cfg.rtd.mask_prob = 0.25
    for enc in (cfg.model.generator, cfg.model.discriminator):
        enc.hidden_dropout = enc.attention_dropout = 0.0
    cfg.train.train_iters = 600
    return cfg


def _electra(size: str) -> RunConfig:
    """ELECTRA (arXiv 2003.10555 Table 6): generator narrower, embedding projected."""
    disc, gen, emb, mask_prob, seq = {
        # discriminator 12×256, embedding 128, generator 1/4 width
        "small": (_enc(12, 256, 4), _enc(12, 64, 1), 128, 0.15, 128),
        # 12×768, generator 1/3 width
        "base": (_enc(12, 768, 12), _enc(12, 256, 4), 768, 0.15, 512),
        # 24×1024, generator 1/4 width, mask 25%
        "large": (_enc(24, 1024, 16), _enc(24, 256, 4), 1024, 0.25, 512),
    }[size]
    # BERT's LayerNorm epsilon, kept by ELECTRA's code and Hugging Face's ElectraConfig
    disc, gen = (dataclasses.replace(e, layernorm_epsilon=1e-12) for e in (disc, gen))
    return RunConfig(
        preset=f"electra-{size}",
        # post-LayerNorm encoders, as BERT and ELECTRA (arXiv 2003.10555 §3.1)
        model=ModelConfig(vocab_size=30522, embedding_size=emb, max_position_embeddings=512,
                          generator=gen, discriminator=disc, sharing=Sharing.ES,
                          layernorm_position=LayerNormPosition.POST),
        rtd=RTDConfig(mask_prob=mask_prob, mask_token_prob=0.85, random_token_prob=0.0),
        data=DataConfig(seq_length=seq),
        optim=OptimConfig(lr={"small": 5e-4, "base": 2e-4, "large": 2e-4}[size],
                          lr_warmup_iters=10000, adam_beta2=0.999),
        train=TrainConfig(train_iters={"small": 1_000_000, "base": 766_000, "large": 400_000}[size],
                          micro_batch_size=32,
                          global_batch_size={"small": 128, "base": 256, "large": 2048}[size]),
    )


def _debertav3(size: str) -> RunConfig:
    """DeBERTaV3 (arXiv 2111.09543 §4, Table 10): generator same width, half depth, GDES."""
    disc = {
        "xsmall": _enc(12, 384, 6),
        "small": _enc(6, 768, 12),
        "base": _enc(12, 768, 12),
        "large": _enc(24, 1024, 16),
    }[size]
    gen = dataclasses.replace(disc, num_layers=disc.num_layers // 2)
    return RunConfig(
        preset=f"debertav3-{size}",
        # DeBERTaV3's released configs: disentangled attention (relative_attention, pos_att_type
        # p2c|c2p, position_buckets 256, share_att_key, norm_rel_ebd layer_norm), no absolute
        # position in the input, post-LayerNorm layers, LayerNorm epsilon 1e-7
        model=ModelConfig(vocab_size=128100, embedding_size=disc.hidden_size,
                          max_position_embeddings=512, generator=gen, discriminator=disc,
                          sharing=Sharing.GDES, layernorm_position=LayerNormPosition.POST,
                          attention_type=AttentionType.DISENTANGLED, position_buckets=256,
                          max_relative_positions=-1),
        data=DataConfig(seq_length=512),
        # peak lr of Table 10 (§4's prose gives base 5e-4; slurm/pretrain_base.sh offers it)
        # TODO(verify): arXiv 2111.09543 Table 10, each size's peak learning rate
        optim=OptimConfig(lr=3e-4 if size == "large" else 6e-4, lr_warmup_iters=10000),
        train=TrainConfig(train_iters=500_000, micro_batch_size=8, global_batch_size=8192),
    )


# -- the modern block (attention_type "rotary"; model/modern.py) -------------------------------

def _modern(cfg: RunConfig, window_size: int = 128) -> RunConfig:
    """``cfg`` with ModernBERT's block (arXiv 2412.13663 §2.1; Hugging Face ModernBertConfig of
    answerdotai/ModernBERT-base and -large): RoPE with bases 160,000 (global layers) and 10,000
    (local), a sliding window of ``window_size`` tokens in every layer but every third, GeGLU,
    no bias in any linear or norm, LayerNorm epsilon 1e-5, no dropout, pre-LayerNorm placed as
    ModernBERT (``model/modern.py``), and document-masked packing."""
    m = cfg.model
    m.layernorm_position, m.attention_type = LayerNormPosition.PRE, AttentionType.ROTARY
    m.rotary_base, m.local_rotary_base = 160_000.0, 10_000.0
    m.window_size, m.global_attn_every_n_layers = window_size, 3
    m.normalization, m.norm_bias, m.add_bias_linear = "LayerNorm", False, False
    m.mlp_activation = MLPActivation.GEGLU
    for enc in (m.generator, m.discriminator):
        enc.hidden_dropout = enc.attention_dropout = 0.0
        enc.layernorm_epsilon = 1e-5
    # no attention across documents, positions from 0 in each (ModernBERT §2.1.3 trains on
    # unpadded sequences; data/packed.py, model/document_mask.py)
    cfg.data.document_masking = True
    return cfg


def _modernbert_tiny() -> RunConfig:
    """``tiny``'s dimensions (discriminator 4×96, generator 2×96) in the modern block, FFN 1.5 ×
    width (ModernBERT-base's 1152 / 768) and a 32-token window, so that at ``tiny``'s 128 tokens
    the local layers (1 and 2 of the discriminator, 1 of the generator) see a quarter of it."""
    cfg = _tiny()
    cfg.preset = "modernbert-tiny"
    for enc in (cfg.model.generator, cfg.model.discriminator):
        enc.ffn_hidden_size = 144
    return _modern(cfg, window_size=32)


def _modernbert(size: str) -> RunConfig:
    """ModernBERT-base / -large's discriminator (arXiv 2412.13663 Table 4; 149M and 395M
    parameters with the embeddings), its 50,368-id vocabulary and 8,192 positions, pretrained
    at 1,024 tokens; the generator by DeBERTaV3's rule (half depth, same width, GDES), and
    DeBERTaV3's optimiser and schedule (the RTD recipe, ``_debertav3``)."""
    disc = {"base": EncoderConfig(num_layers=22, hidden_size=768, num_attention_heads=12,
                                  ffn_hidden_size=1152),
            "large": EncoderConfig(num_layers=28, hidden_size=1024, num_attention_heads=16,
                                   ffn_hidden_size=2624)}[size]
    cfg = _debertav3("large" if size == "large" else "base")
    cfg.preset = f"modernbert-{size}"
    cfg.model = ModelConfig(vocab_size=50368, embedding_size=disc.hidden_size,
                            max_position_embeddings=8192, generator=dataclasses.replace(
                                disc, num_layers=disc.num_layers // 2),
                            discriminator=disc, sharing=Sharing.GDES)
    cfg.data.seq_length = 1024
    return _modern(cfg)


MODERN_PRESETS: dict[str, Callable[[], RunConfig]] = {
    "modernbert-tiny": _modernbert_tiny,
    **{f"modernbert-{s}": (lambda s=s: _modernbert(s)) for s in ("base", "large")},
}

# ----------------------------------------------------------------------------------------------

PRESETS: dict[str, Callable[[], RunConfig]] = {
    "tiny": _tiny,
    "debertav3-tiny": _debertav3_tiny,
    **{f"electra-{s}": (lambda s=s: _electra(s)) for s in ("small", "base", "large")},
    **{f"debertav3-{s}": (lambda s=s: _debertav3(s)) for s in ("xsmall", "small", "base", "large")},
    **MODERN_PRESETS,
}


def preset(name: str) -> RunConfig:
    """A fresh config tree for a named preset.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is unknown; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]()


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
        return [x for x in raw.split(",") if x]
    return raw


def apply_override(cfg: RunConfig, assignment: str) -> None:
    """Apply one ``section.field=value`` override (``--set``), converting to the field's type.

    Raises:
        ValueError: malformed assignment, unknown field, or a value of the wrong type.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. rtd.mask_prob=0.2")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    obj: Any = cfg
    for p in parts[:-1]:
        if not dataclasses.is_dataclass(obj) or not hasattr(obj, p):
            raise ConfigError(f"--set {key}: no config section {p!r}")
        obj = getattr(obj, p)
    name = parts[-1]
    fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    if name not in fields:
        raise ConfigError(f"--set {key}: unknown field; known: {', '.join(fields) or 'none'}")
    kind = typing.get_type_hints(type(obj))[name]
    optional = type(None) in typing.get_args(kind)
    if optional:  # Optional[X]: the field's default may be None, so its type comes from X
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if optional and raw.strip().lower() == "none":
        setattr(obj, name, None)
        return
    try:
        value = _parse_value(kind, raw)
    except ValueError:
        what = f"a value of type {getattr(kind, '__name__', kind)}"
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            what = f"one of {', '.join(m.value for m in kind)}"
        elif kind is float:
            what = "a finite value of type float"
        current = getattr(obj, name)
        example = current.value if isinstance(current, enum.Enum) else current
        raise ConfigError(f"--set {key}={raw}: expected {what}"
                          + (" or none" if optional else "")
                          + (f", e.g. --set {key}={example}" if example is not None
                             else "")) from None
    setattr(obj, name, value)
