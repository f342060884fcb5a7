"""Megatron-LM's model and optimizer flags, with Megatron-LM's meaning, for the RTD pair.

A Megatron-LM user describes one encoder; here that encoder is the **discriminator** (the model
that is fine-tuned afterwards), and the generator is derived from it:

- ``--num-layers``, ``--hidden-size``, ``--num-attention-heads``, ``--ffn-hidden-size``,
  ``--hidden-dropout``, ``--attention-dropout``, ``--layernorm-epsilon`` set
  ``model.discriminator.*``. As in Megatron-LM (``megatron/training/arguments.py``), the FFN
  width defaults to 4 × ``--hidden-size`` when ``--hidden-size`` is given without
  ``--ffn-hidden-size``, and the token-embedding width is the hidden size unless
  ``--embedding-size`` (ELECTRA's ``embedding_size``, arXiv 2003.10555 §3.2) says otherwise.
- ``--max-position-embeddings``, ``--init-method-std``, ``--make-vocab-size-divisible-by`` set
  the ``model.*`` field of the same name (both encoders); ``--adam-beta1``, ``--adam-beta2``,
  ``--adam-eps`` set ``optim.*``.
- The generator: every encoder flag has a ``--generator-`` twin that sets the generator's field
  outright. Without it, a generator field follows the discriminator flags that were given, the
  way ELECTRA's ``get_generator_config`` builds its generator (arXiv 2003.10555 §3.2, Table 6):
  its depth and width are the discriminator's × ``--generator-num-layers-ratio`` /
  ``--generator-hidden-size-ratio`` (default: the preset's own ratios, e.g. 1/2 depth for
  DeBERTaV3, 1/4 width for ELECTRA-small), rounded to the nearest integer; its heads keep the
  discriminator's head size (hidden / heads, ELECTRA's 64: ``max(1, width // head size)``, or
  the largest count below that divides the width); its FFN is 4 × its width; dropouts and
  LayerNorm epsilon are the discriminator's. A field no flag touches keeps the preset's value.

Precedence: preset → these flags → ``--set section.field=value``. A few Megatron-LM flags
describe an architecture or schedule this system does not build; each is refused in one line
saying why (``REFUSED``), rather than as an argparse "unrecognized argument".
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Optional

from rtd_scale.config import ConfigError, RunConfig

# Encoder fields with a discriminator flag and a --generator- twin: field → (type, help).
ENCODER_FIELDS: dict[str, tuple[type, str]] = {
    "num_layers": (int, "transformer layers"),
    "hidden_size": (int, "hidden size H (also the embedding width unless --embedding-size)"),
    "num_attention_heads": (int, "attention heads"),
    "ffn_hidden_size": (int, "FFN inner size (default 4 × hidden size)"),
    "hidden_dropout": (float, "dropout on embeddings and residual branches"),
    "attention_dropout": (float, "dropout on attention probabilities"),
    "layernorm_epsilon": (float, "LayerNorm epsilon"),
}

# The modern block's fields with a flag of the same name (--position-embedding-type rope;
# config.ModelConfig, model/modern.py), in SECTION_FIELDS' form.
MODERN_BLOCK_FIELDS: dict[str, tuple[str, str, type, str]] = {
    name: ("model", name, kind, text) for name, kind, text in (
        ("rotary_base", float, "RoPE base of the global layers (Megatron-LM's; Hugging Face "
         "ModernBERT's global_rope_theta; modernbert-* 160000)"),
        ("local_rotary_base", float, "RoPE base of the sliding-window layers (ModernBERT's "
         "local_rope_theta; modernbert-* 10000)"),
        ("global_attn_every_n_layers", int, "with --window-size: layer i (0-based) attends "
         "globally when i %% N == 0, the others within the window (ModernBERT's "
         "global_attn_every_n_layers; modernbert-* 3)"),
        ("normalization", str, "LayerNorm or RMSNorm: every norm of the modern block (others: "
         "LayerNorm)"))}

# Flags that set one field of the tree: dest → (section, field, type, help).
SECTION_FIELDS: dict[str, tuple[str, str, type, str]] = {
    "embedding_size": ("model", "embedding_size", int,
                       "token-embedding width E (ELECTRA's name); each encoder projects E to its "
                       "hidden size when they differ. Default: --hidden-size when given, else "
                       "the preset's"),
    "max_position_embeddings": ("model", "max_position_embeddings", int,
                                "learned absolute positions, both encoders (>= --seq-length)"),
    "init_method_std": ("model", "init_method_std", float,
                        "std of the N(0, std²) initialisation, both encoders"),
    "make_vocab_size_divisible_by": ("model", "make_vocab_size_divisible_by", int,
                                     "pad the vocabulary to a multiple of this × "
                                     "tensor-parallel size (default 128)"),
    **MODERN_BLOCK_FIELDS,
    "adam_beta1": ("optim", "adam_beta1", float, "AdamW β1"),
    "adam_beta2": ("optim", "adam_beta2", float, "AdamW β2"),
    "adam_eps": ("optim", "adam_eps", float, "AdamW ε"),
}

def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


# The fields these flags set, for arguments.FLAG_FIELDS (the one table of flags and fields).
FLAG_FIELDS: dict[str, str] = {
    **{_flag(name): f"model.discriminator.{name}" for name in ENCODER_FIELDS},
    **{_flag("generator_" + name): f"model.generator.{name}" for name in ENCODER_FIELDS},
    **{_flag(dest): f"{section}.{name}" for dest, (section, name, _, _) in SECTION_FIELDS.items()},
}

# --tokenizer-type values → the file kind rtd_scale.data.tokenizer.Tokenizer reads (chosen by
# the file name: *.json a tokenizer.json, *.txt a WordPiece vocab.txt, else SentencePiece).
TOKENIZER_TYPES: dict[str, str] = {
    "SentencePieceTokenizer": "sentencepiece", "GPTSentencePieceTokenizer": "sentencepiece",
    "HuggingFaceTokenizer": "tokenizer.json",
    "BertWordPieceLowerCase": "vocab.txt", "BertWordPieceCase": "vocab.txt",
}


def _tokenizer_kind(path: str) -> str:
    return ("tokenizer.json" if path.endswith(".json") else
            "vocab.txt" if path.endswith(".txt") else "sentencepiece")


# Generator ratio flags: dest → the encoder field they scale.
RATIO_FLAGS: dict[str, str] = {
    "generator_num_layers_ratio": "num_layers",
    "generator_hidden_size_ratio": "hidden_size",
}


@dataclass(frozen=True)
class Refusal:
    """A Megatron-LM flag we do not take: its spellings, how many values it takes, a value
    that is accepted as a no-op (None: every use is refused), and why."""

    flags: tuple[str, ...]
    nargs: int
    reason: str
    accepted: Optional[str] = None


REFUSED: tuple[Refusal, ...] = (
    Refusal(("--untie-embeddings-and-output-weights",), 0,
            "the generator's MLM head is tied to its token table (ELECTRA, DeBERTaV3); drop "
            "the flag"),
    Refusal(("--group-query-attention",), 0,
            "both encoders use multi-head attention (one key/value head per query head); drop "
            "the flag"),
    Refusal(("--num-query-groups",), 1,
            "both encoders use multi-head attention (one key/value head per query head); drop "
            "the flag"),
    Refusal(("--sequence-parallel",), 0,
            "sequence parallelism is not implemented; use --recompute-activations to save "
            "activation memory"),
    Refusal(("--num-layers-per-virtual-pipeline-stage", "--virtual-pipeline-model-parallel-size"), 1,
            "interleaved (virtual) pipeline schedules are not implemented: each pipeline rank "
            "holds one stage of both encoders; use --pipeline-model-parallel-size alone"),
    Refusal(("--context-parallel-size",), 1,
            "context parallelism is not implemented; use tensor or pipeline parallelism",
            accepted="1"),
)


class _Refuse(argparse.Action):
    """Records a refused flag; ``apply_model_args`` raises it as one line (parsing itself
    would print argparse's usage block, and ``main`` handles errors only after parsing)."""

    def __init__(self, option_strings, dest, refusal: Refusal, **kw):
        self.refusal = refusal
        super().__init__(option_strings, dest, nargs=refusal.nargs, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        value = values[0] if values else None
        if value is not None and value == self.refusal.accepted:
            return
        shown = f"{option_string} {value}" if value is not None else option_string
        found = list(getattr(namespace, "megatron_refused", None) or [])
        found.append(f"{shown}: not supported: {self.refusal.reason}"
                     + (f" (or pass {option_string} {self.refusal.accepted})"
                        if self.refusal.accepted else ""))
        setattr(namespace, "megatron_refused", found)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Add Megatron-LM's model and optimizer flags, their ``--generator-`` twins, the ratio
    flags, Megatron-DeepSpeed's no-op ``--deepspeed``, and the refused flags to ``parser``."""
    g = parser.add_argument_group(
        "Megatron-LM model flags (the discriminator; the generator follows at the preset's "
        "ratios unless a --generator- flag says otherwise)")
    for name, (kind, text) in ENCODER_FIELDS.items():
        g.add_argument(_flag(name), type=kind, help=f"discriminator: {text}")
    for dest, (_, _, kind, text) in SECTION_FIELDS.items():
        g.add_argument(_flag(dest), type=kind, help=text)
    for name, (kind, text) in ENCODER_FIELDS.items():
        g.add_argument(_flag("generator_" + name), type=kind, help=f"generator: {text}")
    g.add_argument("--generator-num-layers-ratio", type=float, metavar="R",
                   help="generator layers = round(R × discriminator layers) (ELECTRA's "
                        "generator_layers; default: the preset's ratio)")
    g.add_argument("--generator-hidden-size-ratio", type=float, metavar="R",
                   help="generator hidden size = round(R × discriminator hidden size) "
                        "(ELECTRA's generator_hidden_size; default: the preset's ratio)")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope"],
                   help="rope: the modern block (ModernBERT: rotary positions, no position "
                        "table, pre-LayerNorm; the same as --attention-type rotary); "
                        "learned_absolute: BERT / ELECTRA's table (from a rotary preset: "
                        "--attention-type bert; otherwise the preset's attention is kept)")
    for flag, text in (
            ("--use-rotary-position-embeddings",
             "Megatron-LM's older spelling of --position-embedding-type rope"),
            ("--swiglu", "the modern block's FFN as SwiGLU (SiLU-gated); its default, GeGLU, "
                         "is --set model.mlp_activation=geglu"),
            ("--disable-bias-linear", "no bias in the attention and FFN linears (the modern "
                                      "block; modernbert-* already)")):
        g.add_argument(flag, action="store_true", help=text)
    g.add_argument("--window-size", metavar="N | LEFT,RIGHT",
                   help="sliding-window attention of the modern block: N tokens (query i sees "
                        "keys |i - j| <= N // 2; ModernBERT's local_attention 128), or "
                        "Megatron-LM's LEFT,RIGHT with LEFT = RIGHT (64,64 is 128); -1: every "
                        "layer global")
    g.add_argument("--deepspeed", action="store_true",
                   help="accepted for Megatron-DeepSpeed's `--deepspeed --deepspeed_config X`; "
                        "DeepSpeed always runs")
    g.add_argument("--vocab-file", metavar="VOCAB_TXT",
                   help="Megatron-LM's name for a WordPiece vocab.txt: the same as "
                        "--tokenizer-model VOCAB_TXT")
    g.add_argument("--tokenizer-type", choices=sorted(TOKENIZER_TYPES),
                   help="checked against the tokenizer file (the kind is read from its name); "
                        "a WordPiece vocab.txt lower-cases when it has no upper-case token, "
                        "whichever BertWordPiece type is named")
    g.add_argument("--bert-no-binary-head", action="store_true",
                   help="accepted for Megatron-LM's pretrain_bert.py: RTD has no "
                        "sentence-pair head")
    for r in REFUSED:
        g.add_argument(*r.flags, action=_Refuse, refusal=r, dest="megatron_refused",
                       default=None, help=argparse.SUPPRESS)


def _window_size(value: str) -> int:
    """``--window-size`` N or LEFT,RIGHT (Megatron-LM's tuple, LEFT = RIGHT) as N.

    Raises:
        ConfigError: neither form, or an asymmetric window.
    """
    parts = value.replace(" ", "").split(",")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        numbers = []
    if len(numbers) == 1:
        return numbers[0]
    if len(numbers) == 2 and numbers[0] == numbers[1] and numbers[0] > 0:
        return 2 * numbers[0]
    raise ConfigError(f"--window-size {value}: expected N (tokens, e.g. 128) or LEFT,RIGHT with "
                      "LEFT = RIGHT > 0 (e.g. 64,64): an encoder's window is symmetric")


def _apply_block_args(model, args: argparse.Namespace) -> dict[str, str]:
    """The modern block's flags without a field of their own: the positions, --swiglu,
    --disable-bias-linear and --window-size. Returns the fields they set → the flag."""
    from rtd_scale.config import AttentionType, MLPActivation

    origins: dict[str, str] = {}
    kind = getattr(args, "position_embedding_type", None)
    if getattr(args, "use_rotary_position_embeddings", False):
        if kind == "learned_absolute":
            raise ConfigError("--use-rotary-position-embeddings and --position-embedding-type "
                              "learned_absolute contradict each other; pass one of them")
        kind = "rope"
    if kind == "rope":
        model.attention_type = AttentionType.ROTARY
        origins["model.attention_type"] = "--position-embedding-type rope"
    elif kind == "learned_absolute" and model.attention_type.rotary:
        model.attention_type = AttentionType.BERT
        origins["model.attention_type"] = "--position-embedding-type learned_absolute"
    if getattr(args, "swiglu", False):
        model.mlp_activation = MLPActivation.SWIGLU
        origins["model.mlp_activation"] = "--swiglu"
    if getattr(args, "disable_bias_linear", False):
        model.add_bias_linear = False
        origins["model.add_bias_linear"] = "--disable-bias-linear"
    if getattr(args, "window_size", None) is not None:
        model.window_size = _window_size(args.window_size)
        origins["model.window_size"] = "--window-size"
    return origins


def _given(args: argparse.Namespace, dest: str) -> bool:
    return getattr(args, dest, None) is not None


def _scaled(value: int, ratio: float, field: str) -> int:
    """The generator's ``field``: round(ratio × the discriminator's ``value``) (ELECTRA's
    ``int(round(·))``).

    Raises:
        ConfigError: the result is below 1.
    """
    out = int(round(value * ratio))
    if out < 1:
        ratio_flag = next(d for d, f in RATIO_FLAGS.items() if f == field)
        raise ConfigError(f"model.generator.{field} would be {out} (round({ratio:g} × {value})); "
                          f"pass {_flag('generator_' + field)} or a larger {_flag(ratio_flag)}")
    return out


def apply_model_args(cfg: RunConfig, args: argparse.Namespace) -> dict[str, str]:
    """Apply the flags of :func:`add_model_args` to ``cfg`` (a preset), in place, before the
    ``--set`` overrides. The rules are the module docstring's.

    Returns:
        Which flag set each config field it changed (``"model.generator.hidden_dropout"`` →
        ``"--hidden-dropout"``), for ``config.ConfigError.naming``.

    Raises:
        ConfigError: a refused flag, a twin given together with its ratio flag, or a ratio that
            is not a finite positive number or leaves the generator less than one layer / unit.
    """
    refused = getattr(args, "megatron_refused", None)
    if refused:
        raise ConfigError(refused[0])
    vocab_file = getattr(args, "vocab_file", None)
    if vocab_file is not None:
        if getattr(args, "tokenizer_model", None) not in (None, vocab_file):
            raise ConfigError(f"--vocab-file {vocab_file} and --tokenizer-model "
                              f"{args.tokenizer_model} name two tokenizers; pass one of them")
        cfg.data.tokenizer_model = vocab_file
    kind = getattr(args, "tokenizer_type", None)
    if kind is not None and cfg.data.tokenizer_model:
        found = _tokenizer_kind(cfg.data.tokenizer_model)
        if found != TOKENIZER_TYPES[kind]:
            fits = sorted(t for t, k in TOKENIZER_TYPES.items() if k == found)
            raise ConfigError(f"--tokenizer-type {kind} does not fit {cfg.data.tokenizer_model} "
                              f"(a {found} file); pass --tokenizer-type {' or '.join(fits)}, or "
                              "the tokenizer file it names")
    model = cfg.model
    disc, gen = model.discriminator, model.generator
    origins: dict[str, str] = _apply_block_args(model, args)
    ratio: dict[str, float] = {
        "num_layers": gen.num_layers / disc.num_layers,
        "hidden_size": gen.hidden_size / disc.hidden_size,
    }
    for dest, field in RATIO_FLAGS.items():
        if not _given(args, dest):
            continue
        value = getattr(args, dest)
        if _given(args, "generator_" + field):
            raise ConfigError(f"{_flag('generator_' + field)} and {_flag(dest)} both set the "
                              "generator's " + field.replace("_", " ") + "; pass one of them")
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{_flag(dest)} {value}: must be a positive number, e.g. 0.25")
        ratio[field] = value

    # the discriminator: Megatron-LM's flags, Megatron-LM's defaults for the FFN and embedding
    for name in ENCODER_FIELDS:
        if _given(args, name):
            setattr(disc, name, getattr(args, name))
            origins[f"model.discriminator.{name}"] = _flag(name)
    if _given(args, "hidden_size"):
        if not _given(args, "ffn_hidden_size"):
            disc.ffn_hidden_size = 4 * disc.hidden_size
            origins["model.discriminator.ffn_hidden_size"] = "--hidden-size"
        if not _given(args, "embedding_size"):
            model.embedding_size = disc.hidden_size
            origins["model.embedding_size"] = "--hidden-size"
    for dest, (section, name, _, _) in SECTION_FIELDS.items():
        if _given(args, dest):
            setattr(getattr(cfg, section), name, getattr(args, dest))
            origins[f"{section}.{name}"] = _flag(dest)

    # the generator: a twin wins; else derived from what was given for the discriminator
    for name in ("num_layers", "hidden_size", "num_attention_heads"):  # the rules divide by them
        if getattr(disc, name) < 1:
            raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(disc, name)}")

    def twin(name: str) -> Optional[Any]:
        return getattr(args, "generator_" + name, None)

    derived: dict[str, Any] = {}
    source: dict[str, str] = {}  # the flag each derived field comes from
    for name, dest in (("num_layers", "generator_num_layers_ratio"),
                       ("hidden_size", "generator_hidden_size_ratio")):
        if twin(name) is not None:
            derived[name], source[name] = twin(name), _flag("generator_" + name)
        elif _given(args, name) or _given(args, dest):
            derived[name] = _scaled(getattr(disc, name), ratio[name], name)
            source[name] = _flag(dest if _given(args, dest) else name)
    width_set = "hidden_size" in derived
    if twin("num_attention_heads") is not None:
        derived["num_attention_heads"] = twin("num_attention_heads")
        source["num_attention_heads"] = _flag("generator_num_attention_heads")
    elif width_set or _given(args, "num_attention_heads"):
        source["num_attention_heads"] = (_flag("num_attention_heads")
                                         if _given(args, "num_attention_heads")
                                         else source["hidden_size"])
        head_size = max(1, disc.hidden_size // disc.num_attention_heads)
        width = derived.get("hidden_size", gen.hidden_size)
        heads = max(1, width // head_size)
        while width % heads:  # a count that divides the width (megatron-core needs it)
            heads -= 1
        derived["num_attention_heads"] = heads
    if twin("ffn_hidden_size") is not None:
        derived["ffn_hidden_size"] = twin("ffn_hidden_size")
        source["ffn_hidden_size"] = _flag("generator_ffn_hidden_size")
    elif width_set:
        derived["ffn_hidden_size"] = 4 * derived["hidden_size"]
        source["ffn_hidden_size"] = source["hidden_size"]
    for name in ("hidden_dropout", "attention_dropout", "layernorm_epsilon"):
        if twin(name) is not None:
            derived[name], source[name] = twin(name), _flag("generator_" + name)
        elif _given(args, name):
            derived[name], source[name] = getattr(disc, name), _flag(name)
    for name, value in derived.items():
        setattr(gen, name, value)
        origins[f"model.generator.{name}"] = source[name]
    return origins
