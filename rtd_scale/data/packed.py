"""Packed [CLS] … [SEP] samples over token shards, with a cached sample index and a seeded order.

Packing (RoBERTa's FULL-SENTENCES, arXiv 1907.11692 §4.2): the documents of a dataset's shards, in
order, each followed by one [SEP], form one token stream; with C = seq_length − 2, sample i is
``[CLS] + stream[i·C : (i+1)·C] + [SEP]``. Documents are concatenated across sample boundaries, so
a corpus of one-sentence documents packs as densely as one of books
(tests/unit/test_packed.py::test_one_sentence_documents_pack_across_boundaries). The last sample
takes the stream's remainder and is padded with [PAD] after its [SEP], so every document is
reachable (N = ceil(stream tokens / C) samples; a corpus shorter than one sample gives one padded
sample).

Document-masked packing (``DataConfig.document_masking``, ``--reset-attention-mask``; ModernBERT,
arXiv 2412.13663, and Megatron-LM's ``--reset-attention-mask`` / ``--reset-position-ids``): the
samples stay the same; each also gets its document ids (``PackedDataset.sample``), read from the
index, and the model attends within a document and restarts positions at each
(``model/document_mask.py``).

Documents (megatron-core's ``.idx``): a shard holds *sequences* (``sequence_lengths``,
``sequence_pointers`` in bytes) grouped into *documents* by ``document_indices``. Our
tools/preprocess_data.py writes one sequence per document; Megatron-LM's with ``--split-sentences``
writes one per sentence. Either way a document's sequences are back to back in ``.bin``, and one
document is one [SEP]-terminated run of the stream. Empty documents contribute nothing (no lone
[SEP]). Shards are read with numpy memory maps opened lazily (STYLE rule 10), not through
megatron-core's ``IndexedDataset``, whose views die with the object and whose import costs seconds.

Splits (Megatron-LM's ``--split 969,30,1``): a dataset's documents are cut into contiguous ranges
train / valid / test by cumulative rounding of the normalised weights; each range is packed on its
own stream.

Sample index (Megatron-LM's ``sample_idx`` idea): for each split the stream position of every
sample start as (document, offset) pairs, int64 [N + 1, 2], plus each document's first token in
the dataset's token coordinates, int64 [D + 1]. Both are built once and cached as ``.npy`` files
(loaded with ``mmap_mode="r"``) under the cache directory — ``--data-cache-path``, by default
``index-cache/`` next to the first shard — keyed by the shards' identity (``ShardIndex.identity``: path, and of every ``.bin``/``.idx``
device, inode, size, mtime and change time, which any write changes, even one that keeps size
and mtime as ``cp -p`` and ``rsync -t`` do), seq_length, the split and the tokenizer's [CLS] /
[SEP] / [PAD] ids (``Tokenizer.specials``), so changed shards are re-indexed (and a copy of
them, a new inode, indexed once more).
Files are written under a unique temporary name and renamed, so ranks building the same index at
once are safe. An unwritable cache directory falls back to memory with one warning.
A build that takes longer than ``PROGRESS_INTERVAL_S`` prints progress lines on stderr (rank 0
only; every rank builds the same index), as tools/preprocess_data.py does; a quick one prints
nothing.

Order (STYLE rule 10): a split's epoch e is ``default_rng([seed, e, *stream]).permutation(N)``,
cached per epoch like the index. The k-th sample a run consumes (counting from 0 over the whole
run) is ``order(seed, k div N)[k mod N]``; k is the *global sample index* that keys the masks
(``objectives/masking.py``), so an epoch's repeat of a sample is masked afresh (dynamic masking,
RoBERTa) yet every mask is a pure function of (seed, k).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import sys
import time
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.shards import read_index, read_index_header, resolve_data_path
from rtd_scale.data.tokenizer import TRAINED_SPECIAL_IDS, SpecialIds

_INDEX_FORMAT = "rtd_scale.sample_index.v1"
DEFAULT_CACHE_DIR = "index-cache"  # next to the first shard of a dataset
_PART_NAMES = ("train", "valid", "test")  # the parts of --split
# seconds between progress lines of an index build; a shorter build prints none
PROGRESS_INTERVAL_S = 10.0


class BuildProgress:
    """Progress of one sample-index build, on stderr: a line at most every
    ``PROGRESS_INTERVAL_S`` seconds while it runs, and a closing line when it took at least that
    long; nothing for a quick build or a cache hit. Only rank 0 of a launch prints (``RANK``,
    else ``SLURM_PROCID``)."""

    def __init__(self, what: str):
        self.what = what
        self.start = self.last = time.monotonic()
        self.built = False
        rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID") or "0"
        self.quiet = rank.strip() != "0"

    def run(self, build: Callable[[], np.ndarray]) -> np.ndarray:
        """``build()``, recorded as built (the cache missed)."""
        self.built = True
        return build()

    def update(self, done: int, total: int, unit: str) -> None:
        """``done`` of ``total`` ``unit`` (e.g. "shards read") so far."""
        self.built = True
        now = time.monotonic()
        if now - self.last >= PROGRESS_INTERVAL_S:
            self.last = now
            self._print(f"building {self.what}: {done:,} of {total:,} {unit} "
                        f"({now - self.start:.0f} s)")

    def finish(self, result: str) -> None:
        """The closing line, ``result`` being what was built (e.g. "1,234 samples")."""
        elapsed = time.monotonic() - self.start
        if self.built and elapsed >= PROGRESS_INTERVAL_S:
            self._print(f"built {self.what}: {result} in {elapsed:.0f} s")

    def _print(self, line: str) -> None:
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)


class ShardIndex:
    """One shard ``P.bin`` / ``P.idx``, read with numpy memory maps opened on first use.

    Attributes:
        prefix: the shard prefix.
        dtype: token dtype of ``P.bin``.
        num_documents, num_tokens: from the index.
    Raises:
        UserInputError: a file is missing, the ``.idx`` is not megatron-core's format, or the
            ``.bin`` does not match it (naming the file and the fix).
    """

    def __init__(self, prefix: str):
        self.prefix = os.fspath(prefix)
        self.bin_path, self.idx_path = self.prefix + ".bin", self.prefix + ".idx"
        missing = [p for p in (self.idx_path, self.bin_path) if not os.path.isfile(p)]
        if missing:
            raise UserInputError(f"shard {self.prefix} is incomplete: {' and '.join(missing)} not "
                                 "found; pass a prefix printed by tools/preprocess_data.py")
        self.dtype, self.num_sequences, doc_entries = read_index_header(self.idx_path)
        if doc_entries < 1:
            raise UserInputError(f"{self.idx_path}: the document index is empty; re-run "
                                 "tools/preprocess_data.py")
        self.num_documents = doc_entries - 1
        self._tokens: Optional[np.ndarray] = None

    def __getstate__(self) -> dict:  # loader workers reopen the maps (never pickle them)
        return {**self.__dict__, "_tokens": None}

    def document_token_starts(self) -> np.ndarray:
        """int64 [num_documents + 1]: document d is tokens [s[d], s[d+1]) of ``P.bin`` (a
        document's sequences are back to back; megatron-core's pointers are the cumulative
        lengths). Reads the whole index (``shards.read_index``): done once, when the cache is
        built.

        Raises:
            UserInputError: ``P.bin`` has another size than the index says, or the document index
                is malformed.
        """
        _, lengths, doc_idx = read_index(self.idx_path)
        cum = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths, out=cum[1:])
        if os.path.getsize(self.bin_path) != int(cum[-1]) * self.dtype.itemsize:
            raise UserInputError(f"{self.bin_path} has {os.path.getsize(self.bin_path)} bytes but "
                                 f"{self.idx_path} describes {int(cum[-1])} {self.dtype} tokens; "
                                 "the pair is from different runs — re-run "
                                 "tools/preprocess_data.py")
        if (len(doc_idx) < 1 or doc_idx[0] != 0 or doc_idx[-1] != len(lengths)
                or np.any(np.diff(doc_idx) < 0)):
            raise UserInputError(f"{self.idx_path}: malformed document index; re-run "
                                 "tools/preprocess_data.py")
        return cum[doc_idx]

    @property
    def tokens(self) -> np.ndarray:
        """The whole ``P.bin`` as a read-only 1-D memory map (opened on first use)."""
        if self._tokens is None:
            size = os.path.getsize(self.bin_path)
            self._tokens = (np.zeros(0, self.dtype) if size == 0 else
                            _plain(np.memmap(self.bin_path, dtype=self.dtype, mode="r")))
        return self._tokens

    def identity(self) -> list:
        """What the caches trust of this shard's files (the sample index's key, the content
        hash's): their path, and of each its
        device, inode, size, mtime and change time (``st_ctime_ns``). Tools that copy or restore
        a file's times (``cp -p``, ``rsync -t``, ``touch -r``, ``os.utime``) set its mtime, never
        its ctime: the kernel sets ctime to the present at every write and every change of the
        times, so rewritten bytes always change this key, whatever size and mtime they keep
        (git's index trusts a file's stat the same way)."""
        out: list = [os.path.abspath(self.prefix)]
        for p in (self.bin_path, self.idx_path):
            st = os.stat(p)
            out += [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        return out

    def content(self, cache: "IndexCache") -> dict:
        """What this shard holds, for a checkpoint to record: the SHA-256 of its ``.idx`` and
        of its ``.bin`` (its name only to name it), not its path, size or mtime, so a shard
        regenerated in place with the same counts (two documents swapped) differs and a moved
        copy does not. Hashed once (the ``.bin`` read at ~1.4 GB/s on one core) and cached under
        ``cache`` keyed by :meth:`identity`, which any write changes. A hash is not kept when
        the files changed while being hashed or less than ``CONTENT_SETTLE_S`` before it ended
        (a later write within the file system's time resolution could keep the same ctime:
        git's "racy" entries); the next start hashes them again."""
        before = self.identity()

        def build() -> dict:
            out = {"name": os.path.basename(self.prefix)}
            for kind, path in (("idx", self.idx_path), ("bin", self.bin_path)):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(16 << 20), b""):
                        h.update(block)
                out[f"{kind}_sha256"] = h.hexdigest()
            return out

        def settled() -> bool:
            changed = max(before[5], before[10])  # the ctimes of the .bin and the .idx
            return (self.identity() == before
                    and time.time_ns() - changed >= CONTENT_SETTLE_S * 1e9)

        name = f"{os.path.basename(self.prefix)}.{_digest(before)}.content.json"
        return {**cache.get_json(name, build, keep=settled),
                "name": os.path.basename(self.prefix)}


# a shard's hash is cached only when its files had not changed for this long when it was made
# (ShardIndex.content): above the 1 s ctime resolution of some file systems (Lustre, NFSv3)
CONTENT_SETTLE_S = 2.0


class IndexCache:
    """``.npy`` arrays under one directory, built on a miss and loaded memory-mapped on a hit.

    ``directory=None`` keeps everything in memory. A directory that cannot be created or written
    is reported once (a ``UserWarning`` naming ``--data-cache-path``) and memory is used instead.
    """

    def __init__(self, directory: Optional[str]):
        self.directory = directory

    def get(self, name: str, build: Callable[[], np.ndarray],
            describe: Optional[dict] = None,
            valid: Optional[Callable[[np.ndarray], bool]] = None) -> np.ndarray:
        """The array stored as ``name`` (a file name ending in .npy), built and stored if absent.
        ``describe``, when given, is written next to it as ``name``.json for people.

        A stored file that cannot be read back as the array ``build`` makes — empty, truncated,
        not a ``.npy``, an object array, or failing ``valid`` (int64 and the expected shape, as
        the caller knows it) — is rebuilt and replaced, with a note naming it."""
        if self.directory is not None:
            path = os.path.join(self.directory, name)
            reason = _unreadable(path, valid)
            if reason is None:
                return _plain(np.load(path, mmap_mode="r"))
            if reason != "absent":
                warnings.warn(f"note: rebuilding the sample-index cache file {path} ({reason})")
        arr = np.ascontiguousarray(build())
        if self.directory is not None and arr.size:
            try:
                os.makedirs(self.directory, exist_ok=True)
                self._write(path, lambda f: np.save(f, arr, allow_pickle=False))
                if describe is not None:
                    text = (json.dumps(describe, indent=2) + "\n").encode()
                    self._write(path[:-4] + ".json", lambda f: f.write(text))
                return _plain(np.load(path, mmap_mode="r"))
            except OSError as e:
                warnings.warn(f"note: cannot write the sample-index cache in {self.directory} "
                              f"({e.strerror or e}); keeping it in memory — pass "
                              "--data-cache-path DIR to cache it in a writable directory")
                self.directory = None
        return arr

    def get_json(self, name: str, build: Callable[[], dict],
                 keep: Callable[[], bool] = lambda: True) -> dict:
        """The JSON object stored as ``name``, built if absent or unreadable, and then stored
        when ``keep()`` (asked after the build) says so."""
        if self.directory is not None:
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    value = json.load(f)
                if isinstance(value, dict):
                    return value
            except (OSError, ValueError):
                pass
        value = build()
        if self.directory is not None and keep():
            text = (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()
            try:
                os.makedirs(self.directory, exist_ok=True)
                self._write(os.path.join(self.directory, name), lambda f: f.write(text))
            except OSError:
                pass  # kept in memory; the sample index's own write warns about the directory
        return value

    @staticmethod
    def _write(path: str, write: Callable) -> None:
        """Write under a unique temporary name, then rename (several ranks may write at once)."""
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)


def split_boundaries(split: Sequence[float], num_documents: int) -> list[int]:
    """Document boundaries [0, b1, b2, D] of the train / valid / test ranges (Megatron-LM's
    ``--split``): weights normalised, padded with zeros to three, cumulative shares rounded half
    up. E.g. (969, 30, 1) over 402 documents → [0, 390, 402, 402]."""
    w = [float(x) for x in split] + [0.0] * (3 - len(split))
    total = sum(w)
    assert len(w) == 3 and total > 0 and min(w) >= 0, split
    out, acc = [0], 0.0
    for x in w[:-1]:
        acc += x
        out.append(min(num_documents, int(math.floor(acc / total * num_documents + 0.5))))
    return out + [num_documents]


def _sample_starts(stream_len: np.ndarray, chunk: int,
                   progress: Optional[BuildProgress] = None) -> np.ndarray:
    """(document, offset) of each sample start, int64 [N + 1, 2], documents counted from 0 in
    ``stream_len`` (int64 [D], each document's tokens + its [SEP]); row N is the stream's end.
    Built in blocks, so temporaries stay O(block) beyond the result; ``progress`` is told after
    each block."""
    ends = np.cumsum(stream_len)
    total = int(ends[-1]) if len(ends) else 0
    n = -(-total // chunk)
    out = np.empty((n + 1, 2), np.int64)
    starts = ends - stream_len
    block = 1 << 22
    for lo in range(0, n + 1, block):
        p = np.minimum(np.arange(lo, min(n + 1, lo + block), dtype=np.int64) * chunk, total)
        d = np.searchsorted(ends, p, side="right")
        inside = d < len(ends)
        out[lo:lo + len(p), 0] = d
        out[lo:lo + len(p), 1] = np.where(inside, p - starts[np.minimum(d, len(ends) - 1)], 0)
        if progress is not None:
            progress.update(lo + len(p), n + 1, "sample starts")
    return out


class PackedDataset:
    """Fixed-length [CLS] … [SEP] samples packed from one dataset's shards (one split of it).

    Args:
        prefixes: ``--data-path`` entries, each a shard prefix (``P.bin`` / ``P.idx``) or a
            dataset prefix with a manifest (``shards.resolve_data_path``); their shards are
            concatenated in this order.
        seq_length: tokens per sample L, including [CLS] and [SEP].
        split: Megatron-LM ``--split`` weights (train, valid, test); default: all train.
        part: which range of ``split`` this is (0 train, 1 valid, 2 test).
        cache_dir: where the index is cached; default ``index-cache/`` next to the first shard;
            ``None`` with ``cache=False`` keeps it in memory.
        name: the dataset's name in cache file names (default: the first shard's base name).
        specials: the tokenizer's special ids (``Tokenizer.specials``); packing uses its cls,
            sep and pad ids and the cache is keyed by them. Default: the layout
            tools/train_tokenizer.py writes ([PAD] 0, [CLS] 1, [SEP] 2).
    Raises:
        UserInputError: no prefixes, a shard missing or malformed, or no tokens at all.
    """

    def __init__(self, prefixes: Sequence[str], seq_length: int, *,
                 split: Sequence[float] = (1.0,), part: int = 0,
                 cache_dir: Optional[str] = None, cache: bool = True,
                 name: Optional[str] = None, specials: SpecialIds = TRAINED_SPECIAL_IDS):
        if not prefixes:
            raise UserInputError("--data-path is empty: give at least one shard prefix "
                                 "(made by tools/preprocess_data.py)")
        assert part in (0, 1, 2) and seq_length >= 3
        self.prefixes = [s for p in prefixes for s in resolve_data_path(p)]
        self.seq_length, self.part, self._chunk = seq_length, part, seq_length - 2
        self.shards = [ShardIndex(p) for p in self.prefixes]
        self.name = name or os.path.basename(os.fspath(prefixes[0]))
        if cache and cache_dir is None:
            cache_dir = os.path.join(os.path.dirname(os.path.abspath(self.prefixes[0])),
                                     DEFAULT_CACHE_DIR)
        self.cache = IndexCache(cache_dir if cache else None)

        docs = np.array([s.num_documents for s in self.shards], np.int64)
        self._doc_base = np.concatenate([[0], np.cumsum(docs)])
        shard_key = _digest({"format": _INDEX_FORMAT,
                             "shards": [s.identity() for s in self.shards]})
        n_docs = int(docs.sum())
        progress = BuildProgress(f"the sample index of {self.name} ({_PART_NAMES[part]})")
        self._doc_starts = self.cache.get(
            f"{self.name}.{shard_key}.doc_starts.npy", lambda: self._build_doc_starts(progress),
            {"shards": [s.identity() for s in self.shards]},
            valid=lambda a: a.shape == (n_docs + 1,) and a[0] == 0)
        self._token_base = self._doc_starts[self._doc_base]  # int64 [S + 1]
        self.total_documents = int(self._doc_base[-1])
        if int(self._doc_starts[-1]) == 0:
            raise UserInputError(f"--data-path {' '.join(self.prefixes)}: the shards hold no "
                                 "tokens")

        self.split = tuple(float(x) for x in split)
        bounds = split_boundaries(self.split, self.total_documents)
        self.document_range = (bounds[part], bounds[part + 1])
        lo, hi = self.document_range
        self.num_documents = hi - lo
        self.specials = specials
        self._index_key = _digest({"shards": shard_key, "seq_length": seq_length,
                                   "documents": [lo, hi],
                                   "cls_sep_pad": [specials.cls, specials.sep, specials.pad]})
        if self.num_documents == 0:
            self._samples = np.zeros((1, 2), np.int64) + lo
        else:
            self._samples = self.cache.get(
                f"{self.name}.{self._index_key}.samples.npy",
                lambda: self._build_samples(progress),
                {"shards": [s.identity() for s in self.shards], "seq_length": seq_length,
                 "split": list(self.split), "part": part, "documents": [lo, hi]},
                valid=lambda a: (a.ndim == 2 and a.shape[0] >= 2 and a.shape[1] == 2
                                 and tuple(a[0]) == (lo, 0)))
        self.num_samples = len(self._samples) - 1
        progress.finish(f"{self.num_samples:,} samples of {self.num_documents:,} documents")
        lens = np.diff(self._doc_starts[lo:hi + 1]) if hi > lo else np.zeros(0, np.int64)
        self.stream_tokens = int(lens.sum() + np.count_nonzero(lens))
        self._orders: dict[tuple, np.ndarray] = {}
        self._content: Optional[list[dict]] = None

    def shard_contents(self) -> list[dict]:
        """What each of the dataset's shards holds (``ShardIndex.content``), in order; hashed
        on first use (``prepare``, before a run that saves or loads starts), then kept; a
        hashing that takes long prints progress as an index build does."""
        if self._content is None:
            progress = BuildProgress(f"the content hash of {self.name}")
            self._content = []
            for i, shard in enumerate(self.shards):
                self._content.append(shard.content(self.cache))
                progress.update(i + 1, len(self.shards), "shards hashed")
            progress.finish(f"{len(self.shards)} shard(s)")
        return self._content

    # -- index construction ----------------------------------------------------------------------

    def _build_doc_starts(self, progress: BuildProgress) -> np.ndarray:
        parts, base = [np.zeros(1, np.int64)], 0
        for i, s in enumerate(self.shards):
            starts = s.document_token_starts()
            parts.append(starts[1:] + base)
            base += int(starts[-1])
            progress.update(i + 1, len(self.shards), "shard indices read")
        return np.concatenate(parts)

    def _build_samples(self, progress: BuildProgress) -> np.ndarray:
        lo, hi = self.document_range
        lens = np.diff(self._doc_starts[lo:hi + 1])
        out = _sample_starts(lens + (lens > 0), self._chunk, progress)
        out[:, 0] += lo
        return out

    # -- reading ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def _tokens(self, a: int, b: int) -> np.ndarray:
        """Dataset tokens [a, b) (token coordinates over the concatenated shards)."""
        if a >= b:
            return np.zeros(0, np.int64)
        s = int(np.searchsorted(self._token_base, a, side="right")) - 1
        t0 = int(self._token_base[s])
        if b <= int(self._token_base[s + 1]):  # the common case: inside one shard
            return self.shards[s].tokens[a - t0:b - t0]
        pieces = []
        while a < b:
            t0, t1 = int(self._token_base[s]), int(self._token_base[s + 1])
            end = min(b, t1)
            if end > a:
                pieces.append(self.shards[s].tokens[a - t0:end - t0])
            a, s = max(a, end), s + 1
        return np.concatenate(pieces)

    def _body(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``i``'s stream tokens (``content``) and where in them each document ends: the
        positions of the [SEP]s that close a document, int64 [k], ascending."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range [0, {self.num_samples})")
        (d0, o0), (d1, o1) = self._samples[i:i + 2].tolist()
        starts = self._doc_starts[d0:d1 + 1]  # documents d0 … d1
        a, b = int(starts[0]) + o0, int(starts[-1]) + o1
        ends = starts[1:]  # ends of documents d0 … d1 − 1: a [SEP] follows each non-empty one
        sep_at = (ends - a)[ends > starts[:-1]]
        body = np.insert(self._tokens(a, b).astype(np.int64), sep_at, self.specials.sep)
        return body, sep_at + np.arange(len(sep_at))

    def content(self, i: int) -> np.ndarray:
        """Sample ``i``'s stream tokens without [CLS] / final [SEP] / padding: int64 [≤ L − 2]."""
        return self._body(i)[0]

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` as int64 [seq_length]: [CLS] tokens… [SEP] ([PAD] only after the last
        sample's [SEP])."""
        return self.sample(i)[0]

    def sample(self, i: int, documents: bool = False) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Sample ``i`` (``self[i]``) and, with ``documents``, its document ids: int32
        [seq_length], which run of the sample each position belongs to, counted from 0 and
        non-decreasing — [CLS] and the first (partial) document are run 0, each document's
        closing [SEP] belongs to it, the sample's final [SEP] to the run before it, and the
        padding after it is one run of its own. Read from the sample index, not from the ids
        (a document may hold the [SEP] id itself). Document-masked packing
        (``DataConfig.document_masking``) attends within a run and restarts positions at each
        (``model/document_mask.py``)."""
        body, closes = self._body(i)
        out = np.full(self.seq_length, self.specials.pad, dtype=np.int64)
        out[0] = self.specials.cls
        out[1:1 + len(body)] = body
        out[1 + len(body)] = self.specials.sep
        if not documents:
            return out, None
        starts = np.zeros(self.seq_length, np.int32)
        starts[closes[closes < len(body) - 1] + 2] = 1  # the token after a closing [SEP]
        if 2 + len(body) < self.seq_length:
            starts[2 + len(body)] = 1  # the padding
        return out, np.cumsum(starts, dtype=np.int32)

    def documents_of(self, i: int) -> tuple[int, int]:
        """[first, last] dataset document ids whose tokens sample ``i`` holds (tests, audits)."""
        (d0, _), (d1, o1) = self._samples[i:i + 2].tolist()
        return d0, d1 if o1 > 0 else d1 - 1

    # -- order -----------------------------------------------------------------------------------

    def order(self, seed: int, epoch: int, stream: Sequence[int] = ()) -> np.ndarray:
        """int64 [N]: epoch ``epoch``'s permutation of the samples,
        ``default_rng([seed, epoch, *stream]).permutation(N)``, cached like the index."""
        key = (seed, epoch, tuple(stream))
        if key not in self._orders:
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            tag = "-".join(str(x) for x in (seed, epoch, *stream))
            progress = BuildProgress(f"the order of {self.name} ({_PART_NAMES[self.part]}), "
                                     f"epoch {epoch}")
            self._orders[key] = self.cache.get(
                f"{self.name}.{self._index_key}.order-{tag}.npy",
                lambda: progress.run(lambda: _order(self.num_samples, seed, epoch, tuple(stream))),
                valid=lambda a: a.shape == (self.num_samples,))
            progress.finish(f"{self.num_samples:,} samples shuffled")
        return self._orders[key]


def _unreadable(path: str, valid: Optional[Callable[[np.ndarray], bool]]) -> Optional[str]:
    """Why the cached ``.npy`` at ``path`` cannot be used ("absent" when there is none), or None
    when it loads as an int64 array that ``valid`` accepts."""
    if not os.path.exists(path):
        return "absent"
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # 0 bytes (EOFError), garbage, short data
        return f"unreadable: {' '.join(str(e).split()) or type(e).__name__}"
    if not isinstance(a, np.ndarray) or a.dtype != np.int64:
        return f"holds {getattr(a, 'dtype', type(a).__name__)}, not int64"
    if valid is not None and not valid(a):
        return f"unexpected shape {a.shape}"
    return None


def _plain(a: np.ndarray) -> np.ndarray:
    """A plain ndarray view of a memory map (slicing a np.memmap costs microseconds each)."""
    return a.view(np.ndarray)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@lru_cache(maxsize=4)
def _order(n: int, seed: int, epoch: int, stream: tuple[int, ...] = ()) -> np.ndarray:
    return np.random.default_rng([seed, epoch, *stream]).permutation(n).astype(np.int64)


def in_epoch_order(j: np.ndarray, n: int, order: Callable[[int], np.ndarray]) -> np.ndarray:
    """Dataset indices (int64 [k]) of the j-th samples read from a dataset of ``n`` samples
    epoch after epoch: sample j is ``order(epoch)[j mod n]`` with epoch = j div n."""
    j = np.asarray(j, np.int64)
    epoch, pos = np.divmod(j, n)
    out = np.empty_like(pos)
    for e in np.unique(epoch):
        at = epoch == e
        out[at] = order(int(e))[pos[at]]
    return out


def sample_order(n: int, seed: int, consumed: np.ndarray) -> np.ndarray:
    """Dataset indices of global sample indices ``consumed`` (int64 [k]) of a single dataset: a
    pure function of (n, seed, epoch = consumed div n) — what ``PackedDataset.order`` caches."""
    return in_epoch_order(consumed, n, lambda e: _order(n, seed, e))


@dataclass(frozen=True)
class MicroBatch:
    """input_ids: [b, s] int64; sample_index: [b] int64 global sample indices (the mask keys);
    document_ids: [b, s] int32, each position's document within its sample
    (``PackedDataset.sample``), under document-masked packing only, else None."""

    input_ids: torch.Tensor
    sample_index: torch.Tensor
    document_ids: Optional[torch.Tensor] = None

    def pin_memory(self) -> "MicroBatch":
        """Page-locked copy (torch's DataLoader calls this when ``pin_memory=True``)."""
        return MicroBatch(self.input_ids.pin_memory(), self.sample_index.pin_memory(),
                          None if self.document_ids is None else self.document_ids.pin_memory())


@dataclass(frozen=True)
class HostBatch:
    """A micro-batch as numpy arrays (input_ids [b, s] int64, sample_index [b] int64,
    document_ids [b, s] int32 or None): what loader workers send. Pickled through the worker's
    pipe it costs a copy; torch tensors would each get a new shared-memory segment, measured ~3×
    slower for [32, 512] (bench/loader.py)."""

    input_ids: np.ndarray
    sample_index: np.ndarray
    document_ids: Optional[np.ndarray] = None

    def to_torch(self) -> MicroBatch:
        return MicroBatch(torch.from_numpy(self.input_ids), torch.from_numpy(self.sample_index),
                          None if self.document_ids is None
                          else torch.from_numpy(self.document_ids))

    def pin_memory(self) -> MicroBatch:
        """Tensors in page-locked memory (the DataLoader's pin-memory thread calls this)."""
        return self.to_torch().pin_memory()
