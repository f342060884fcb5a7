"""Several datasets mixed by weight: the sample a run reads at global sample index k.

``--data-path 0.7 A 0.3 B`` (Megatron-LM's syntax; weights normalised) blends datasets A and B;
``--data-path A B`` is one dataset, A's shards then B's. Each entry may be one shard or a dataset
prefix with a manifest (``shards.resolve_data_path``).

The k-th sample of a split (k counted from 0 over the whole run) is a pure function of
(seed, k):

1. ``BlendSchedule``: k → (dataset d, d's own running index j). The weights are written as integer
   quotas q_d over a period P (the smallest P ≤ 10,000 that holds them exactly, else 10,000 with
   largest-remainder rounding); one period is laid out by smooth weighted round-robin (slot r goes
   to the dataset with the largest deficit q_d·(r+1)/P − picked_d, ties to the lower d), so every
   period holds exactly q_d samples of d, interleaved. Then d = pattern[k mod P] and
   j = (k div P)·q_d + (d's slots before k mod P in the pattern). Megatron-LM's blend uses the
   same largest-deficit rule, but over the run's whole length, built as an index; the period
   makes it O(1) per k and independent of the run's length.
2. dataset d's order: sample ``order(seed, epoch = j div N_d)[j mod N_d]`` of d's split
   (``PackedDataset.order``; stream key (split, d), so datasets and splits shuffle independently,
   and a single dataset's training split keeps the key [seed, epoch]).

Masks are keyed by ``index_base + k`` with a different base per split (train 0, valid 2**60,
test 2**61), so a validation sample never shares its mask with the training sample of the same k.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np

from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.packed import HostBatch, MicroBatch, PackedDataset, in_epoch_order
from rtd_scale.data.tokenizer import TRAINED_SPECIAL_IDS, SpecialIds

SPLIT_NAMES = ("train", "valid", "test")
SPLIT_INDEX_BASE = 1 << 60  # mask key of split p's k-th sample: p · 2**60 + k
MAX_PERIOD = 10_000


class BlendSchedule:
    """k → (dataset, that dataset's running index), periodic with exact per-period quotas.

    Args:
        weights: one positive weight per dataset (normalised here).
        names: the datasets' names, for errors.
        flag: the flag that named the datasets, for errors.
    Raises:
        UserInputError: a weight rounds to zero samples per period (naming ``flag``).
    """

    def __init__(self, weights: Sequence[float], names: Optional[Sequence[str]] = None,
                 flag: str = "--data-path"):
        w = np.asarray(weights, np.float64)
        assert w.ndim == 1 and len(w) and (w > 0).all(), weights
        w = w / w.sum()
        self.weights = w
        self.period = next((p for p in range(1, MAX_PERIOD + 1)
                            if np.allclose(w * p, np.round(w * p), rtol=0, atol=1e-9)),
                           MAX_PERIOD)
        quota = np.floor(w * self.period).astype(np.int64)
        rest = self.period - int(quota.sum())  # largest remainders get one more
        quota[np.argsort(-(w * self.period - quota), kind="stable")[:rest]] += 1
        if (quota == 0).any():
            d = int(np.argmin(quota))
            name = names[d] if names else f"#{d}"
            raise UserInputError(f"{flag}: the weight of {name} ({w[d]:.2e} of the total) is "
                                 f"below 1/{MAX_PERIOD}; raise it or leave the dataset out")
        self.quota = quota
        picked = np.zeros(len(w), np.int64)
        self._dataset = np.empty(self.period, np.int64)
        self._rank = np.empty(self.period, np.int64)
        for r in range(self.period):
            d = int(np.argmax(quota * (r + 1) - picked * self.period))
            self._dataset[r], self._rank[r] = d, picked[d]
            picked[d] += 1
        assert np.array_equal(picked, quota)

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset int64 [n], running index in it int64 [n]) of global sample indices k [n]."""
        block, r = np.divmod(np.asarray(k, np.int64), self.period)
        d = self._dataset[r]
        return d, block * self.quota[d] + self._rank[r]


class BlendedDataset:
    """One split (train / valid / test) of the blended datasets, indexed by global sample index.

    ``data[k]`` for an int64 array ``k`` [b] is the MicroBatch (input_ids [b, seq_length],
    sample_index = index_base + k); ``data.host_batch(k)`` the same as numpy arrays, which is
    what the loader's workers produce.

    Args:
        datasets: the split of each dataset (``PackedDataset``, same seq_length).
        weights: blend weights, one per dataset.
        seed: the run's seed (the order).
        flag: the flag that named the datasets (``--data-path``, or ``--valid-data-path`` /
            ``--test-data-path`` for a held-out corpus read whole), for errors.
        document_ids: also give each micro-batch its samples' document ids
            (``PackedDataset.sample``; ``DataConfig.document_masking``). The ids, the order and
            the mask keys are the same either way.
    Raises:
        UserInputError: a dataset's split is empty (naming it, --split and the fix).
    """

    def __init__(self, datasets: Sequence[PackedDataset], weights: Sequence[float], *, seed: int,
                 flag: str = "--data-path", document_ids: bool = False):
        assert datasets and len(datasets) == len(weights)
        self.datasets, self.seed = list(datasets), seed
        self.document_ids = document_ids
        self.part = datasets[0].part
        self.seq_length = datasets[0].seq_length
        for ds in self.datasets:
            if ds.num_documents == 0 and flag != "--data-path":
                raise UserInputError(f"{flag} {ds.name}: holds no documents; pass a dataset "
                                     "made by tools/preprocess_data.py from some text")
            if ds.num_documents == 0:
                raise UserInputError(
                    f"--split {','.join(f'{x:g}' for x in ds.split)} leaves no "
                    f"{SPLIT_NAMES[self.part]} documents in --data-path {ds.name} "
                    f"({ds.total_documents} documents); raise its {SPLIT_NAMES[self.part]} share"
                    + (" or pass --eval-iters 0" if self.part else ""))
        self.schedule = BlendSchedule(weights, [ds.name for ds in self.datasets], flag)
        self.index_base = self.part * SPLIT_INDEX_BASE

    def _stream(self, d: int) -> tuple[int, ...]:
        return () if (self.part, d) == (0, 0) else (self.part, d)

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample within that dataset's split) of global sample indices k, int64 [n]."""
        d, j = self.schedule.locate(k)
        sample = np.empty_like(j)
        for di in np.unique(d).tolist():
            sel = d == di
            ds, stream = self.datasets[di], self._stream(di)
            sample[sel] = in_epoch_order(j[sel], len(ds), lambda e: ds.order(self.seed, e, stream))
        return d, sample

    def host_batch(self, k: np.ndarray) -> HostBatch:
        """The samples at global indices ``k`` (int64 [b]) as numpy: input_ids [b, s],
        sample_index = index_base + k [b] (the mask keys), and with ``document_ids`` their
        document ids [b, s]."""
        k = np.asarray(k, np.int64)
        d, sample = self.locate(k)
        rows = [self.datasets[di].sample(si, self.document_ids)
                for di, si in zip(d.tolist(), sample.tolist())]
        ids = np.stack([r[0] for r in rows])
        docs = np.stack([r[1] for r in rows]) if self.document_ids else None
        return HostBatch(ids, k + self.index_base, docs)

    def __getitem__(self, k: np.ndarray) -> MicroBatch:
        return self.host_batch(k).to_torch()

    def describe(self) -> str:
        """One line: samples per dataset and weights, e.g. for the start-up log."""
        parts = [f"{w:.3g} × {ds.name} ({len(ds)} samples, {ds.num_documents} documents)"
                 for w, ds in zip(self.schedule.weights, self.datasets)]
        return f"{SPLIT_NAMES[self.part]}: " + " + ".join(parts)

    def state(self) -> dict:
        """What a checkpoint records to tell whether a resumed run reads the same data: the
        packing, the blend, and what every shard of every dataset holds (``shards``:
        ``PackedDataset.shard_contents``, hashed on first use)."""
        return {"samples": [len(ds) for ds in self.datasets],
                "weights": [float(w) for w in self.schedule.weights],
                "seq_length": self.seq_length, "split": list(self.datasets[0].split),
                "shards": [ds.shard_contents() for ds in self.datasets]}

    def continue_after(self, consumed: int, saved: Optional[dict]) -> tuple[int, Optional[str]]:
        """Where a resumed run reads on when the checkpoint read ``consumed`` samples of data
        whose :meth:`state` was ``saved``: (the first global sample index, a note or None).

        The same data packed at another ``--seq-length`` (the second phase of BERT's and NVIDIA
        ELECTRA's schedule, arXiv 1810.04805 §A.2: most steps at 128 tokens, then 512) has
        another number of samples an epoch, so sample ``consumed`` of the new packing would be
        another place in the text. The run continues at the same fraction of the data instead:
        ``consumed × (new samples) / (old samples)``, the token slots already read kept. Any
        other difference keeps ``consumed`` (the caller notes it)."""
        if not saved or saved.get("seq_length") in (None, self.seq_length) or any(
                saved.get(k) != v for k, v in self.state().items()
                if k not in ("samples", "seq_length", "shards")):
            return consumed, None
        old, new = sum(saved.get("samples") or [0]), sum(len(ds) for ds in self.datasets)
        if old <= 0:
            return consumed, None
        start = consumed * new // old
        d, j = self.schedule.locate(np.array([start], np.int64))
        ds = self.datasets[int(d[0])]
        epoch, position = divmod(int(j[0]), len(ds))
        return start, (
            f"note: --seq-length {self.seq_length} (the checkpoint's {saved['seq_length']}): the "
            f"checkpoint had read {consumed:,} of the {old:,} samples an epoch of its packing; "
            f"the run continues at the same fraction of the data, global sample {start:,} of the "
            f"{new:,} an epoch of {self.seq_length}-token samples ({ds.name}: epoch {epoch}, "
            f"position {position} counted from 0)")


def build_split(sources: Sequence[tuple[float, Sequence[str]]], *, seq_length: int,
                split: Sequence[float], part: int, seed: int,
                cache_path: Optional[str] = None,
                specials: Optional[SpecialIds] = None,
                flag: str = "--data-path", document_ids: bool = False) -> BlendedDataset:
    """Split ``part`` of the blend of ``sources`` — (weight, data-path entries) pairs, each
    entry a shard prefix or a dataset prefix (``shards.resolve_data_path``).

    ``cache_path`` is ``--data-cache-path`` (default: ``index-cache/`` next to each dataset's
    first shard). ``specials``: the tokenizer's special ids (``Tokenizer.specials``; default
    the layout tools/train_tokenizer.py writes). ``flag`` names the sources in errors.
    ``document_ids``: micro-batches carry their document ids (``BlendedDataset``).
    Raises UserInputError for a missing or empty dataset or split."""
    datasets = []
    for _, entries in sources:
        datasets.append(PackedDataset(entries, seq_length, split=split, part=part,
                                      cache_dir=cache_path,
                                      name=os.path.basename(os.fspath(entries[0])),
                                      specials=specials or TRAINED_SPECIAL_IDS))
    return BlendedDataset(datasets, [w for w, _ in sources], seed=seed, flag=flag,
                          document_ids=document_ids)
