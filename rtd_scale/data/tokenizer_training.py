"""Making tokenizer files: :func:`train_tokenizer` (a SentencePiece model with the fixed special
ids of ``data/tokenizer.py``, trained on text normalised by ``data/normalize_text.py``'s
:func:`~rtd_scale.data.normalize_text.normalize_text`; ``tools/train_tokenizer.py``) and
:func:`add_special_pieces` (a pad or mask piece appended to another SentencePiece model;
``tools/add_special_pieces.py``). Reading and using a tokenizer is ``data/tokenizer.py``.

SentencePiece places the pad and unk pieces at the ids given (pad_id=0, unk_id=3,
bos_id=eos_id=-1) and then fills the free ids with the control symbols in order, which gives
[CLS]=1, [SEP]=2, [MASK]=4; every trained model is checked
(:meth:`~rtd_scale.data.tokenizer.Tokenizer.verify_special_ids`) before it is written.
"""
from __future__ import annotations

import io
import os
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Sequence

import sentencepiece as spm

from rtd_scale.atomic import write_atomic
from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.normalize_text import normalize_text
from rtd_scale.data.tokenizer import (PAD_ID, SPECIAL_IDS, SPECIAL_PIECE_NAMES, SPECIAL_PIECES,
                                      UNK_ID, TokenizerModelError, _sp_proto,
                                      _tokenizer_from_bytes)

__all__ = ["DEFAULT_MAX_SENTENCE_BYTES", "MODEL_TYPES", "ModelType", "TokenizerTrainingError",
           "TrainingSummary", "add_special_pieces", "split_for_training", "train_tokenizer"]

_CONTROL_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")  # placed by SentencePiece at 1, 2, 4 (see above)
ModelType = Literal["unigram", "bpe"]
MODEL_TYPES: tuple[str, ...] = ("unigram", "bpe")
# SentencePiece's default --max_sentence_length (bytes); longer training sentences are dropped by
# the trainer, so split_for_training cuts documents to fit.
DEFAULT_MAX_SENTENCE_BYTES = 4192


_SENTENCE_END_RE = re.compile(r"(?<=[.!?]) ")


def split_for_training(text: str, max_bytes: int = DEFAULT_MAX_SENTENCE_BYTES) -> list[str]:
    """Cut normalised ``text`` into training sentences of at most ``max_bytes`` UTF-8 bytes each.

    SentencePiece trains on one sentence per line and silently drops lines longer than its
    ``max_sentence_length`` (bytes), so a corpus whose every line is long trains on nothing
    (tests/unit/test_tokenizer.py::test_every_line_too_long_trains).
    Here: split at sentence ends (". ", "! ", "? "); a sentence still too long is packed greedily
    from whole words; a single word longer than ``max_bytes`` (e.g. a 70,000-character run with no
    spaces, tests/unit/test_tokenizer.py::test_no_space_run_trains_and_neighbours_intact) is
    hard-cut at UTF-8 character boundaries. Joining the pieces with spaces gives back
    ``text`` except where a word was hard-cut. ``text`` must already be normalised (single spaces).
    """
    if max_bytes < 4:
        raise ValueError(f"max_bytes must be >= 4 (one UTF-8 character), got {max_bytes}")
    out: list[str] = []
    for sentence in _SENTENCE_END_RE.split(text):
        if _utf8_len(sentence) <= max_bytes:
            if sentence:
                out.append(sentence)
            continue
        chunk: list[str] = []
        chunk_bytes = 0
        for word in sentence.split(" "):
            word_bytes = _utf8_len(word)
            if chunk and chunk_bytes + 1 + word_bytes <= max_bytes:
                chunk.append(word)
                chunk_bytes += 1 + word_bytes
                continue
            if chunk:
                out.append(" ".join(chunk))
            if word_bytes <= max_bytes:
                chunk, chunk_bytes = [word], word_bytes
            else:
                pieces = _hard_split(word, max_bytes)
                out.extend(pieces[:-1])
                chunk, chunk_bytes = [pieces[-1]], _utf8_len(pieces[-1])
        if chunk:
            out.append(" ".join(chunk))
    return out


def _utf8_len(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8"))


def _hard_split(word: str, max_bytes: int) -> list[str]:
    data = word.encode("utf-8")
    pieces = []
    start = 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # don't cut inside a character
            end -= 1
        pieces.append(data[start:end].decode("utf-8"))
        start = end
    return pieces



def add_special_pieces(model_path: str | Path, output_path: str | Path,
                       pieces: Sequence[str] | None = None) -> list[tuple[str, int]]:
    """Append ``pieces`` to a SentencePiece model as control pieces and write it to
    ``output_path`` (atomically); every existing id keeps its value, so the new pieces get ids
    piece count, piece count + 1, …. Control pieces never come from encoding text.

    ``pieces`` defaults to the missing ones among pad and mask (then cls, sep), named in the
    model's own style: ``<pad>`` / ``<mask>`` when its unknown piece is ``<unk>`` (SentencePiece's
    default layout), else ``[PAD]`` / ``[MASK]``. Returns [(piece, id)] added.

    Raises:
        TokenizerModelError: the input is not a SentencePiece model, a piece is already in it,
            or there is nothing to add.
    """
    from sentencepiece import sentencepiece_model_pb2

    data = Path(model_path).read_bytes() if Path(model_path).is_file() else None
    if data is None:
        raise TokenizerModelError(f"--input {model_path}: no such SentencePiece model")
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(data)
    except (RuntimeError, OSError):
        raise TokenizerModelError(f"--input {model_path} is not a SentencePiece model") from None
    existing = {sp.id_to_piece(i) for i in range(sp.get_piece_size())}
    if pieces is None:
        angle = sp.id_to_piece(sp.unk_id()) == "<unk>"
        pieces = [names[1] if angle else names[0] for role, names in SPECIAL_PIECE_NAMES.items()
                  if role in ("pad", "cls", "sep", "mask") and not existing & set(names)]
    already = [p for p in pieces if p in existing]
    if already:
        raise TokenizerModelError(f"--input {model_path} already has {', '.join(already)}; nothing to add")
    if not pieces:
        raise TokenizerModelError(f"--input {model_path} already has pad, cls, sep and mask pieces; nothing to add")
    proto = _sp_proto(data)
    start = len(proto.pieces)
    for piece in pieces:
        proto.pieces.append(sentencepiece_model_pb2.ModelProto.SentencePiece(
            piece=piece, score=0.0, type=sentencepiece_model_pb2.ModelProto.SentencePiece.CONTROL))
    write_atomic(Path(output_path), proto.SerializeToString())
    return [(piece, start + k) for k, piece in enumerate(pieces)]



class TokenizerTrainingError(UserInputError):
    """Training cannot proceed on this corpus with these settings; the message names the flag."""


@dataclass(frozen=True)
class TrainingSummary:
    """What :func:`train_tokenizer` did. ``seconds`` is wall time, reading included."""

    model_path: str
    vocab_path: str
    vocab_size: int
    model_type: str
    documents: int  # documents read, empty ones included
    empty_documents: int  # empty after normalisation (not trained on)
    sentences: int  # training sentences after split_for_training
    sentences_fed: int  # sentences given to SentencePiece (<= input_sentence_size)
    seconds: float


_VOCAB_TOO_HIGH_RE = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
# SentencePiece's trainer_interface.cc: every character kept by character_coverage plus the meta
# pieces (specials; the 256 byte pieces with byte_fallback) must fit: "N vs <that sum>".
_VOCAB_TOO_LOW_RE = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


def train_tokenizer(
    documents: Iterable[str],
    output_prefix: str | Path,
    *,
    vocab_size: int = 8000,
    model_type: ModelType = "unigram",
    max_sentence_bytes: int = DEFAULT_MAX_SENTENCE_BYTES,
    input_sentence_size: int = 2_000_000,
    character_coverage: float = 0.9995,
    seed: int = 0,
    num_threads: int | None = None,
    byte_fallback: bool = False,
    verbose: bool = False,
) -> TrainingSummary:
    """Train a SentencePiece model with the fixed special ids on raw ``documents``.

    Each document is normalised (:func:`normalize_text`) and cut by :func:`split_for_training`
    into sentences of at most ``max_sentence_bytes`` UTF-8 bytes. If there are more than
    ``input_sentence_size`` sentences (0 = no limit), a uniform sample of that many is kept
    (reservoir sampling seeded by ``seed``, so the sample is reproducible); SentencePiece itself
    then trains on all it is given. Writes ``{output_prefix}.model`` and ``.vocab`` (each via a
    temporary name and a rename) only after the special ids are verified. The model bytes are a
    function of the documents and the settings, ``num_threads`` included (it is recorded in the
    model), so a re-run on the same machine reproduces the same file and SHA-256.

    Raises TokenizerTrainingError (a ValueError) for an empty corpus, a ``vocab_size`` the corpus
    cannot support (naming the largest SentencePiece suggests), or a trainer failure; ValueError
    for invalid settings. ``num_threads`` defaults to ``os.cpu_count()``. ``byte_fallback`` adds
    256 byte pieces (ids 5-260) so characters outside ``character_coverage`` become UTF-8 bytes
    instead of [UNK]; the special ids stay 0-4.
    """
    start = time.perf_counter()
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size <= len(SPECIAL_IDS):
        raise ValueError(f"vocab_size (--vocab-size) must exceed {len(SPECIAL_IDS)} special pieces, got {vocab_size}")
    if max_sentence_bytes < 4:
        raise ValueError(f"max_sentence_bytes (--max-sentence-length) must be >= 4, got {max_sentence_bytes}")
    if input_sentence_size < 0:
        raise ValueError(f"input_sentence_size (--input-sentence-size) must be >= 0, got {input_sentence_size}")
    if not 0.0 < character_coverage <= 1.0:
        raise ValueError(f"character_coverage (--character-coverage) must be in (0, 1], got {character_coverage}")

    rng = random.Random(seed)
    sample: list[str] = []
    n_docs = n_empty = n_sentences = 0
    for doc in documents:
        n_docs += 1
        text = normalize_text(doc)
        if not text:
            n_empty += 1
            continue
        for sentence in split_for_training(text, max_sentence_bytes):
            if input_sentence_size == 0 or len(sample) < input_sentence_size:
                sample.append(sentence)
            else:  # reservoir sampling, Algorithm R
                j = rng.randrange(n_sentences + 1)
                if j < input_sentence_size:
                    sample[j] = sentence
            n_sentences += 1
    if not sample:
        what = "no documents" if n_docs == 0 else f"all {n_docs:,} documents are empty after normalisation"
        raise TokenizerTrainingError(f"nothing to train the tokenizer on: {what}")

    out = Path(output_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_path, vocab_path = Path(f"{out}.model"), Path(f"{out}.vocab")
    # Trained from memory into memory (sentence_iterator / model_writer): no temporary path is
    # recorded in the model's trainer_spec, so equal inputs and settings give identical bytes.
    model_bytes = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sample),
            model_writer=model_bytes,
            model_type=model_type,
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            max_sentence_length=max_sentence_bytes,
            input_sentence_size=0,  # sampling was done above
            shuffle_input_sentence=False,
            num_threads=num_threads or os.cpu_count() or 1,
            normalization_rule_name="identity",  # normalize_text is the one rule
            pad_id=PAD_ID,
            pad_piece=SPECIAL_PIECES[PAD_ID],
            unk_id=UNK_ID,
            unk_piece=SPECIAL_PIECES[UNK_ID],
            bos_id=-1,
            eos_id=-1,
            control_symbols=list(_CONTROL_SYMBOLS),
            byte_fallback=byte_fallback,
            minloglevel=0 if verbose else 2,
        )
    except RuntimeError as e:
        message = " ".join(str(e).split())
        m = _VOCAB_TOO_HIGH_RE.search(message)
        if m:
            raise TokenizerTrainingError(
                f"--vocab-size {m.group(1)} is too high for this corpus: SentencePiece can make at most "
                f"{m.group(2)} pieces from it; pass --vocab-size {m.group(2)} or less, or train on more text"
            ) from None
        m = _VOCAB_TOO_LOW_RE.search(message)
        if m:
            pieces = "special and byte pieces" if byte_fallback else "special pieces"
            raise TokenizerTrainingError(
                f"--vocab-size {m.group(1)} is too small for this corpus: its characters (at "
                f"--character-coverage {character_coverage:g}) and the {pieces} need {m.group(2)}; "
                f"pass --vocab-size {m.group(2)} or more"
            ) from None
        raise TokenizerTrainingError(f"SentencePiece training failed: {message}") from None
    del sample
    trained = _tokenizer_from_bytes(str(model_path), model_bytes.getvalue())
    trained.verify_special_ids()
    # SentencePiece's .vocab format: piece, tab, score (C++ ostream default = 6 significant digits).
    vocab_text = "".join(f"{trained.id_to_piece(i)}\t{trained._sp.get_score(i):g}\n" for i in range(trained.vocab_size))
    write_atomic(vocab_path, vocab_text.encode("utf-8"))
    write_atomic(model_path, model_bytes.getvalue())
    return TrainingSummary(
        model_path=str(model_path),
        vocab_path=str(vocab_path),
        vocab_size=trained.vocab_size,
        model_type=model_type,
        documents=n_docs,
        empty_documents=n_empty,
        sentences=n_sentences,
        sentences_fed=min(n_sentences, input_sentence_size) if input_sentence_size else n_sentences,
        seconds=time.perf_counter() - start,
    )
