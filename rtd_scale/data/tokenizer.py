"""The project's tokenizer: a SentencePiece model (unigram or BPE) with fixed special ids.

Special ids (the same in every model this project trains; :meth:`Tokenizer.verify_special_ids`
rejects a model that differs):

| id | piece    | constant  | SentencePiece kind | role                                        |
|----|----------|-----------|--------------------|---------------------------------------------|
| 0  | `[PAD]`  | `PAD_ID`  | pad (control)      | padding; never a real token                 |
| 1  | `[CLS]`  | `CLS_ID`  | control symbol     | starts every packed sequence                |
| 2  | `[SEP]`  | `SEP_ID`  | control symbol     | ends a document / sequence                  |
| 3  | `[UNK]`  | `UNK_ID`  | unknown            | characters outside the model's coverage     |
| 4  | `[MASK]` | `MASK_ID` | control symbol     | the MLM mask token                          |

Ids 0, 1, 2 and 4 are SentencePiece *control* symbols: encoding text never produces them (the
literal text "[MASK]" becomes ordinary pieces), and decoding drops them. SentencePiece places the
pad and unk pieces at the ids given (pad_id=0, unk_id=3, bos_id=eos_id=-1) and then fills the
free ids with the control symbols in order, which gives [CLS]=1, [SEP]=2, [MASK]=4 (checked
after every training run). Encoding never adds [CLS]/[SEP]; the packed dataset does.

Normalisation happens once, in :func:`normalize_text`, identically when the tokenizer is trained
and whenever text is encoded (case C12). SentencePiece's own normaliser is set to ``identity`` so
there is a single rule, and ``decode(encode(t)) == normalize_text(t)`` for text the model covers.

Nothing here imports megatron-core or DeepSpeed.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Sequence

import numpy as np
import sentencepiece as spm

from rtd_scale.atomic import write_atomic
from rtd_scale.cli_errors import UserInputError

__all__ = [
    "CLS_ID",
    "DEFAULT_MAX_SENTENCE_BYTES",
    "MASK_ID",
    "ModelType",
    "PAD_ID",
    "SEP_ID",
    "SPECIAL_IDS",
    "SPECIAL_PIECES",
    "TRAIN_TOKENIZER_HINT",
    "Tokenizer",
    "TokenizerModelError",
    "TokenizerTrainingError",
    "TrainingSummary",
    "UNK_ID",
    "file_sha256",
    "normalize_text",
    "split_for_training",
    "train_tokenizer",
]

PAD_ID = 0
CLS_ID = 1
SEP_ID = 2
UNK_ID = 3
MASK_ID = 4
SPECIAL_IDS: tuple[int, ...] = (PAD_ID, CLS_ID, SEP_ID, UNK_ID, MASK_ID)
SPECIAL_PIECES: tuple[str, ...] = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")  # index == id
_CONTROL_SYMBOLS = ("[CLS]", "[SEP]", "[MASK]")  # placed by SentencePiece at 1, 2, 4 (see above)

ModelType = Literal["unigram", "bpe"]
MODEL_TYPES: tuple[str, ...] = ("unigram", "bpe")
# SentencePiece's default --max_sentence_length (bytes); longer training sentences are dropped by
# the trainer, so split_for_training cuts documents to fit.
DEFAULT_MAX_SENTENCE_BYTES = 4192
TRAIN_TOKENIZER_HINT = "train it with tools/train_tokenizer.py"


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

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
# The ASCII part of the rule, for bytes: Cc that is not whitespace (dropped), and whitespace
# (str.isspace: \t \n \v \f \r and U+001C-U+001F) made a space.
_ASCII_DROP = bytes([*range(0x00, 0x09), *range(0x0E, 0x1C), 0x7F])
_ASCII_WHITESPACE_TO_SPACE = bytes.maketrans(b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f", b" " * 9)
_DROP_RE = re.compile(
    "[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in _DROP_RANGES) + "]"
)


def normalize_text(text: str) -> str:
    """Normalise raw text; the one rule used for tokenizer training and for every encode (C12).

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


_SENTENCE_END_RE = re.compile(r"(?<=[.!?]) ")


def split_for_training(text: str, max_bytes: int = DEFAULT_MAX_SENTENCE_BYTES) -> list[str]:
    """Cut normalised ``text`` into training sentences of at most ``max_bytes`` UTF-8 bytes each.

    SentencePiece trains on one sentence per line and silently drops lines longer than its
    ``max_sentence_length`` (bytes), so a corpus whose every line is long trains on nothing (C10).
    Here: split at sentence ends (". ", "! ", "? "); a sentence still too long is packed greedily
    from whole words; a single word longer than ``max_bytes`` (C11: a 70,000-character run with no
    spaces) is hard-cut at UTF-8 character boundaries. Joining the pieces with spaces gives back
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


# ---------------------------------------------------------------------------------------------
# Loading and encoding
# ---------------------------------------------------------------------------------------------


class TokenizerModelError(UserInputError):
    """The tokenizer model is missing, unreadable, or lacks the fixed special ids."""


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (used to tie shards to the tokenizer that wrote them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """A SentencePiece model with the fixed special ids of this module.

    ``Tokenizer(path)`` reads the ``.model`` file, checks the special ids (raising
    TokenizerModelError, a ValueError, naming the file), and keeps the model bytes so that
    ``sha256`` is the hash of exactly what was loaded. Picklable (ships the model bytes), so it
    can be handed to worker processes.
    """

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise TokenizerModelError(f"tokenizer model not found: {path}; {TRAIN_TOKENIZER_HINT}")
        self._load(str(model_path), path.read_bytes())

    def _load(self, model_path: str, model_bytes: bytes) -> None:
        self.model_path = model_path
        self._model_bytes = model_bytes
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, OSError) as e:
            raise TokenizerModelError(
                f"{model_path} is not a SentencePiece model ({' '.join(str(e).split())}); {TRAIN_TOKENIZER_HINT}"
            ) from None
        self.verify_special_ids()

    def __reduce__(self):
        return (_tokenizer_from_bytes, (self.model_path, self._model_bytes))

    def verify_special_ids(self) -> None:
        """Raise TokenizerModelError (a ValueError) unless ids 0-4 are exactly
        [PAD] [CLS] [SEP] [UNK] [MASK], with 0, 1, 2, 4 control symbols and 3 the unknown piece.
        The message names the model file, each mismatch, and the fix.
        """
        sp = self._sp
        problems = []
        if sp.get_piece_size() <= len(SPECIAL_IDS):
            problems.append(f"only {sp.get_piece_size()} pieces")
        else:
            for i, piece in zip(SPECIAL_IDS, SPECIAL_PIECES):
                actual = sp.id_to_piece(i)
                kind_ok = sp.is_unknown(i) if i == UNK_ID else sp.is_control(i)
                if actual != piece or not kind_ok:
                    kind = "unknown" if i == UNK_ID else "control"
                    problems.append(f"id {i} is {actual!r}, expected {kind} piece {piece!r}")
        if problems:
            raise TokenizerModelError(
                f"tokenizer model {self.model_path} does not have rtd_scale's fixed special ids "
                f"({'; '.join(problems)}); {TRAIN_TOKENIZER_HINT}"
            )

    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model, special pieces included (ids are 0 .. vocab_size-1)."""
        return self._sp.get_piece_size()

    pad_id = property(lambda self: PAD_ID, doc="[PAD] id, 0.")
    cls_id = property(lambda self: CLS_ID, doc="[CLS] id, 1.")
    sep_id = property(lambda self: SEP_ID, doc="[SEP] id, 2.")
    unk_id = property(lambda self: UNK_ID, doc="[UNK] id, 3.")
    mask_id = property(lambda self: MASK_ID, doc="[MASK] id, 4.")
    special_ids = property(lambda self: SPECIAL_IDS, doc="(0, 1, 2, 3, 4).")

    def encode(self, text: str) -> list[int]:
        """Token ids of ``normalize_text(text)``, no [CLS]/[SEP] added; [] for empty text.

        Never yields 0, 1, 2 or 4 (control symbols); unseen characters give UNK_ID (3).
        """
        return self._sp.encode(normalize_text(text))

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """:meth:`encode` for each text, in one SentencePiece call using ``num_threads`` threads
        (default 1: tools/preprocess_data.py parallelises with processes, --workers)."""
        return self._sp.encode([normalize_text(t) for t in texts], num_threads=num_threads)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; special (control) ids decode to nothing, [UNK] to " ⁇ "."""
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        """The piece string of ``token_id`` (e.g. "▁the"; "[MASK]" for 4)."""
        return self._sp.id_to_piece(int(token_id))

    def piece_to_id(self, piece: str) -> int:
        """The id of ``piece``; UNK_ID when the model has no such piece."""
        return self._sp.piece_to_id(piece)




def _tokenizer_from_bytes(model_path: str, model_bytes: bytes) -> Tokenizer:
    tok = Tokenizer.__new__(Tokenizer)
    tok._load(model_path, model_bytes)
    return tok


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


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
        raise TokenizerTrainingError(f"SentencePiece training failed: {message}") from None
    del sample
    trained = _tokenizer_from_bytes(str(model_path), model_bytes.getvalue())  # verifies the special ids
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
