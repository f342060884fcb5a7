"""The pipeline's tokenizer: SentencePiece models (ours or any other), Hugging Face
``tokenizer.json`` files and WordPiece ``vocab.txt`` files, with the special ids each defines;
what the preprocessor, the trainer and the export read. Making a tokenizer file is
``data/tokenizer_training.py``; the normalisation rule is ``data/normalize_text.py``.

Models trained by tools/train_tokenizer.py (``data/tokenizer_training.py``'s ``train_tokenizer``)
have fixed special ids (:meth:`Tokenizer.verify_special_ids` checks them after training):

| id | piece    | constant  | SentencePiece kind | role                                        |
|----|----------|-----------|--------------------|---------------------------------------------|
| 0  | `[PAD]`  | `PAD_ID`  | pad (control)      | padding; never a real token                 |
| 1  | `[CLS]`  | `CLS_ID`  | control symbol     | starts every packed sequence                |
| 2  | `[SEP]`  | `SEP_ID`  | control symbol     | ends a document / sequence                  |
| 3  | `[UNK]`  | `UNK_ID`  | unknown            | characters outside the model's coverage     |
| 4  | `[MASK]` | `MASK_ID` | control symbol     | the MLM mask token                          |

Ids 0, 1, 2 and 4 are SentencePiece *control* symbols: encoding text never produces them (the
literal text "[MASK]" becomes ordinary pieces), and decoding drops them. Encoding never adds
[CLS]/[SEP]; the packed dataset does.

Other tokenizers (bring your own): the special pieces are found by name, DeBERTaV3's appended
[MASK] is recognised, and a tokenizer lacking a pad or mask piece is refused in one line naming
the piece and how to add it (:class:`Tokenizer`). The rest of the pipeline takes every special id
from the tokenizer object (``tok.pad_id`` … ``tok.special_ids``), never from the constants above,
which describe only the models this project trains.

Normalisation happens once, in ``data/normalize_text.py``'s :func:`normalize_text`, identically when
the tokenizer is trained and whenever text is encoded (tests/unit/test_tokenizer.py's
normalisation tests). SentencePiece's own normaliser is set to ``identity`` so there is a single
rule, and ``decode(encode(t)) == normalize_text(t)`` for text the model covers. A tokenizer with
a normaliser of its own is the truth for its text: :func:`normalize_text` is applied only to
tokenizers without one (see :class:`Tokenizer`). :meth:`Tokenizer.save_pretrained` writes a
Hugging Face tokenizer that encodes like the pipeline, :func:`normalize_text` included.

Nothing here imports megatron-core or DeepSpeed; ``tokenizers`` and ``transformers`` are imported
only for tokenizer.json / vocab.txt files and for :meth:`Tokenizer.save_pretrained`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence

import numpy as np
import sentencepiece as spm

from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.normalize_text import (NORMALIZE_TEXT_RULE_NAME, normalize_text,
                                      normalize_text_charsmap, normalize_text_hf_normalizer)

__all__ = [
    "ADD_PIECES_TOOL",
    "CLS_ID",
    "DEBERTA_V3_PIECES",
    "MASK_ID",
    "PAD_ID",
    "ROLES",
    "SEP_ID",
    "SPECIAL_IDS",
    "SPECIAL_PIECES",
    "SPECIAL_PIECE_NAMES",
    "SpecialIds",
    "TRAINED_SPECIAL_IDS",
    "TRAIN_TOKENIZER_HINT",
    "Tokenizer",
    "TokenizerModelError",
    "UNK_ID",
    "file_sha256",
]

PAD_ID = 0
CLS_ID = 1
SEP_ID = 2
UNK_ID = 3
MASK_ID = 4
SPECIAL_IDS: tuple[int, ...] = (PAD_ID, CLS_ID, SEP_ID, UNK_ID, MASK_ID)
SPECIAL_PIECES: tuple[str, ...] = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")  # index == id
TRAIN_TOKENIZER_HINT = "train it with tools/train_tokenizer.py"
# The class Tokenizer.save_pretrained's tokenizer_config.json names: it loads tokenizer.json as
# written under transformers 4.x and 5.x
HF_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


# ---------------------------------------------------------------------------------------------
# Loading and encoding
# ---------------------------------------------------------------------------------------------


class TokenizerModelError(UserInputError):
    """The tokenizer file is missing, unreadable, or lacks a special piece the pipeline needs."""


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (used to tie shards to the tokenizer that wrote them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


ROLES: tuple[str, ...] = ("pad", "cls", "sep", "unk", "mask")
# How each special piece is found in a tokenizer that is not ours, first name first: BERT's and
# DeBERTa's bracket names, then the angle-bracket names of SentencePiece's defaults and RoBERTa.
SPECIAL_PIECE_NAMES: dict[str, tuple[str, ...]] = {
    "pad": ("[PAD]", "<pad>"),
    "cls": ("[CLS]", "<s>"),
    "sep": ("[SEP]", "</s>"),
    "unk": ("[UNK]", "<unk>"),
    "mask": ("[MASK]", "<mask>"),
}
# DeBERTaV3's spm.model (arXiv 2111.09543; microsoft/deberta-v3-*): these pieces at ids 0-3 and no
# mask piece. Hugging Face's DebertaV2Tokenizer adds "[MASK]" as a token after the model's pieces
# (id = piece count, 128000 for the released models); so do we.
DEBERTA_V3_PIECES: tuple[str, ...] = ("[PAD]", "[CLS]", "[SEP]", "[UNK]")
TokenizerKind = Literal["sentencepiece", "tokenizer.json", "vocab.txt"]
ADD_PIECES_TOOL = "tools/add_special_pieces.py"


@dataclass(frozen=True)
class SpecialIds:
    """The special ids a tokenizer gives the pipeline.

    pad: fills the tail of the last packed sample; never a real token, never in the RTD loss.
    cls / sep: open every packed sample / close every document and sample (``data/packed.py``).
    unk: what the tokenizer gives characters it cannot encode.
    mask: the MLM mask token (``objectives/masking.py``).
    others: every other special id of the tokenizer (SentencePiece control pieces, special added
        tokens of a tokenizer.json), ascending; like the five, never masked and never sampled.
    """

    pad: int
    cls: int
    sep: int
    unk: int
    mask: int
    others: tuple[int, ...] = ()

    def all(self) -> tuple[int, ...]:
        """(pad, cls, sep, unk, mask, *others), each id once: what RTDModel and masking take as
        ``special_ids``."""
        return tuple(dict.fromkeys((self.pad, self.cls, self.sep, self.unk, self.mask, *self.others)))


TRAINED_SPECIAL_IDS = SpecialIds(pad=PAD_ID, cls=CLS_ID, sep=SEP_ID, unk=UNK_ID, mask=MASK_ID)


class Tokenizer:
    """The pipeline's tokenizer: a SentencePiece model, a Hugging Face ``tokenizer.json`` or a
    WordPiece ``vocab.txt``, with the special ids it defines.

    ``Tokenizer(path)`` picks the format from the file name: ``*.json`` is a ``tokenizer.json``
    (read with the ``tokenizers`` library), ``*.txt`` a WordPiece vocabulary (one token per line,
    id = line number, as BERT's ``vocab.txt``), anything else a SentencePiece model.

    Special pieces (:class:`SpecialIds`):
    - a model with the layout tools/train_tokenizer.py writes has [PAD] 0, [CLS] 1, [SEP] 2,
      [UNK] 3, [MASK] 4;
    - otherwise each is found by name (:data:`SPECIAL_PIECE_NAMES`, the first name present
      wins); SentencePiece's unknown piece is [UNK] whatever its name;
    - DeBERTaV3's layout (:data:`DEBERTA_V3_PIECES` at ids 0-3 and no mask piece) gets [MASK]
      at id = piece count, as Hugging Face's DebertaV2Tokenizer does; ``vocab_size`` counts it;
    - any other tokenizer without a pad, cls, sep or mask piece is refused with one line naming
      the missing pieces and how to add them (SentencePiece's default layout, <unk> <s> </s>, has
      no pad or mask piece: ``tools/add_special_pieces.py`` appends them, keeping every id).

    Normalisation: :func:`normalize_text` is applied before encoding when the tokenizer has no
    normaliser of its own — a SentencePiece model whose normalisation rule is ``identity`` (every
    model tools/train_tokenizer.py writes; also ``NORMALIZE_TEXT_RULE_NAME``, the same model in
    a DeBERTa export) or a tokenizer.json whose ``normalizer`` is null.
    Otherwise the tokenizer's own normaliser is the only one (SentencePiece's ``nmt_nfkc``,
    BERT's lower-casing and accent stripping, …), so ids equal what that tokenizer gives in
    Hugging Face. A ``vocab.txt`` gets BERT's normaliser (``BertNormalizer``), lower-casing when
    no token outside ``[…]`` has an upper-case letter (an uncased vocabulary, e.g.
    bert-base-uncased) and keeping case otherwise.

    Attributes: ``model_path``; ``kind`` ("sentencepiece", "tokenizer.json", "vocab.txt");
    ``sha256``, the hash of the file's bytes, the one shards record; ``specials``
    (:class:`SpecialIds`) and ``special_pieces`` (role -> piece string, e.g. {"cls": "<s>", …});
    ``appended_mask`` (DeBERTaV3's layout); ``applies_normalize_text``. Picklable (ships the
    file's bytes), so it can be handed to worker processes.

    Raises:
        TokenizerModelError (a ValueError): the file is missing, unreadable, of an unknown
            format, or lacks a special piece; one line naming the file and the fix.
    """

    def __init__(self, model_path: str | Path) -> None:
        path = Path(model_path)
        if path.is_dir():
            raise TokenizerModelError(
                f"--tokenizer-model {path} is a directory; pass the file inside it (tokenizer.json, "
                f"the SentencePiece .model or vocab.txt)")
        if not path.is_file():
            raise TokenizerModelError(f"tokenizer model not found: {path}; {TRAIN_TOKENIZER_HINT}")
        self._load(str(model_path), path.read_bytes())

    def _load(self, model_path: str, model_bytes: bytes) -> None:
        self.model_path = model_path
        self._model_bytes = model_bytes
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self._sp: spm.SentencePieceProcessor | None = None
        self._hf = None  # tokenizers.Tokenizer for tokenizer.json / vocab.txt
        self.appended_mask = False
        name = Path(model_path).name
        if name.endswith(".json"):
            self.kind: TokenizerKind = "tokenizer.json"
            self._hf = _hf_from_json(model_path, model_bytes)
            self.applies_normalize_text = self._hf.normalizer is None
        elif name.endswith(".txt"):
            self.kind = "vocab.txt"
            self._hf = _hf_from_vocab_txt(model_path, model_bytes)
            self.applies_normalize_text = False
        else:
            self.kind = "sentencepiece"
            self._sp = spm.SentencePieceProcessor()
            if not model_bytes:
                raise TokenizerModelError(
                    f"--tokenizer-model {model_path}: the file is empty (0 bytes); pass a "
                    f"SentencePiece .model, a tokenizer.json or a vocab.txt, or {TRAIN_TOKENIZER_HINT}")
            try:
                self._sp.LoadFromSerializedProto(model_bytes)
            except (RuntimeError, OSError) as e:
                raise TokenizerModelError(
                    f"{model_path} is not a SentencePiece model ({' '.join(str(e).split())}); pass a "
                    f"SentencePiece .model, a tokenizer.json or a vocab.txt, or {TRAIN_TOKENIZER_HINT}"
                ) from None
            self.applies_normalize_text = _sp_proto(model_bytes).normalizer_spec.name in (
                "identity", NORMALIZE_TEXT_RULE_NAME)
        self.specials = self._find_specials()
        self.special_pieces = {role: self.id_to_piece(getattr(self.specials, role)) for role in ROLES}

    def __reduce__(self):
        return (_tokenizer_from_bytes, (self.model_path, self._model_bytes))

    # -- special pieces ------------------------------------------------------------------------

    def _piece_count(self) -> int:
        if self._sp is not None:
            return self._sp.get_piece_size()
        return max(self._hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def _find_by_name(self, role: str) -> int | None:
        for name in SPECIAL_PIECE_NAMES[role]:
            if self._sp is not None:
                i = self._sp.piece_to_id(name)
                if self._sp.id_to_piece(i) == name:
                    return i
            else:
                i = self._hf.token_to_id(name)
                if i is not None:
                    return i
        return None

    def _find_specials(self) -> SpecialIds:
        found = {role: self._find_by_name(role) for role in ROLES}
        n = self._piece_count()
        if self._sp is not None:
            found["unk"] = self._sp.unk_id()  # SentencePiece always has exactly one unknown piece
            if found["mask"] is None and n > 4 and tuple(self._sp.id_to_piece(i) for i in range(4)) == DEBERTA_V3_PIECES:
                found["mask"] = n
                self.appended_mask = True
        missing = [role for role in ROLES if found[role] is None]
        if missing:
            raise TokenizerModelError(f"tokenizer {self.model_path} has no {self._missing_text(missing)}; "
                                      f"{self._add_hint(missing)}")
        roles = set(found.values())
        if self._sp is not None:
            others = [i for i in range(n) if (self._sp.is_control(i) or self._sp.is_unknown(i)) and i not in roles]
        else:
            others = [i for i, t in self._hf.get_added_tokens_decoder().items() if t.special and i not in roles]
        return SpecialIds(**found, others=tuple(sorted(others)))

    @staticmethod
    def _missing_text(missing: Sequence[str]) -> str:
        return " and no ".join(f"{role} piece ({' or '.join(SPECIAL_PIECE_NAMES[role])})" for role in missing)

    def _add_hint(self, missing: Sequence[str]) -> str:
        first = [SPECIAL_PIECE_NAMES[role][0] for role in missing]
        if self.kind == "sentencepiece":
            return (f"add them with `python {ADD_PIECES_TOOL} --input {self.model_path} --output NEW.model` "
                    f"(appends them as control pieces after the existing ids), or {TRAIN_TOKENIZER_HINT}")
        if self.kind == "vocab.txt":
            return f"append the line(s) {' '.join(first)} to {self.model_path} (existing ids keep their values)"
        return (f"add them with the tokenizers library: tok = Tokenizer.from_file(path); "
                f"tok.add_special_tokens({first!r}); tok.save(path) (existing ids keep their values)")

    def verify_special_ids(self) -> None:
        """Raise TokenizerModelError (a ValueError) unless this is a SentencePiece model with the
        layout tools/train_tokenizer.py writes: ids 0-4 exactly [PAD] [CLS] [SEP] [UNK] [MASK],
        with 0, 1, 2, 4 control symbols and 3 the unknown piece. The message names the model
        file, each mismatch, and the fix. (Loading accepts other layouts; training checks this.)
        """
        sp = self._sp
        problems = []
        if sp is None:
            problems.append(f"a {self.kind}, not a SentencePiece model")
        elif sp.get_piece_size() <= len(SPECIAL_IDS):
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
        """Number of ids, special pieces included (ids are 0 .. vocab_size-1); DeBERTaV3's
        appended [MASK] counts."""
        return self._piece_count() + int(self.appended_mask)

    pad_id = property(lambda self: self.specials.pad, doc="[PAD] id (0 in models we train).")
    cls_id = property(lambda self: self.specials.cls, doc="[CLS] id (1 in models we train).")
    sep_id = property(lambda self: self.specials.sep, doc="[SEP] id (2 in models we train).")
    unk_id = property(lambda self: self.specials.unk, doc="[UNK] id (3 in models we train).")
    mask_id = property(lambda self: self.specials.mask, doc="[MASK] id (4 in models we train).")
    special_ids = property(lambda self: self.specials.all(),
                           doc="Every special id, each once: (pad, cls, sep, unk, mask, *others).")

    # -- encoding ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (normalised as the class docstring says), no [CLS]/[SEP] added;
        [] for empty text.

        SentencePiece never yields its control pieces (pad, cls, sep, mask in models we train);
        unseen characters give ``unk_id``. A tokenizer.json / vocab.txt turns the literal text of
        a special token ("[MASK]") into that token, as it does in Hugging Face.
        """
        if self.applies_normalize_text:
            text = normalize_text(text)
        if self._sp is not None:
            return self._sp.encode(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """:meth:`encode` for each text, in one call using ``num_threads`` threads (default 1:
        tools/preprocess_data.py parallelises with processes, --workers)."""
        if self.applies_normalize_text:
            texts = [normalize_text(t) for t in texts]
        if self._sp is not None:
            return self._sp.encode(list(texts), num_threads=num_threads)
        if num_threads == 1:  # tokenizers' batch call would start its own thread pool
            return [self._hf.encode(t, add_special_tokens=False).ids for t in texts]
        return [e.ids for e in self._hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of ``ids``; special ids decode to nothing, SentencePiece's [UNK] to " ⁇ "."""
        if isinstance(ids, np.ndarray):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        if self._sp is not None:
            n = self._sp.get_piece_size()
            return self._sp.decode([i for i in ids if i < n])
        return self._hf.decode(ids, skip_special_tokens=True)

    def id_to_piece(self, token_id: int) -> str:
        """The piece string of ``token_id`` (e.g. "▁the"; "[MASK]" for 4 in models we train)."""
        token_id = int(token_id)
        if self.appended_mask and token_id == self._sp.get_piece_size():
            return SPECIAL_PIECE_NAMES["mask"][0]
        if self._sp is not None:
            return self._sp.id_to_piece(token_id)
        return self._hf.id_to_token(token_id)

    def piece_to_id(self, piece: str) -> int:
        """The id of ``piece``; ``unk_id`` when the tokenizer has no such piece."""
        if self.appended_mask and piece == SPECIAL_PIECE_NAMES["mask"][0]:
            return self.mask_id
        if self._sp is not None:
            return self._sp.piece_to_id(piece)
        i = self._hf.token_to_id(piece)
        return self.unk_id if i is None else i

    def word_start_table(self) -> np.ndarray:
        """Whether each id begins a word, for whole-word and span masking
        (``objectives/masking.py``): [vocab_size] bool, indexed by id.

        The rule is the tokenizer's own piece convention: SentencePiece and Metaspace pieces
        begin a word when they start with "▁" (a byte-level BPE's with "Ġ"); WordPiece pieces
        (vocab.txt, or a tokenizer.json with a continuing-subword prefix) begin one unless they
        start with "##" (the prefix). Special ids are True (they are never masked).

        Raises:
            TokenizerModelError (a ValueError): a tokenizer.json whose pieces mark no word
                boundary by any of these conventions; one line naming the file and the fix.
        """
        if self._sp is not None:
            count, starts, marker = self._sp.get_piece_size(), True, "▁"
            piece = self._sp.id_to_piece
        else:
            count, (starts, marker) = self._piece_count(), self._hf_word_marker()
            piece = lambda i: self._hf.id_to_token(i) or ""  # noqa: E731  (holes in a vocab)
        table = np.ones(self.vocab_size, dtype=bool)
        for i in range(count):
            table[i] = piece(i).startswith(marker) == starts
        table[list(self.special_ids)] = True
        return table

    def _hf_word_marker(self) -> tuple[bool, str]:
        """(True, marker): a piece starting with marker begins a word; (False, prefix): a piece
        starting with prefix continues one (tokenizers' model and pre-tokenizer settings)."""
        data = json.loads(self._hf.to_str())
        model = data.get("model") or {}
        prefix = model.get("continuing_subword_prefix")
        if model.get("type") == "WordPiece" or prefix:
            return False, prefix or "##"

        def pre_tokenizers(node):
            if isinstance(node, dict):
                yield node
                for child in node.get("pretokenizers") or []:
                    yield from pre_tokenizers(child)

        for node in pre_tokenizers(data.get("pre_tokenizer")):
            if node.get("type") == "Metaspace":
                return True, node.get("replacement") or "▁"
            if node.get("type") == "ByteLevel":
                return True, "Ġ"
        raise TokenizerModelError(
            f"tokenizer {self.model_path} marks no word boundaries in its pieces (no '▁', 'Ġ' or "
            "'##' convention), so whole words are unknown; use --mask-strategy token")

    # -- Hugging Face ---------------------------------------------------------------------------

    def to_hf_backend(self, *, charsmap: bool = False):
        """A new ``tokenizers.Tokenizer`` that encodes text as :meth:`encode` does, with
        :func:`normalize_text` as its first normaliser where this tokenizer applies it, the five
        special pieces as special tokens at our ids, and BERT's template post-processor
        (``[CLS] A [SEP]``, pairs ``[CLS] A [SEP] B [SEP]``) with one token type, 0 (our
        encoders have a one-row token-type table). ``charsmap``: for a SentencePiece model that
        applies :func:`normalize_text`, put :func:`normalize_text_charsmap` (a ``Precompiled``
        step) before it: the ids do not change (normalize_text follows and redoes what the map
        does), and transformers 5's ``DebertaV2Tokenizer``, which keeps only that step of a
        tokenizer.json's normaliser, then encodes as the pipeline does.

        A SentencePiece model is converted with transformers' ``SpmConverter``
        (``build_tokenizer_from_spm_proto``, which follows the model's own normaliser settings).

        Raises:
            TokenizerModelError: a SentencePiece ``word`` / ``char`` model (no converter), or the
                converted tokenizer gives a special piece another id (named).
        """
        from tokenizers import AddedToken, normalizers, processors

        if self._sp is not None:
            from transformers.convert_slow_tokenizer import SpmConverter

            proto = _sp_proto(self._model_bytes)
            pieces = [(p.piece, p.score) for p in proto.pieces]
            if proto.trainer_spec.model_type == 1:  # unigram
                vocab = pieces
            elif proto.trainer_spec.model_type == 2:  # bpe
                vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
            else:
                raise TokenizerModelError(
                    f"{self.model_path}: only unigram and BPE SentencePiece models convert to a Hugging Face "
                    f"tokenizer; this one is a word/char model")
            backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab)
        elif self.kind == "tokenizer.json":
            backend = _hf_from_json(self.model_path, self._model_bytes)
        else:
            backend = _hf_from_vocab_txt(self.model_path, self._model_bytes)
        if self.applies_normalize_text:
            own = [backend.normalizer] if backend.normalizer is not None else []
            first = ([normalizers.Precompiled(normalize_text_charsmap())]
                     if charsmap and self._sp is not None else [])
            backend.normalizer = normalizers.Sequence([*first, normalize_text_hf_normalizer(), *own])
        pieces = self.special_pieces
        backend.add_special_tokens([AddedToken(pieces[r], special=True, normalized=False) for r in ROLES])
        wrong = [f"{pieces[r]} is {backend.token_to_id(pieces[r])}, ours {getattr(self.specials, r)}"
                 for r in ROLES if backend.token_to_id(pieces[r]) != getattr(self.specials, r)]
        if wrong:
            raise TokenizerModelError(f"{self.model_path}: the Hugging Face tokenizer gives other special ids "
                                      f"({'; '.join(wrong)})")
        cls, sep = pieces["cls"], pieces["sep"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:0 {sep}:0",
            special_tokens=[(cls, self.cls_id), (sep, self.sep_id)])
        return backend

    def save_pretrained(self, output_dir: str | Path, *, model_max_length: int | None = None,
                        sentencepiece_file: str | None = None,
                        model_input_names: list[str] | None = None) -> list[str]:
        """Write what ``transformers.AutoTokenizer.from_pretrained(output_dir)`` loads (offline):
        ``tokenizer.json`` (:meth:`to_hf_backend`) and ``tokenizer_config.json`` (class
        ``PreTrainedTokenizerFast``, the one class both transformers majors build from
        tokenizer.json as written: 5.x would record ``TokenizersBackend``, which 4.x does not
        have; pad/cls/sep/unk/mask tokens = our special pieces). The loaded
        tokenizer gives ``[cls_id] + encode(text) + [sep_id]`` for ``text``, the pipeline's
        packing of one document (tested on real sentences for every accepted layout); text holding
        the literal string of a special piece ("[MASK]") is the exception for SentencePiece
        models, whose control pieces never come from text while Hugging Face matches them.

        ``model_max_length``: the model's sequence length (tokens), recorded so that
        ``truncation=True`` cuts there; None leaves transformers' default (no limit).
        ``sentencepiece_file``: also write a SentencePiece model under this name, for a class
        that builds its tokenizer from one (``spm.model``: ``DebertaV2Tokenizer``):
        :meth:`sentencepiece_for_transformers`, with tokenizer.json's normaliser led by the same
        map (``to_hf_backend(charsmap=True)``), so that the class encodes as the pipeline on
        transformers 4.x and 5.x (tests/e2e/test_hf_export_transformers4.py). Only for a
        SentencePiece tokenizer; ignored for the others. ``model_input_names``: what the
        tokenizer returns, for a model class that takes no ``token_type_ids`` (ModernBERT's
        ``["input_ids", "attention_mask"]``: transformers 4.x returns token types otherwise).
        Each file is written under a temporary name and renamed; ``output_dir`` is created.
        Returns the paths written. Needs ``transformers`` and ``tokenizers`` (``rtd_scale[hf]``).
        """
        import shutil
        import tempfile

        from transformers import PreTrainedTokenizerFast

        pieces = self.special_pieces
        kwargs = {f"{r}_token": pieces[r] for r in ROLES}
        if model_max_length is not None:
            kwargs["model_max_length"] = int(model_max_length)
        if model_input_names is not None:
            kwargs["model_input_names"] = list(model_input_names)
        slow = sentencepiece_file if self._sp is not None else None
        hf = PreTrainedTokenizerFast(tokenizer_object=self.to_hf_backend(charsmap=bool(slow)),
                                     **kwargs)
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=out))
        try:
            paths = [Path(p) for p in hf.save_pretrained(str(staging))]
            config = staging / "tokenizer_config.json"
            settings = json.loads(config.read_text(encoding="utf-8"))
            settings["tokenizer_class"] = HF_TOKENIZER_CLASS
            config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")
            if slow:
                paths.append(staging / slow)
                paths[-1].write_bytes(self.sentencepiece_for_transformers())
            written = []
            for path in paths:
                if path.is_file():
                    os.replace(path, out / path.name)
                    written.append(str(out / path.name))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return written

    def sentencepiece_for_transformers(self) -> bytes:
        """This SentencePiece model's bytes, for a reader that runs the model alone (transformers
        4.x's slow ``DebertaV2Tokenizer``): where the pipeline applies :func:`normalize_text`,
        with that rule as the model's own normaliser (:func:`normalize_text_charsmap`, named
        ``NORMALIZE_TEXT_RULE_NAME``); the pieces, ids and scores are this model's. Else the
        model unchanged."""
        assert self._sp is not None, "a SentencePiece tokenizer"
        if not self.applies_normalize_text:
            return self._model_bytes
        proto = _sp_proto(self._model_bytes)
        proto.normalizer_spec.name = NORMALIZE_TEXT_RULE_NAME
        proto.normalizer_spec.precompiled_charsmap = normalize_text_charsmap()
        proto.normalizer_spec.remove_extra_whitespaces = True  # the rule's collapse and strip
        return proto.SerializeToString()


def _tokenizer_from_bytes(model_path: str, model_bytes: bytes) -> Tokenizer:
    tok = Tokenizer.__new__(Tokenizer)
    tok._load(model_path, model_bytes)
    return tok


def _sp_proto(model_bytes: bytes):
    """The SentencePiece ``ModelProto`` of ``model_bytes`` (sentencepiece's own protobuf module)."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    return proto


def _require_tokenizers(model_path: str):
    try:
        import tokenizers
    except ImportError:
        raise TokenizerModelError(f"reading {model_path} needs the tokenizers library: pip install "
                                  "'rtd_scale[hf]' (or pass a SentencePiece .model)") from None
    return tokenizers


def _hf_from_json(model_path: str, data: bytes):
    tokenizers = _require_tokenizers(model_path)
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # a UnicodeDecodeError, or the bare Exception tokenizers raises
        raise TokenizerModelError(f"{model_path} is not a Hugging Face tokenizer.json "
                                  f"({' '.join(str(e).split())[:200]}); pass the tokenizer.json that "
                                  "tokenizers' Tokenizer.save wrote") from None


def _hf_from_vocab_txt(model_path: str, data: bytes):
    """BERT's WordPiece tokenizer over ``vocab.txt`` (one token per line, id = line number), as
    transformers' BertTokenizer builds it; lower-cases unless the vocabulary has upper-case
    tokens (see :class:`Tokenizer`)."""
    tokenizers = _require_tokenizers(model_path)
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerModelError(f"{model_path} is not a UTF-8 vocab.txt; pass BERT's vocab.txt "
                                  "(one token per line)") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab = {token.rstrip("\r"): i for i, token in enumerate(lines)}
    if not vocab:
        raise TokenizerModelError(f"{model_path} is an empty vocab.txt; pass BERT's vocab.txt (one token per line)")
    unk = next((name for name in SPECIAL_PIECE_NAMES["unk"] if name in vocab), None)
    if unk is None:
        raise TokenizerModelError(f"tokenizer {model_path} has no unk piece ([UNK] or <unk>); append the line "
                                  f"[UNK] to {model_path} (existing ids keep their values)")
    cased = any(c.isupper() for token in vocab if not (token.startswith("[") and token.endswith("]")) for c in token)
    tok = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=not cased)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    present = [name for names in SPECIAL_PIECE_NAMES.values() for name in names if name in vocab]
    tok.add_special_tokens(present)  # as BertTokenizer: never split, matched in text
    return tok
