"""Tokenizer: fixed special ids, normalisation (control characters), training on long lines,
a 70k-char run with no spaces, malformed input, and a vocabulary too large for the corpus.

Fixture text: the case files plus the Python reference manual's topic texts that ship with the
standard library (``pydoc_data.topics``, real English prose), so that a 400-piece vocabulary is
trainable offline in ~2 s; the case files alone hold only five distinct sentences.
"""

from __future__ import annotations

import pickle
import re
import unicodedata
from pathlib import Path

import pydoc_data.topics
import pytest
import sentencepiece as spm

from rtd_scale.data import normalize_text as normmod
from rtd_scale.data import tokenizer as tokmod
from rtd_scale.data.normalize_text import normalize_text
from rtd_scale.data.text import BadLineError, ReadStats, iter_records
from rtd_scale.data.tokenizer import (
    CLS_ID,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    UNK_ID,
    Tokenizer,
    TokenizerModelError,
)
from rtd_scale.data.tokenizer_training import (
    TokenizerTrainingError,
    split_for_training,
    train_tokenizer,
)

from tests.helpers.env import CASES
from tests.helpers.env import case_texts as _case_texts


def _fixture_documents() -> list[str]:
    docs = list(pydoc_data.topics.topics.values())
    for name in ("single_sentence_docs.jsonl", "all_lines_too_long.jsonl",
                 "no_space_70k.jsonl", "control_chars.jsonl"):
        docs += _case_texts(name)
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tok") / "spm"
    summary = train_tokenizer(_fixture_documents(), prefix, vocab_size=400, num_threads=2)
    assert summary.vocab_size == 400
    return Tokenizer(summary.model_path)


# -- special ids ------------------------------------------------------------------------------


def test_special_ids_are_fixed(tokenizer):
    assert (PAD_ID, CLS_ID, SEP_ID, UNK_ID, MASK_ID) == (0, 1, 2, 3, 4)
    assert SPECIAL_IDS == (0, 1, 2, 3, 4)
    assert [tokenizer.id_to_piece(i) for i in range(5)] == ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    assert [tokenizer.piece_to_id(p) for p in ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")] == [0, 1, 2, 3, 4]
    assert (tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.unk_id, tokenizer.mask_id) == (0, 1, 2, 3, 4)
    tokenizer.verify_special_ids()


def test_encoding_text_never_yields_pad_cls_sep_mask(tokenizer):
    # The literal special strings are ordinary text; control ids only come from the packer/masker.
    ids = tokenizer.encode("[CLS] The [MASK] rises. [SEP] [PAD] <s> </s>")
    assert ids and not {PAD_ID, CLS_ID, SEP_ID, MASK_ID} & set(ids)
    for doc in _fixture_documents():
        assert not {PAD_ID, CLS_ID, SEP_ID, MASK_ID} & set(tokenizer.encode(doc))
    # Control ids decode to nothing.
    body = tokenizer.encode("The river")
    assert tokenizer.decode([CLS_ID, *body, SEP_ID, PAD_ID, MASK_ID]) == "The river"


def test_unseen_character_is_unk(tokenizer):
    assert tokenizer.encode("\u2603")[-1] == UNK_ID  # snowman: not in the fixture text


def test_default_layout_sentencepiece_model_is_rejected(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(_case_texts("single_sentence_docs.jsonl")), encoding="utf-8")
    # SentencePiece's defaults: <unk>=0, <s>=1, </s>=2 (like most released models).
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "foreign"), vocab_size=40, minloglevel=2)
    with pytest.raises(TokenizerModelError) as e:
        Tokenizer(tmp_path / "foreign.model")
    msg = str(e.value)
    assert str(tmp_path / "foreign.model") in msg
    assert "has no pad piece ([PAD] or <pad>) and no mask piece ([MASK] or <mask>)" in msg
    assert "tools/add_special_pieces.py" in msg and "tools/train_tokenizer.py" in msg
    assert isinstance(e.value, ValueError)


def test_missing_or_non_model_file(tmp_path):
    with pytest.raises(TokenizerModelError, match="tokenizer model not found: .*nope.model"):
        Tokenizer(tmp_path / "nope.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerModelError, match="junk.model is not a SentencePiece model"):
        Tokenizer(tmp_path / "junk.model")


def test_tokenizer_pickles_with_its_model(tokenizer):
    clone = pickle.loads(pickle.dumps(tokenizer))
    text = "Copper was among the first metals worked by people."
    assert clone.encode(text) == tokenizer.encode(text)
    assert clone.sha256 == tokenizer.sha256 == tokmod.file_sha256(tokenizer.model_path)


# -- normalisation ----------------------------------------------------------------------------


def test_normalize_text_control_chars():
    got = [normalize_text(t) for t in _case_texts("control_chars.jsonl")]
    assert got == [
        "beforeafter The river rises in the northern hills and flows south to the sea.",
        "bell and escape[31m colour Copper was among the first metals worked by people, long before iron.",
        "form feed vertical tab A sonnet has fourteen lines and, in English, usually a fixed rhyme scheme.",
        "zerowidthjoiner The library opened in 1891 and moved to its present building in 1934.",
    ]


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("  a\tb\nc\r\nd\x0be\x0cf  ", "a b c d e f"),  # whitespace controls become one space
        ("nul\x00 bel\x07 del\x7f c1\x85x", "nul bel del c1 x"),  # U+0085 NEL is whitespace
        ("\ufeffbom\u200b\u2060\u00adx", "bomx"),  # BOM, zero-width space, word joiner, soft hyphen
        ("no\u00a0break\u3000ideographic\u2028line", "no break ideographic line"),
        ("e\u200b\u0301", "\u00e9"),  # dropping U+200B first lets NFC compose e + acute
        ("lone \ud800surrogate", "lone surrogate"),
        ("", ""),
    ],
)
def test_normalize_text_rules(raw, expected):
    assert normalize_text(raw) == expected
    assert normalize_text(expected) == expected  # idempotent


def test_drop_table_is_unicode_control_and_format():
    for a, b in normmod._DROP_RANGES:
        for cp in range(a, b + 1):
            ch = chr(cp)
            assert unicodedata.category(ch) in ("Cc", "Cf", "Cs") and not ch.isspace(), hex(cp)
    # every Cc in Latin-1 is either dropped or whitespace
    for cp in list(range(0x20)) + list(range(0x7F, 0xA0)):
        assert normalize_text(f"a{chr(cp)}b") in ("ab", "a b"), hex(cp)


# -- training on awkward corpora -----------------------------------------------------------------


def test_split_for_training_limits_bytes_and_keeps_text():
    text = normalize_text(_case_texts("all_lines_too_long.jsonl")[0])
    pieces = split_for_training(text, 4192)
    assert len(text.encode()) == 11251 and all(len(p.encode()) <= 4192 for p in pieces)
    assert " ".join(pieces) == text
    assert split_for_training("aaa bbb ccc dddddddddd e", 5) == ["aaa", "bbb", "ccc", "ddddd", "ddddd", "e"]
    assert split_for_training("\u00e9\u00e9\u00e9\u00e9\u00e9", 4) == ["\u00e9\u00e9", "\u00e9\u00e9", "\u00e9"]


def test_long_line_round_trips(tokenizer):
    line = _case_texts("all_lines_too_long.jsonl")[7]
    ids = tokenizer.encode(line)
    assert len(ids) > 1000 and UNK_ID not in ids
    assert tokenizer.decode(ids) == normalize_text(line)


def test_no_space_run_encodes_and_neighbours_intact(tokenizer):
    """Alone, through the real CLI: tests/tools/test_tokenizer_cli.py::test_no_space_run_trains_alone."""
    before, run, after = _case_texts("no_space_70k.jsonl")
    assert len(run) == 70014 and run.count(" ") == 2  # "prefix <70,000 letters> suffix"
    # The fixture tokenizer was trained with these three documents; encoding finishes too.
    assert tokenizer.decode(tokenizer.encode(before)) == before
    assert tokenizer.decode(tokenizer.encode(after)) == after
    assert tokenizer.decode(tokenizer.encode(run)) == run


def test_skip_bad_lines_counts_three():
    """Training on the rest through the CLI:
    tests/tools/test_tokenizer_cli.py::test_skip_bad_lines_trains_on_the_rest."""
    stats = ReadStats()
    records = list(iter_records([CASES / "malformed.jsonl"], ["text"], skip_bad_lines=True, stats=stats))
    assert records == [
        ("The river rises in the northern hills and flows south to the sea.",),
        ("A sonnet has fourteen lines and, in English, usually a fixed rhyme scheme.",),
    ]
    assert stats.bad_lines == 3
    assert [(e.line, e.reason.split(" (")[0]) for e in stats.bad_examples] == [
        (2, "invalid JSON: Unterminated string starting at"),
        (3, "missing key 'text'"),
        (4, "not valid UTF-8"),
    ]


def test_bad_line_error_is_one_line_and_picklable():
    with pytest.raises(BadLineError) as e:
        list(iter_records([CASES / "malformed.jsonl"], ["text"]))
    err = pickle.loads(pickle.dumps(e.value))
    assert (err.line, str(err).split(": ")[0]) == (2, f"{CASES / 'malformed.jsonl'}:2")


def test_vocab_too_high_names_flag_and_limit(tmp_path):
    docs = _case_texts("all_lines_too_long.jsonl")
    with pytest.raises(TokenizerTrainingError) as e:
        train_tokenizer(docs, tmp_path / "big", vocab_size=400, num_threads=2)
    m = re.fullmatch(r"--vocab-size 400 is too high for this corpus: SentencePiece can make at most (\d+) "
                     r"pieces from it; pass --vocab-size \1 or less, or train on more text", str(e.value))
    assert m, str(e.value)
    assert not list(tmp_path.iterdir())  # no model, no leftover temp dir
    limit = int(m.group(1))
    assert train_tokenizer(docs, tmp_path / "ok", vocab_size=limit, num_threads=2).vocab_size == limit


def test_empty_corpus_is_refused(tmp_path):
    """A missing input through the CLI: tests/tools/test_tokenizer_cli.py::test_missing_input_is_one_line."""
    with pytest.raises(TokenizerTrainingError, match="all 3 documents are empty after normalisation"):
        train_tokenizer(["", " \t", "\u200b"], tmp_path / "e")


def test_input_sentence_size_samples(tmp_path):
    docs = _case_texts("single_sentence_docs.jsonl")
    s = train_tokenizer(docs, tmp_path / "s", vocab_size=40, input_sentence_size=50, num_threads=1)
    assert (s.documents, s.sentences, s.sentences_fed) == (300, 300, 50)


def test_bpe_keeps_special_ids(tmp_path):
    s = train_tokenizer(_case_texts("all_lines_too_long.jsonl"), tmp_path / "bpe", vocab_size=200,
                        model_type="bpe", num_threads=2)
    tok = Tokenizer(s.model_path)
    assert [tok.id_to_piece(i) for i in range(5)] == ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]


def test_training_is_reproducible(tmp_path):
    docs = _case_texts("single_sentence_docs.jsonl")
    a = train_tokenizer(docs, tmp_path / "a", vocab_size=40, num_threads=2)
    b = train_tokenizer(docs, tmp_path / "b", vocab_size=40, num_threads=2)
    assert Path(a.model_path).read_bytes() == Path(b.model_path).read_bytes()
    vocab = Path(a.vocab_path).read_text(encoding="utf-8").splitlines()
    assert vocab == Path(b.vocab_path).read_text(encoding="utf-8").splitlines() and len(vocab) == 40
    assert vocab[:5] == ["[PAD]\t0", "[CLS]\t0", "[SEP]\t0", "[UNK]\t0", "[MASK]\t0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "a.vocab", "b.model", "b.vocab"]


def test_ascii_fast_path_follows_the_unicode_rule_for_every_ascii_character():
    """normalize_text's ASCII-only path (bytes) and its general path (regex, NFC) apply one rule:
    each of the 128 ASCII characters is kept, dropped (Cc, not whitespace) or made a space."""
    import unicodedata

    for code in range(128):
        c = chr(code)
        expected = "a b" if c.isspace() else "ab" if unicodedata.category(c) == "Cc" else f"a{c}b"
        assert normalize_text(f"a{c}b") == expected, hex(code)  # ASCII path
        assert normalize_text(f"\u00e9{c}b") == "\u00e9" + expected[1:], hex(code)  # general path
        assert normalize_text(f"  {c}{c}\t") == ("" if c.isspace() or expected == "ab" else c + c), hex(code)


def test_fast_paths_match_the_plain_rule_on_random_text():
    """normalize_text's fast paths against the rule written plainly (drop, NFC, collapse), on
    200,000 random strings over ASCII, whitespace, format, control, surrogate, private-use,
    combining and Hangul characters."""
    import random
    import unicodedata

    from rtd_scale.data.normalize_text import _DROP_RE

    def plain(text: str) -> str:
        return " ".join(unicodedata.normalize("NFC", _DROP_RE.sub("", text)).split())

    extra = [0x85, 0xA0, 0xAD, 0x200B, 0x200D, 0x2000, 0x2001, 0x2028, 0x3000, 0xFEFF, 0xE0041, 0x1D173,
             0x301, 0x327, 0xE9, 0xD800, 0xE000, 0x378, 0x1100, 0x1161, 0x11A8, 0xAC00]
    alphabet = [chr(c) for c in [*range(0x80), *extra]]
    rng = random.Random(0)
    for _ in range(200_000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(12)))
        assert normalize_text(text) == plain(text), repr(text)
