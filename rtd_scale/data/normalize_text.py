"""The pipeline's one text normalisation rule, :func:`normalize_text`, and the same rule written
for the readers that do not run Python: a ``tokenizers`` normaliser
(:func:`normalize_text_hf_normalizer`, for an exported ``tokenizer.json``) and a SentencePiece
character map (:func:`normalize_text_charsmap`, for an exported ``spm.model``).

The rule is data, stated once: the characters dropped (``_DROP_RANGES``), whitespace
(``str.isspace``) and Unicode NFC. :func:`normalize_text` applies it (its ASCII fast path reads its
tables from ``_DROP_RANGES`` and ``str.isspace``, not a copy of them); the two renderings are
built from the same ranges and agree with it (tests/unit/test_tokenizer.py and
tests/unit/test_tokenizer_byo.py, fuzzed). The tokenizer is trained on text normalised by it and
encodes text normalised by it (``data/tokenizer.py``, ``data/tokenizer_training.py``), with
SentencePiece's own normaliser set to ``identity``, so there is a single rule.

Standard library only at import; ``sentencepiece`` and ``tokenizers`` are imported by the
renderings that need them.
"""
from __future__ import annotations

import functools
import os
import re
import unicodedata

__all__ = ["NORMALIZE_TEXT_RULE_NAME", "normalize_text", "normalize_text_charsmap",
           "normalize_text_hf_normalizer"]

# Characters dropped by normalize_text: Unicode category Cc that is not whitespace (NUL, BEL, ESC,
# DEL, C1 controls), all of Cf (zero-width space/joiners U+200B-U+200F, word joiner U+2060, BOM
# U+FEFF, soft hyphen U+00AD, bidi controls, tag characters, ...) and lone surrogates Cs. Fixed
# ranges, generated from Unicode 15.0 (Python 3.11's unicodedata), so the rule does not move with
# the Python version. Whitespace controls (\t \n \v \f \r, U+001C-U+001F, U+0085) are whitespace
# and become a space instead.
_DROP_RANGES: tuple[tuple[int, int], ...] = (
    (0x0000, 0x0008), (0x000E, 0x001B), (0x007F, 0x0084), (0x0086, 0x009F), (0x00AD, 0x00AD),
    (0x0600, 0x0605), (0x061C, 0x061C), (0x06DD, 0x06DD), (0x070F, 0x070F), (0x0890, 0x0891),
    (0x08E2, 0x08E2), (0x180E, 0x180E), (0x200B, 0x200F), (0x202A, 0x202E), (0x2060, 0x2064),
    (0x2066, 0x206F), (0xD800, 0xDFFF), (0xFEFF, 0xFEFF), (0xFFF9, 0xFFFB), (0x110BD, 0x110BD),
    (0x110CD, 0x110CD), (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001), (0xE0020, 0xE007F),
)
# The ASCII part of the rule, for normalize_text's fast path on bytes, taken from the rule itself:
# the dropped characters below U+0080 (Cc that is not whitespace) and the str.isspace ones
# (\t \n \v \f \r, U+001C-U+001F) other than the space, made a space.
_ASCII_DROP = bytes(cp for first, last in _DROP_RANGES
                    for cp in range(first, min(last, 0x7F) + 1))
_ASCII_SPACES = bytes(cp for cp in range(0x80) if chr(cp).isspace() and cp != 0x20)
_ASCII_WHITESPACE_TO_SPACE = bytes.maketrans(_ASCII_SPACES, b" " * len(_ASCII_SPACES))
_DROP_RE = re.compile(
    "[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in _DROP_RANGES) + "]"
)


def normalize_text(text: str) -> str:
    """Normalise raw text; the one rule used for tokenizer training and for every encode.

    In order: (1) drop control characters that are not whitespace (category Cc: NUL, BEL, ESC, DEL,
    C1), format characters (category Cf: U+200B zero-width space, U+200C/U+200D zero-width
    (non-)joiners, U+2060 word joiner, U+FEFF BOM, U+00AD soft hyphen, bidi controls) and lone
    surrogates; (2) Unicode NFC; (3) turn every run of whitespace (str.isspace: \\t \\n \\v \\f \\r,
    U+001C-U+001F, U+0085, NBSP, U+2000-U+200A, U+2028/2029, U+3000, ...) into one ASCII space
    and strip both ends. Dropping comes before NFC so that removing a zero-width character
    between a letter and its combining mark still yields NFC text. Idempotent.

    Example: ``"before\\x00after\\x0bvertical\\u200btab "`` → ``"beforeafter verticaltab"``.
    """
    # Two fast paths give the same result as the general one (tested character by character and
    # by fuzzing): they are ~4x faster, and this runs on every document of the corpus.
    if text.isascii():  # on bytes: ASCII whitespace to " ", ASCII Cc dropped, runs of " " collapsed
        raw = text.encode("ascii").translate(_ASCII_WHITESPACE_TO_SPACE, _ASCII_DROP)
        while b"  " in raw:
            raw = raw.replace(b"  ", b" ")
        return raw.strip(b" ").decode("ascii")
    collapsed = " ".join(text.split())
    if collapsed.isprintable():  # nothing to drop (no Cc, Cf, Cs left); NFC commutes with (3)
        return unicodedata.normalize("NFC", collapsed)
    text = unicodedata.normalize("NFC", _DROP_RE.sub("", text))
    return " ".join(text.split())



@functools.lru_cache(maxsize=1)
def _whitespace_ranges() -> tuple[tuple[int, int], ...]:
    """The code points ``str.isspace`` holds true for, as (first, last) ranges."""
    spaces: list[tuple[int, int]] = []
    for i in range(0x110000):
        if chr(i).isspace():
            if spaces and spaces[-1][1] == i - 1:
                spaces[-1] = (spaces[-1][0], i)
            else:
                spaces.append((i, i))
    return tuple(spaces)



# The name a SentencePiece model's normaliser gets when it holds :func:`normalize_text_charsmap`
# (the DeBERTa export's spm.model); the pipeline treats it as ``identity``: normalize_text runs
# first, and the map changes nothing in its output.
NORMALIZE_TEXT_RULE_NAME = "rtd_scale_normalize_text"



@functools.lru_cache(maxsize=1)
def normalize_text_charsmap() -> bytes:
    """:func:`normalize_text` as a SentencePiece ``precompiled_charsmap`` (the character map a
    SentencePiece model applies, longest match first, before its ``remove_extra_whitespaces``
    collapses and strips spaces), for readers that run a SentencePiece model or its map alone:
    transformers 4.x's slow ``DebertaV2Tokenizer`` (``spm.model``) and 5.x's
    ``DebertaV2Tokenizer``, which takes the map from tokenizer.json's ``Precompiled`` normaliser.

    Rules: every dropped character (``_DROP_RANGES``) to nothing, every other ``str.isspace``
    character to a space, every character NFC changes to its NFC form, and every NFD sequence
    of a character NFC keeps (``é`` as ``e`` + U+0301, Hangul syllables as jamo) to that
    character. Paragraph breaks, the dropped characters, NFC text and the NFD form of nearly all
    of it then give ``normalize_text``'s result (tests/unit/test_tokenizer_byo.py, fuzzed).
    What a map of replacements cannot do: drop U+0000 (SentencePiece's map is a trie of
    NUL-terminated keys), and compose a letter with a mark that follows a dropped character
    (``e`` + U+200B + U+0301) or another combining mark (``a`` + U+0316 + U+0301, which NFC
    makes ``á`` + U+0316), or marks out of canonical order; all rare outside constructed text.
    Built with SentencePiece's own compiler from a rule file (0.17 MB; 0.4 s, once per
    process)."""
    import tempfile

    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    rules: dict[str, str] = {}
    for first, last in _DROP_RANGES:
        for cp in range(max(first, 1), last + 1):
            if not 0xD800 <= cp <= 0xDFFF:  # lone surrogates never reach a byte-level reader
                rules[chr(cp)] = ""
    for first, last in _whitespace_ranges():
        rules.update((chr(cp), " ") for cp in range(first, last + 1) if cp != 0x20)
    for cp in range(0x110000):
        c = chr(cp)
        if c in rules or not (unicodedata.decomposition(c) or 0xAC00 <= cp <= 0xD7A3):
            continue  # Hangul syllables decompose by rule, not by table
        nfc = unicodedata.normalize("NFC", c)
        if nfc != c:
            rules[c] = nfc
        else:
            nfd = unicodedata.normalize("NFD", c)
            if nfd != c:
                rules[nfd] = c
    with tempfile.TemporaryDirectory() as tmp:
        tsv = os.path.join(tmp, "normalize_text.tsv")  # SentencePiece's rule file: hex in, tab, hex out
        with open(tsv, "w", encoding="ascii") as f:
            for src, dst in rules.items():
                f.write(" ".join(f"{ord(x):X}" for x in src) + "\t" +
                        " ".join(f"{ord(x):X}" for x in dst) + "\n")
        proto = sentencepiece_model_pb2.ModelProto()
        spm.set_min_log_level(1)  # the compiler's INFO lines say nothing to a user
        try:
            compiled = spm.SentencePieceNormalizer(rule_tsv=tsv).serialized_model_proto()
        finally:
            spm.set_min_log_level(0)  # SentencePiece's default
        proto.ParseFromString(compiled)
    return proto.normalizer_spec.precompiled_charsmap



@functools.lru_cache(maxsize=1)
def normalize_text_hf_normalizer():
    """:func:`normalize_text` as a ``tokenizers`` normaliser (for exported tokenizers): drop the
    same characters (lone surrogates cannot occur in UTF-8), NFC, every run of ``str.isspace``
    characters to one space, strip. Agrees with :func:`normalize_text` (fuzzed in the tests)."""
    from tokenizers import Regex, normalizers

    def char_class(ranges):
        return "[" + "".join(f"\\x{{{a:X}}}" if a == b else f"\\x{{{a:X}}}-\\x{{{b:X}}}" for a, b in ranges) + "]"

    spaces = _whitespace_ranges()
    drop = [r for r in _DROP_RANGES if r != (0xD800, 0xDFFF)]
    return normalizers.Sequence([
        normalizers.Replace(Regex(char_class(drop)), ""),
        normalizers.NFC(),
        normalizers.Replace(Regex(char_class(spaces) + "+"), " "),
        normalizers.Replace(Regex(r"\A | \z"), ""),
    ])

