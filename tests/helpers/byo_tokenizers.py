"""Tokenizers not made by tools/train_tokenizer.py, built for the tests from real text
(tests/data/wiki_sample.jsonl) with the real SentencePiece trainer and the tokenizers library.

Each builder writes into ``out`` and returns the file to pass as ``--tokenizer-model``:
- ``deberta_v3``: [PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3, no [MASK] piece, nmt_nfkc normaliser
  (the layout of microsoft/deberta-v3-*'s spm.model);
- ``default_layout``: SentencePiece's defaults, <unk> 0, <s> 1, </s> 2, no pad and no mask piece;
- ``roberta_names``: <s> 0, <pad> 1, </s> 2, <unk> 3 and a <mask> control piece (found by name);
- ``wordpiece_vocab`` / ``wordpiece_json``: BERT's WordPiece (uncased) with
  [PAD] [UNK] [CLS] [SEP] [MASK] at 0-4, as vocab.txt / tokenizer.json.
"""
from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm

from tests.helpers.env import TEST_DATA

BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def wiki_texts(n: int | None = None) -> list[str]:
    """The ``text`` of the first ``n`` lines (all by default) of tests/data/wiki_sample.jsonl."""
    lines = (TEST_DATA / "wiki_sample.jsonl").read_text(encoding="utf-8").splitlines()[:n]
    return [json.loads(line)["text"] for line in lines]


# Jane Austen, Pride and Prejudice (1813; public domain), chapter 1's opening as a plain-text
# edition lays it out: lines wrapped at 70 characters, paragraphs separated by a blank line
AUSTEN = (
    "It is a truth universally acknowledged, that a single man in possession\n"
    "of a good fortune, must be in want of a wife.\n\n"
    "However little known the feelings or views of such a man may be on his\n"
    "first entering a neighbourhood, this truth is so well fixed in the minds\n"
    "of the surrounding families, that he is considered the rightful property\n"
    "of some one or other of their daughters.\n\n"
    "\u201cMy dear Mr. Bennet,\u201d said his lady to him one day, \u201chave you heard that\n"
    "Netherfield Park is let at last?\u201d\n")


def normalisation_texts() -> list[str]:
    """Text that only our normalisation rule encodes as the pipeline does: Austen's paragraphs
    (line breaks, blank lines; with Windows line ends too), the NFD form of accented text,
    whitespace other than spaces, zero-width and control characters."""
    import unicodedata

    accented = ("Caf\u00e9 na\u00efve r\u00e9sum\u00e9, \u00c5ngstr\u00f6m; "
                "\u1f00\u03c1\u03c7\u03ae; Ti\u1ebfng Vi\u1ec7t; \ud55c\uad6d\uc5b4")
    return [AUSTEN, AUSTEN.replace("\n", "\r\n"), unicodedata.normalize("NFD", AUSTEN + accented),
            unicodedata.normalize("NFD", accented),
            *[unicodedata.normalize("NFD", t) for t in wiki_texts(5)],
            "tab\there,\u00a0no-break\u3000ideographic\u2028line  two\u200bzero-width\u00adsoft "
            "\x07bell\x1b[0m escape\ufeff mark", "  \n\t leading and trailing \u3000\n"]


def _wiki_sentences() -> list[str]:
    return [s for text in wiki_texts() for s in text.split(". ") if s.strip()]


def train_spm(out: Path, name: str, vocab_size: int = 600, **settings) -> str:
    """A SentencePiece model ``out/<name>.model`` trained on the sentences of wiki_sample.jsonl
    with ``settings`` (the trainer's keywords: ids and pieces of the special tokens)."""
    path = out / f"{name}.model"
    with open(path, "wb") as f:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(_wiki_sentences()), model_writer=f,
                                       vocab_size=vocab_size, num_threads=1, minloglevel=2,
                                       max_sentence_length=8192, **settings)
    return str(path)


def deberta_v3(out: Path) -> str:
    return train_spm(out, "deberta_v3", pad_id=0, pad_piece="[PAD]", bos_id=1, bos_piece="[CLS]",
                     eos_id=2, eos_piece="[SEP]", unk_id=3, unk_piece="[UNK]")


def default_layout(out: Path) -> str:
    return train_spm(out, "default_layout")


def roberta_names(out: Path) -> str:
    return train_spm(out, "roberta_names", bos_id=0, pad_id=1, eos_id=2, unk_id=3,
                     control_symbols=["<mask>"])


def _wordpiece(out: Path):
    from tokenizers import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(wiki_texts(), vocab_size=800, special_tokens=BERT_SPECIALS, show_progress=False)
    return tok


def wordpiece_vocab(out: Path, specials: list[str] | None = None) -> str:
    """``specials`` replaces the BERT specials at the top of the vocabulary (e.g. to drop [MASK])."""
    tok = _wordpiece(out)
    tok.save_model(str(out))
    path = out / "vocab.txt"
    if specials is not None:
        lines = path.read_text(encoding="utf-8").splitlines()
        path.write_text("\n".join([*specials, *lines[len(BERT_SPECIALS):]]) + "\n", encoding="utf-8")
    return str(path)


def wordpiece_json(out: Path) -> str:
    path = out / "tokenizer.json"
    _wordpiece(out).save(str(path))
    return str(path)


def every_layout(out: Path) -> dict[str, str]:
    """Each layout's file (layout -> what to pass as --tokenizer-model): ours (trained by
    rtd_scale's trainer), the builders above, and ``default_layout_extended`` (default_layout with
    <pad> and <mask> appended by add_special_pieces)."""
    from rtd_scale.data.tokenizer_training import add_special_pieces, train_tokenizer

    paths = {"ours": train_tokenizer(wiki_texts(), out / "ours", vocab_size=600, num_threads=1).model_path}
    for name in ("deberta_v3", "default_layout", "roberta_names"):
        paths[name] = globals()[name](out)
    add_special_pieces(paths["default_layout"], out / "default_layout_extended.model")
    paths["default_layout_extended"] = str(out / "default_layout_extended.model")
    (out / "wp_txt").mkdir()
    (out / "wp_json").mkdir()
    paths["wordpiece_vocab"] = wordpiece_vocab(out / "wp_txt")
    paths["wordpiece_json"] = wordpiece_json(out / "wp_json")
    return paths
