"""Packed sequences over token shards, a reproducible sample order, and the data-parallel split.

Packing (RoBERTa's FULL-SENTENCES, arXiv 1907.11692 §4.2): the documents of all shards, each
followed by [SEP], form one token stream; sample i is [CLS] + stream[i·(L−2) : (i+1)·(L−2)] + [SEP]
for seq_length L. Samples never need padding (a corpus shorter than one sample gives one padded
sample).

Order (STYLE rule 10): the k-th sample a run consumes, counting from 0 over the whole run, is
``order(seed, epoch)[k mod N]`` with epoch = k div N and ``order`` a seeded permutation. ``k`` is the
*global sample index* that keys the masks, so an epoch's repeat of a sample is masked afresh
(dynamic masking, RoBERTa) yet every mask is a pure function of (seed, k). Step t of a run with
global batch G consumes the next G sample indices after those already consumed (t·G when G never
changed); data-parallel rank r takes the r-th contiguous slice, split into micro-batches.
"""
from __future__ import annotations

from rtd_scale.cli_errors import UserInputError

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
import torch

from rtd_scale.data import shards
from rtd_scale.data.tokenizer import CLS_ID, PAD_ID, SEP_ID


class PackedDataset:
    """Fixed-length [CLS] … [SEP] samples packed from one or more shard prefixes.

    Args:
        prefixes: shard prefixes (PREFIX.bin / PREFIX.idx).
        seq_length: tokens per sample L, including [CLS] and [SEP].
    Raises:
        ValueError: a prefix has no shard files, or the shards hold no tokens.
    """

    def __init__(self, prefixes: Sequence[str], seq_length: int):
        if not prefixes:
            raise UserInputError("--data-path is empty: give at least one shard prefix "
                             "(made by tools/preprocess_data.py)")
        self.seq_length = seq_length
        self.datasets = [shards.open_shard(p) for p in prefixes]
        lengths = [np.asarray(d.sequence_lengths, dtype=np.int64) + 1 for d in self.datasets]
        # doc_ends[j]: stream offset one past document j's trailing [SEP]
        self._doc_ds = np.concatenate([np.full(len(l), i) for i, l in enumerate(lengths)])
        self._doc_local = np.concatenate([np.arange(len(l)) for l in lengths])
        self._doc_len = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._doc_ends = np.cumsum(self._doc_len)
        total = int(self._doc_ends[-1]) if len(self._doc_ends) else 0
        if total == 0:
            raise UserInputError(f"--data-path {' '.join(prefixes)}: the shards hold no tokens")
        self.stream_tokens = total
        self._chunk = seq_length - 2
        self.num_samples = max(1, total // self._chunk)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        """Sample ``i`` as int64 [seq_length]: [CLS] tokens… [SEP] ([PAD] only past the stream)."""
        start = i * self._chunk
        end = min(start + self._chunk, self.stream_tokens)
        out = np.full(self.seq_length, PAD_ID, dtype=np.int64)
        out[0] = CLS_ID
        pos, j = 1, int(np.searchsorted(self._doc_ends, start, side="right"))
        cursor = start
        while cursor < end:
            doc_start = self._doc_ends[j] - self._doc_len[j]
            offset = cursor - doc_start
            take = int(min(end, self._doc_ends[j]) - cursor)
            doc_tokens = self._doc_len[j] - 1  # without its [SEP]
            n_text = int(max(0, min(take, doc_tokens - offset)))
            if n_text:
                ds = self.datasets[self._doc_ds[j]]
                out[pos:pos + n_text] = ds.get(int(self._doc_local[j]), offset=int(offset),
                                               length=n_text)
            if take > n_text:  # the document's trailing [SEP]
                out[pos + n_text] = SEP_ID
            pos += take
            cursor += take
            j += 1
        out[pos] = SEP_ID
        return out


@lru_cache(maxsize=4)
def _order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def sample_order(n: int, seed: int, consumed: np.ndarray) -> np.ndarray:
    """Dataset indices of global sample indices ``consumed`` (int64 [k]): a pure function of
    (n, seed, epoch = consumed div n)."""
    out = np.empty_like(consumed)
    epochs = consumed // n
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = _order(n, seed, int(e))[consumed[sel] % n]
    return out


@dataclass(frozen=True)
class MicroBatch:
    """input_ids: [b, s] int64; sample_index: [b] int64 global sample indices."""

    input_ids: torch.Tensor
    sample_index: torch.Tensor


def micro_batches(dataset: PackedDataset, *, consumed_samples: int, seed: int,
                  global_batch_size: int,
                  micro_batch_size: int, dp_rank: int, dp_size: int) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches of the optimizer step that starts after
    ``consumed_samples`` samples (the run's position, kept in checkpoints).

    Consumes global sample indices [consumed, consumed + G); rank r gets its G/dp slice in
    order. Keyed by samples, not steps, so a resume with another global batch size continues
    where the data left off.
    """
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    out = []
    for j in range(per_rank // micro_batch_size):
        k = np.arange(first + j * micro_batch_size, first + (j + 1) * micro_batch_size,
                      dtype=np.int64)
        idx = sample_order(len(dataset), seed, k)
        ids = np.stack([dataset[int(i)] for i in idx])
        out.append(MicroBatch(torch.from_numpy(ids), torch.from_numpy(k)))
    return out
