"""Token shards: megatron-core ``IndexedDataset`` files plus a small sidecar.

A shard with prefix ``P`` is

- ``P.bin`` — every document's token ids back to back, no header (megatron-core's format);
- ``P.idx`` — megatron-core's index: dtype code, per-sequence lengths and byte offsets, and the
  document boundaries. Here one sequence is one document (``add_document(ids, [len(ids)])``,
  like Megatron-LM's ``preprocess_data.py`` without ``--split-sentences``);
- ``P.meta.json`` — our sidecar: ``vocab_size``, ``tokenizer_model`` (path as given),
  ``tokenizer_model_sha256``, ``documents``, ``tokens``, ``empty_documents_skipped``, ``dtype``.
  Optional: shards from Megatron-LM's own preprocessing have none and still load.

Writing is atomic per shard: ``.bin`` and ``.idx`` are written under temporary names in the same
directory; on commit the old ``.idx`` and sidecar are removed, the new ``.bin`` and sidecar renamed
into place, and the new ``.idx`` renamed last. A shard is complete iff its ``.idx`` exists, so a
crash at any point leaves either the old shard, the new one, or no shard — never a new ``.bin``
with an old ``.idx``. On abort the temporary files are deleted and existing files are untouched.

Tools and tests read shards with megatron-core's ``IndexedDataset`` (:func:`open_shard`), imported
lazily (~4 s, it pulls in torch) with its import-time warnings silenced; training reads them with
numpy memory maps (rtd_scale/data/packed.py) through :func:`read_index_header` / :func:`read_index`
(tested to agree with ``IndexedDataset``). Writing
uses this module's own writer of the same format (:func:`write_index`; byte-identical to
megatron-core's ``IndexedDatasetBuilder``, tested), because the builder needs torch: importing it
would cost every preprocessing run ~4 s and ~320 MB before its first document, and its index
writer loops in Python per sequence.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import struct
import warnings
from typing import Any, Sequence

import numpy as np

from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.tokenizer import file_sha256

__all__ = [
    "META_SUFFIX",
    "ShardMismatchError",
    "ShardWriter",
    "check_tokenizer_matches",
    "dtype_for_vocab",
    "MANIFEST_SUFFIX",
    "open_shard",
    "read_index",
    "read_index_header",
    "read_manifest",
    "read_shard_meta",
    "resolve_data_path",
    "shard_paths",
    "write_index",
    "write_manifest",
]

META_SUFFIX = ".meta.json"
MANIFEST_SUFFIX = ".manifest.json"
_META_FORMAT = "rtd_scale.shard_meta.v1"
_MANIFEST_FORMAT = "rtd_scale.dataset_manifest.v1"
_REPROCESS_HINT = "use the tokenizer the shards were made with, or re-run tools/preprocess_data.py with this tokenizer"


class ShardMismatchError(UserInputError):
    """The shards were written with a different tokenizer than the one in use (a ValueError)."""


def _indexed_dataset_module():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit, raised at import
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def shard_paths(prefix: str | os.PathLike) -> tuple[str, str, str]:
    """``(P.bin, P.idx, P.meta.json)`` for prefix ``P`` (the prefix itself has no suffix)."""
    p = os.fspath(prefix)
    return p + ".bin", p + ".idx", p + META_SUFFIX


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest dtype holding every id in ``[0, vocab_size)``.

    ``uint16`` when ``vocab_size <= 65536`` (largest id 65535), else ``int32`` (megatron-core's
    IndexedDataset has no uint32). So 65,535 and 65,536 give uint16 and 128,100 gives int32.
    Note megatron-core's own ``DType.optimal_dtype`` switches at 65,500; this rule is exact.
    Raises ValueError for ``vocab_size < 1`` or ``> 2**31``.
    """
    if not 1 <= vocab_size <= 2**31:
        raise ValueError(f"vocab_size must be in [1, 2**31], got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


# megatron-core's .idx layout (megatron/core/datasets/indexed_dataset.py, _IndexWriter/_IndexReader):
# magic, version 1 (<Q), dtype code (<B), sequence count (<Q), document count (<Q), then
# int32 lengths[sequences], int64 byte pointers[sequences], int64 document indices[documents].
_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
                np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}


def write_index(idx_path: str, dtype: np.dtype, lengths: np.ndarray, document_indices: np.ndarray) -> None:
    """Write a megatron-core ``.idx`` file: ``lengths`` [sequences] tokens per sequence,
    ``document_indices`` [documents + 1] (0, then the sequence index ending each document).
    Byte-identical to ``IndexedDatasetBuilder.finalize`` for the same sequences."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(lengths.size, dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(idx_path, "wb") as f:
        f.write(_INDEX_MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _DTYPE_CODES[dtype]))
        f.write(struct.pack("<Q", lengths.size) + struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(document_indices, dtype=np.int64).tobytes(order="C"))


def read_index_header(idx_path: str) -> tuple[np.dtype, int, int]:
    """(token dtype, sequence count, document-index entries = documents + 1) from the fixed header
    of a megatron-core ``.idx`` file. Raises UserInputError naming the file if it is not one."""
    codes = {v: k for k, v in _DTYPE_CODES.items()}
    with open(idx_path, "rb") as f:
        head = f.read(len(_INDEX_MAGIC) + 8 + 1 + 8 + 8)
    if len(head) < 34 or head[:9] != _INDEX_MAGIC or struct.unpack("<Q", head[9:17])[0] != 1 \
            or head[17] not in codes:
        raise UserInputError(f"{idx_path} is not a megatron-core index (.idx) file; re-create the shard "
                             "with tools/preprocess_data.py")
    sequences, document_entries = struct.unpack("<QQ", head[18:34])
    return codes[head[17]], sequences, document_entries


def read_index(idx_path: str) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(dtype, lengths [sequences] int32, document_indices [documents + 1] int64) of a megatron-core
    ``.idx`` file, read into memory. Raises UserInputError naming the file if it is not one."""
    dtype, sequences, documents = read_index_header(idx_path)
    with open(idx_path, "rb") as f:
        f.seek(34)
        lengths = np.fromfile(f, dtype=np.int32, count=sequences)
        f.seek(sequences * 8, os.SEEK_CUR)  # pointers: implied by the lengths
        document_indices = np.fromfile(f, dtype=np.int64, count=documents)
    if lengths.size != sequences or document_indices.size != documents:
        raise UserInputError(f"{idx_path} is truncated; re-create the shard with tools/preprocess_data.py")
    return dtype, lengths, document_indices


class ShardWriter:
    """Write one shard ``prefix.{bin,idx,meta.json}``, one document per entry, atomically.

    Use as a context manager (commits on success, aborts on an exception), or call
    :meth:`add_document` then :meth:`commit` / :meth:`abort`. ``dtype`` defaults to
    :func:`dtype_for_vocab`. ``tokenizer_model`` is the ``.model`` file the ids came from; its
    path and SHA-256 go into the sidecar (``None`` for ids with no tokenizer, e.g. tests).
    """

    def __init__(
        self,
        prefix: str | os.PathLike,
        *,
        vocab_size: int,
        tokenizer_model: str | os.PathLike | None = None,
        dtype: np.dtype | type | None = None,
    ) -> None:
        self.prefix = os.fspath(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = np.dtype(dtype) if dtype is not None else dtype_for_vocab(self.vocab_size)
        if self.dtype not in (np.dtype(np.uint16), np.dtype(np.int32)):
            raise ValueError(f"shard dtype must be uint16 or int32, got {self.dtype}")
        if self.vocab_size - 1 > np.iinfo(self.dtype).max:
            raise ValueError(f"dtype {self.dtype} cannot hold ids up to {self.vocab_size - 1}; use int32")
        self.tokenizer_model = os.fspath(tokenizer_model) if tokenizer_model is not None else None
        self.tokenizer_sha256 = file_sha256(self.tokenizer_model) if self.tokenizer_model else None
        self.documents = 0
        self.tokens = 0
        self.empty_documents_skipped = 0

        directory, name = os.path.split(os.path.abspath(self.prefix))
        os.makedirs(directory, exist_ok=True)
        # Unique temporary names (pid + random) in the target directory, so the final renames are
        # atomic and two writers never share a temporary file; created with the usual umask.
        tmp_stem = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}")
        self._tmp_bin, self._tmp_idx, self._tmp_meta = (tmp_stem + s for s in (".bin.tmp", ".idx.tmp", ".meta.tmp"))
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []  # int32 tokens per sequence, in chunks
        self._document_ends: list[np.ndarray] = []  # int64 sequence index ending each document
        self._sequences = 0
        self._closed = False

    def add_document(self, ids: Sequence[int] | np.ndarray) -> bool:
        """Append one document. Empty ``ids`` are not written but counted as skipped.

        Returns True if written. Raises ValueError if an id is negative or ``>= vocab_size``
        (never a silent wrap-around into the shard dtype), TypeError for non-integer ids.
        """
        arr = np.asarray(ids)
        if arr.size == 0:
            assert not self._closed, "ShardWriter already committed or aborted"
            self.empty_documents_skipped += 1
            return False
        if arr.ndim != 1:
            raise TypeError(f"a document must be a 1-D sequence of integer ids, got {arr.dtype} shape {arr.shape}")
        self.add_documents(arr, np.array([arr.size]))
        return True

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append several documents at once: ``ids`` [sum(lengths)] integer ids back to back,
        ``lengths`` [n] tokens per document (0 = an empty document: counted, not written).

        One write for the whole batch (the preprocessor's hot path). Raises as :meth:`add_document`.
        """
        assert not self._closed, "ShardWriter already committed or aborted"
        ids = np.asarray(ids)
        lengths = np.asarray(lengths, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise TypeError(f"documents must be 1-D integer ids, got {ids.dtype} shape {ids.shape}")
        if int(lengths.sum()) != ids.size or (lengths < 0).any():
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {ids.size} ids were given")
        empty = int((lengths == 0).sum())
        self.empty_documents_skipped += empty
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"token id {bad} is outside [0, {self.vocab_size}) for shard {self.prefix} "
                f"(vocab_size {self.vocab_size}); the ids come from a different tokenizer"
            )
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes(order="C"))
        kept = lengths[lengths > 0]
        # one sequence per document (see module docstring)
        self._append_index(kept, np.arange(1, len(kept) + 1, dtype=np.int64))
        self.documents += len(kept)
        self.tokens += ids.size

    def _append_index(self, lengths: np.ndarray, document_ends: np.ndarray) -> None:
        if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
            raise ValueError(f"a sequence of {int(lengths.max())} tokens exceeds the index's int32 length")
        self._lengths.append(lengths.astype(np.int32))
        self._document_ends.append(document_ends + self._sequences)
        self._sequences += lengths.size

    def add_shard(self, prefix: str | os.PathLike) -> None:
        """Append every document of the shard at ``prefix`` as it is: its index entries and
        document boundaries (several sequences per document in a Megatron-LM ``--split-sentences``
        shard stay so), its ``.bin`` copied in blocks — what megatron-core's
        ``IndexedDatasetBuilder.add_index`` does. Raises UserInputError if its dtype differs."""
        assert not self._closed, "ShardWriter already committed or aborted"
        bin_path, idx_path, _ = shard_paths(prefix)
        dtype, lengths, document_indices = read_index(idx_path)
        if dtype != self.dtype:
            raise UserInputError(f"shard {os.fspath(prefix)} holds {dtype.name} ids but the output is "
                                 f"{self.dtype.name}; shards made with the same tokenizer share a dtype")
        self._append_index(lengths, document_indices[1:].astype(np.int64))
        with open(bin_path, "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)
        self.documents += len(document_indices) - 1
        self.tokens += int(lengths.sum(dtype=np.int64))

    @property
    def bin_bytes(self) -> int:
        """Bytes of token data written so far."""
        return self.tokens * self.dtype.itemsize

    def meta(self) -> dict[str, Any]:
        """The sidecar contents as of now."""
        return {
            "format": _META_FORMAT,
            "vocab_size": self.vocab_size,
            "tokenizer_model": self.tokenizer_model,
            "tokenizer_model_sha256": self.tokenizer_sha256,
            "documents": self.documents,
            "tokens": self.tokens,
            "empty_documents_skipped": self.empty_documents_skipped,
            "dtype": self.dtype.name,
        }

    def commit(self, extra_meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """Finish the index and move the shard into place (see module docstring); returns the
        sidecar (``extra_meta`` is added to it, e.g. the preprocessor's resume position)."""
        assert not self._closed, "ShardWriter already committed or aborted"
        self._closed = True
        bin_path, idx_path, meta_path = shard_paths(self.prefix)
        try:
            self._bin.close()
            write_index(self._tmp_idx, self.dtype,
                        np.concatenate([np.zeros(0, np.int32), *self._lengths]),
                        np.concatenate([np.zeros(1, np.int64), *self._document_ends]))
            meta = {**self.meta(), **(extra_meta or {})}
            with open(self._tmp_meta, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=2)
                f.write("\n")
            for old in (idx_path, meta_path):  # the .idx marks a complete shard: drop it first
                if os.path.lexists(old):
                    os.remove(old)
            os.replace(self._tmp_bin, bin_path)
            os.replace(self._tmp_meta, meta_path)
            os.replace(self._tmp_idx, idx_path)
        except BaseException:
            self._remove_temps()
            raise
        return meta

    def abort(self) -> None:
        """Delete the temporary files; existing files at the prefix are left as they were."""
        if self._closed:
            return
        self._closed = True
        try:
            self._bin.close()
        finally:
            self._remove_temps()

    def _remove_temps(self) -> None:
        for p in (self._tmp_bin, self._tmp_idx, self._tmp_meta):
            if os.path.lexists(p):
                os.remove(p)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def read_shard_meta(prefix: str | os.PathLike) -> dict[str, Any] | None:
    """The sidecar ``prefix.meta.json`` as a dict, or None when there is none (e.g. a shard from
    Megatron-LM's preprocessing). Raises UserInputError if it exists but is not valid JSON.
    """
    meta_path = shard_paths(prefix)[2]
    try:
        with open(meta_path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"shard sidecar {meta_path} is not valid JSON ({e}); delete it or re-run tools/preprocess_data.py") from None


def open_shard(prefix: str | os.PathLike):
    """Open a shard as megatron-core's ``IndexedDataset`` (memory-mapped ``.bin``).

    ``len(ds)`` is the number of documents; ``ds[i]`` is document ``i``'s ids (numpy array of the
    shard dtype). Raises FileNotFoundError naming the missing ``.bin`` / ``.idx`` path.

    Keep ``ds`` referenced while using its arrays: they are views of the mmap, which megatron-core
    closes in ``__del__``, so touching them after ``ds`` is garbage-collected is a segfault
    (``open_shard(p)[0].tolist()`` in one expression is fine; storing ``open_shard(p)[0:2]`` is not).
    Copy (``np.array(ds[i])``) what must outlive it.
    """
    bin_path, idx_path, _ = shard_paths(prefix)
    missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(
            f"shard {os.fspath(prefix)} is incomplete: {' and '.join(missing)} not found "
            f"(pass the prefix without .bin/.idx, as printed by tools/preprocess_data.py)"
        )
    return _indexed_dataset_module().IndexedDataset(os.fspath(prefix), multimodal=False, mmap=True)


def check_tokenizer_matches(
    prefix: str | os.PathLike, tokenizer_model_path: str | os.PathLike | None, vocab_size: int
) -> str | None:
    """Raise ShardMismatchError (a ValueError) if the shard at ``prefix`` was not written with this
    tokenizer.

    ``vocab_size`` is the tokenizer's own size (``Tokenizer.vocab_size``), not a padded model
    vocabulary. With a sidecar: its ``vocab_size`` and ``tokenizer_model_sha256`` must equal
    ``vocab_size`` and the SHA-256 of ``tokenizer_model_path`` (hash skipped when either side has
    none). Without a sidecar (Megatron-LM shards): every id in the ``.bin`` must be
    ``< vocab_size`` — one numpy max over the memory-mapped file, O(tokens).

    Returns None when the sidecar proved the match, else a one-line ``note: …`` saying that only
    the id range could be checked (no sidecar: another tokenizer of the same size would pass).
    """
    prefix = os.fspath(prefix)
    meta = read_shard_meta(prefix)
    if meta is not None:
        shard_vocab = meta.get("vocab_size")
        shard_sha = meta.get("tokenizer_model_sha256")
        run_sha = file_sha256(tokenizer_model_path) if tokenizer_model_path is not None else None
        vocab_differs = shard_vocab != vocab_size
        sha_differs = shard_sha is not None and run_sha is not None and shard_sha != run_sha
        if vocab_differs or sha_differs:
            raise ShardMismatchError(
                f"shard {prefix} was written with tokenizer {meta.get('tokenizer_model')} "
                f"(vocab_size {shard_vocab}, sha256 {str(shard_sha)[:12]}) but this run uses "
                f"{tokenizer_model_path} (vocab_size {vocab_size}, sha256 {str(run_sha)[:12]}); {_REPROCESS_HINT}"
            )
        return
    bin_path, idx_path, _ = shard_paths(prefix)
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise UserInputError(f"shard {prefix} is incomplete: {path} not found; pass a prefix "
                                 "printed by tools/preprocess_data.py")
    dtype = read_index_header(idx_path)[0]
    unverified = (f"note: shard {prefix} has no {META_SUFFIX} sidecar, so the tokenizer it was "
                  f"made with cannot be verified")
    if os.path.getsize(bin_path) == 0:
        return f"{unverified} (it holds no tokens)"
    max_id = int(np.memmap(bin_path, dtype=dtype, mode="r").max())
    if max_id >= vocab_size:
        raise ShardMismatchError(
            f"shard {prefix} (no {META_SUFFIX} sidecar) contains token id {max_id} but tokenizer "
            f"{tokenizer_model_path} has vocab_size {vocab_size}; {_REPROCESS_HINT}"
        )
    return (f"{unverified}: its ids fit {tokenizer_model_path} (largest {max_id} < {vocab_size}), "
            "which is all that can be checked; make sure it was made with that tokenizer")


# -- datasets of several shards -------------------------------------------------------------------


def write_manifest(dataset_prefix: str | os.PathLike, shard_prefixes: Sequence[str | os.PathLike],
                   **fields: Any) -> str:
    """Write ``dataset_prefix.manifest.json`` (atomically) listing ``shard_prefixes``.

    A *dataset prefix* names one corpus written as several shards: tools/preprocess_data.py writes
    ``D_00000``, ``D_00001``, … and then this manifest, last, so its presence means every shard is
    complete. Shard names are stored relative to the manifest's directory (the directory can be
    moved). ``fields`` (totals, tokenizer, …) are stored alongside. Returns the manifest path.
    """
    from rtd_scale.atomic import write_atomic

    path = os.fspath(dataset_prefix) + MANIFEST_SUFFIX
    directory = os.path.dirname(os.path.abspath(path))
    names = [os.path.relpath(os.path.abspath(os.fspath(p)), directory) for p in shard_prefixes]
    body = {"format": _MANIFEST_FORMAT, "shards": names, **fields}
    write_atomic(path, json.dumps(body, indent=2) + "\n")
    return path


def read_manifest(dataset_prefix: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of ``dataset_prefix`` with ``shards`` made absolute prefixes, or None if there
    is none. Raises UserInputError if it is not valid JSON or lists no shards."""
    path = os.fspath(dataset_prefix) + MANIFEST_SUFFIX
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserInputError(f"dataset manifest {path} is not valid JSON ({e}); re-run "
                             "tools/preprocess_data.py --resume to rewrite it") from None
    shards = body.get("shards") if isinstance(body, dict) else None
    if not isinstance(shards, list) or not shards or not all(isinstance(n, str) for n in shards):
        raise UserInputError(f"dataset manifest {path} lists no shards (field 'shards'); re-run "
                             "tools/preprocess_data.py --resume to rewrite it")
    directory = os.path.dirname(os.path.abspath(path))
    body["shards"] = [os.path.join(directory, n) for n in shards]
    return body


def resolve_data_path(prefix: str | os.PathLike, flag: str = "--data-path") -> list[str]:
    """The shard prefixes that ``prefix`` (one ``--data-path`` entry) stands for.

    - ``prefix.idx`` exists: the prefix is one shard (a merged shard, or one from Megatron-LM's
      own tools/preprocess_data.py) → ``[prefix]``;
    - else ``prefix.manifest.json`` exists: the dataset written by our tools/preprocess_data.py →
      its shards in order (each checked to be complete);
    - else UserInputError (naming ``flag``, both files looked for and the fix) (including an interrupted
      preprocessing run, which leaves shards but no manifest: re-run it with ``--resume``).
    """
    p = os.fspath(prefix)
    for suffix in (".bin", ".idx", MANIFEST_SUFFIX, META_SUFFIX):
        if p.endswith(suffix):
            raise UserInputError(f"{flag} {p}: pass the prefix without the {suffix} suffix "
                                 f"(e.g. {p[: -len(suffix)]}), as printed by tools/preprocess_data.py")
    manifest = read_manifest(p)
    if os.path.isfile(p + ".idx"):
        if manifest is not None:
            raise UserInputError(f"{flag} {p}: both a shard ({p}.idx) and a dataset manifest "
                                 f"({p}{MANIFEST_SUFFIX}) exist; remove the stale one")
        return [p]
    if manifest is None:
        partial = sorted(n for n in os.listdir(os.path.dirname(os.path.abspath(p)) or ".")
                         if n.startswith(os.path.basename(p) + "_") and n.endswith(".idx")) \
            if os.path.isdir(os.path.dirname(os.path.abspath(p))) else []
        hint = (f"; {len(partial)} shard(s) {os.path.basename(p)}_*.idx exist without a manifest: "
                "the preprocessing run did not finish — re-run it with --resume" if partial else
                "; pass the prefix printed by tools/preprocess_data.py")
        raise UserInputError(f"{flag} {p}: neither a shard ({p}.idx) nor a dataset manifest "
                             f"({p}{MANIFEST_SUFFIX}) exists{hint}")
    for shard in manifest["shards"]:
        missing = [f for f in shard_paths(shard)[:2] if not os.path.isfile(f)]
        if missing:
            raise UserInputError(f"{flag} {p}: shard {shard} listed in {p}{MANIFEST_SUFFIX} is "
                                 f"incomplete ({' and '.join(missing)} not found); re-run "
                                 "tools/preprocess_data.py with the same arguments and --resume")
    return manifest["shards"]
