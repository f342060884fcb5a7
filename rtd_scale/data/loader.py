"""The data-parallel sampler and the DataLoader the training loop reads.

Position (STYLE rule 10): a run's data position is one number, the samples consumed so far
(kept in every checkpoint). Optimizer step t, starting after ``consumed`` samples, reads global
sample indices [consumed, consumed + G) for global batch G; data-parallel rank r takes the r-th
contiguous G/dp slice, cut into micro-batches of b. So a resumed run re-creates the loader at
``consumed`` and reads exactly what the uninterrupted run read next, at any number of loader
workers (tests/e2e/test_pretrain_launcher.py). (Megatron-LM's ``MegatronPretrainingSampler`` has
the same contract but gives rank r the r-th micro-batch of every group of dp micro-batches instead
of one contiguous slice.)

Skipped ranges: half-open ranges [start, end) of global sample indices that the run never reads
(the samples a loss-spike rollback stepped over, ``training/spikes.py``; kept in every later
checkpoint). A step then reads the next G indices at or after ``consumed`` outside them, and
``consumed`` becomes one past the last index read (:func:`advance`), so the position stays one
number and a resume at any data-parallel size or global batch skips the same samples. Without
ranges every step reads [consumed, consumed + G), as above.

Loading: a ``torch.utils.data.DataLoader`` over ``BlendedDataset.host_batch`` with the sampler
yielding one micro-batch's indices at a time (``batch_size=None``), ``num_workers`` worker
processes (``--num-workers``; each reopens the shard memory maps), ``prefetch_factor``
micro-batches read ahead per worker, persistent workers — a training run forks them before it
builds the model (``SplitLoaders``) — and pinned memory when the device is CUDA. Workers send
numpy arrays (``HostBatch``), made tensors in the training process — or in the DataLoader's
pin-memory thread when pinning. The loader gets its own ``torch.Generator``, so creating it draws
nothing from the global RNG that dropout uses (a resumed run would otherwise diverge).
"""
from __future__ import annotations

import signal
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from rtd_scale.batch import rank_share
from rtd_scale.data.packed import HostBatch, MicroBatch


Ranges = Sequence[tuple[int, int]]


def merge_ranges(ranges: Ranges) -> list[tuple[int, int]]:
    """``ranges`` ([start, end) pairs of global sample indices) sorted, empty ones dropped, and
    overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if int(b) > int(a)):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def global_batch(consumed_samples: int, global_batch_size: int,
                 skip: Ranges = ()) -> np.ndarray:
    """Global sample indices (int64 [G]) of the optimizer step that starts at position
    ``consumed_samples``: the next G indices from there outside the ``skip`` ranges."""
    parts, need, k = [], global_batch_size, consumed_samples
    for a, b in merge_ranges(skip):
        if b <= k:
            continue
        if a > k:
            take = min(need, a - k)
            parts.append(np.arange(k, k + take, dtype=np.int64))
            need -= take
        if need == 0:
            break
        k = max(k, b)
    if need:
        parts.append(np.arange(k, k + need, dtype=np.int64))
    return np.concatenate(parts)


def advance(consumed_samples: int, global_batch_size: int, skip: Ranges = ()) -> int:
    """The position after the optimizer step that starts at ``consumed_samples``: one past the
    last index it reads (``consumed_samples + G`` when nothing is skipped)."""
    if not skip:
        return consumed_samples + global_batch_size
    return int(global_batch(consumed_samples, global_batch_size, skip)[-1]) + 1


def rank_micro_batches(consumed_samples: int, *, global_batch_size: int, micro_batch_size: int,
                       dp_rank: int, dp_size: int, skip: Ranges = ()) -> list[np.ndarray]:
    """Global sample indices (int64 [b] each) of rank ``dp_rank``'s micro-batches in the optimizer
    step that starts after ``consumed_samples`` samples: the rank's contiguous G/dp slice of the
    step's global batch (:func:`global_batch`: [consumed, consumed + G) without ``skip``), in
    order."""
    per_rank, _ = rank_share(global_batch_size, micro_batch_size, dp_size)
    if skip:
        mine = global_batch(consumed_samples, global_batch_size, skip)[
            dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return [mine[j:j + micro_batch_size] for j in range(0, per_rank, micro_batch_size)]
    first = consumed_samples + dp_rank * per_rank
    return [np.arange(first + j, first + j + micro_batch_size, dtype=np.int64)
            for j in range(0, per_rank, micro_batch_size)]


def micro_batches(dataset, *, consumed_samples: int, seed: int, global_batch_size: int,
                  micro_batch_size: int, dp_rank: int, dp_size: int,
                  skip: Ranges = ()) -> list[MicroBatch]:
    """This data-parallel rank's micro-batches of the optimizer step that starts after
    ``consumed_samples`` samples of one ``PackedDataset``, read in the process (no loader): the
    training loop's path (``BlendedDataset`` of that one dataset, ``rank_micro_batches``), for
    tests and tools that need one step's data."""
    from rtd_scale.data.blend import BlendedDataset

    data = BlendedDataset([dataset], [1.0], seed=seed)
    return [data[k] for k in rank_micro_batches(consumed_samples, global_batch_size=global_batch_size,
                                                micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                                                dp_size=dp_size, skip=skip)]


class DataParallelSampler:
    """Yields this rank's micro-batches (int64 [b] global sample indices) for (total_samples −
    consumed_samples) / G optimizer steps from ``consumed_samples`` (a whole number of global
    batches; without skipped ranges, until ``total_samples``).

    Args:
        total_samples: where to stop (e.g. consumed + remaining steps × G).
        consumed_samples: where to start (from the checkpoint; 0 for a fresh run).
        global_batch_size, micro_batch_size: G and b; G must divide by b × dp_size.
        dp_rank, dp_size: this rank's data-parallel position.
        skip: [start, end) ranges of global sample indices never read (module docstring).
    """

    def __init__(self, *, total_samples: int, consumed_samples: int, global_batch_size: int,
                 micro_batch_size: int, dp_rank: int, dp_size: int, skip: Ranges = ()):
        assert 0 <= dp_rank < dp_size and consumed_samples >= 0
        _, self.micro_batches_per_step = rank_share(global_batch_size, micro_batch_size, dp_size)
        self.total, self.consumed = total_samples, consumed_samples
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.skip = merge_ranges(skip)

    def reposition(self, *, total_samples: int, consumed_samples: int,
                   skip: Ranges = ()) -> None:
        """Read from ``consumed_samples`` to ``total_samples`` (outside ``skip``) from the next
        pass on: a loader whose workers already run (``SplitLoaders``) is pointed at a new
        position without new processes."""
        assert consumed_samples >= 0
        self.total, self.consumed = total_samples, consumed_samples
        self.skip = merge_ranges(skip)

    @property
    def steps(self) -> int:
        return max(0, (self.total - self.consumed) // self.global_batch_size)

    def __len__(self) -> int:
        return self.steps * self.micro_batches_per_step

    def __iter__(self) -> Iterator[np.ndarray]:
        position = self.consumed
        for _ in range(self.steps):
            yield from rank_micro_batches(
                position, global_batch_size=self.global_batch_size,
                micro_batch_size=self.micro_batch_size, dp_rank=self.dp_rank,
                dp_size=self.dp_size, skip=self.skip)
            position = advance(position, self.global_batch_size, self.skip)


class _HostBatches:
    """Map-style view the DataLoader indexes: one micro-batch's indices → ``HostBatch``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, k: np.ndarray) -> HostBatch:
        return self.dataset.host_batch(k)


def _as_is(batch):
    return batch


class MicroBatchLoader:
    """Iterates ``MicroBatch``es (tensors) out of a DataLoader of ``HostBatch``es."""

    def __init__(self, dataloader: torch.utils.data.DataLoader):
        self.dataloader = dataloader

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> Iterator[MicroBatch]:
        for batch in self.dataloader:
            yield batch if isinstance(batch, MicroBatch) else batch.to_torch()


def _ignore_stop_signals(worker_id: int) -> None:
    """A worker leaves SIGINT and SIGTERM to its rank, which saves after the current step
    (training/signals.py): Ctrl-C reaches the whole process group and the deepspeed launcher
    SIGTERMs each rank's process tree, and a worker dying of either would make torch's SIGCHLD
    handler raise in the rank mid-step. A worker still ends with its rank (torch's watchdog)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build_loader(dataset, sampler: DataParallelSampler, *, num_workers: int,
                 pin_memory: bool, prefetch_factor: Optional[int] = 2,
                 seed: int = 0) -> MicroBatchLoader:
    """A loader yielding ``MicroBatch``es (input_ids [b, s] int64, sample_index [b] int64) in
    the sampler's order.

    Args:
        dataset: has ``host_batch(k)`` for an int64 index array (``blend.BlendedDataset``).
        sampler: the indices, one micro-batch at a time.
        num_workers: loader processes; 0 reads in the calling process.
        pin_memory: page-locked batches (pass True only for a CUDA device).
        prefetch_factor: micro-batches read ahead per worker (ignored without workers).
        seed: seeds the loader's own generator (worker seeds; no global RNG is touched).
    """
    kw = {}
    if num_workers > 0:
        kw = dict(prefetch_factor=prefetch_factor, persistent_workers=True,
                  worker_init_fn=_ignore_stop_signals)
    return MicroBatchLoader(torch.utils.data.DataLoader(
        _HostBatches(dataset), sampler=sampler, batch_size=None, collate_fn=_as_is,
        num_workers=num_workers, pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed), **kw))


class SplitLoaders:
    """One loader per split (``train``, ``valid``, ``test``), each with its worker processes
    started here — call it before the model and the DeepSpeed engine exist — and pointed at a
    position by :meth:`get` whenever a pass begins.

    Why before: a worker is a fork of its rank. Forked after the engine, it keeps, copy on write,
    every page of the rank's memory that the rank later rewrites — under ZeRO with CPU offload,
    the whole fp32 optimizer state each step — so each forked set of workers came to hold a stale
    copy of it (measured: modernbert-large, ZeRO-3 + offload at 2 ranks, ranks at 8.1 GB each and
    their four workers at 5.7 GB each when the kernel's OOM killer stopped the run;
    bench/rehearse.py). Forked before, a worker shares only the imports and the datasets' memory
    maps. The workers persist (``persistent_workers``); a new pass or a new position (a resume
    or a loss-spike rollback) reuses them.

    Args:
        datasets: the splits to read, by name (``BlendedDataset`` each).
        global_batch_size, micro_batch_size, dp_rank, dp_size: as ``DataParallelSampler``.
        num_workers, pin_memory, prefetch_factor, seed: as ``build_loader``.
    """

    def __init__(self, datasets: dict, *, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, num_workers: int, pin_memory: bool,
                 prefetch_factor: Optional[int] = 2, seed: int = 0):
        self._loaders: dict[str, tuple[DataParallelSampler, MicroBatchLoader]] = {}
        for split, data in datasets.items():
            sampler = DataParallelSampler(total_samples=0, consumed_samples=0,
                                          global_batch_size=global_batch_size,
                                          micro_batch_size=micro_batch_size, dp_rank=dp_rank,
                                          dp_size=dp_size)
            loader = build_loader(data, sampler, num_workers=num_workers, pin_memory=pin_memory,
                                  prefetch_factor=prefetch_factor, seed=seed)
            if num_workers > 0:  # an empty first pass forks the persistent workers now
                iter(loader.dataloader)
            self._loaders[split] = (sampler, loader)

    def get(self, split: str, *, consumed: int, total: int, skip: Ranges = ()) -> MicroBatchLoader:
        """``split``'s loader, reading from sample ``consumed`` to ``total`` (outside ``skip``)
        in the passes begun from now on."""
        sampler, loader = self._loaders[split]
        sampler.reposition(total_samples=total, consumed_samples=consumed, skip=skip)
        return loader

    def close(self) -> None:
        """Drops the loaders; torch ends their workers with them."""
        self._loaders.clear()
