"""The DataLoader with worker processes (rtd_scale/data/loader.py): the batches of reading in
this process, resumable, and the global RNG left alone."""
from __future__ import annotations

import torch

from rtd_scale.data.blend import build_split
from rtd_scale.data.loader import DataParallelSampler, build_loader


def test_loader_workers_give_the_same_batches_and_leave_the_global_rng_alone(two_datasets):
    a, b = two_datasets
    data = build_split([(0.6, [a]), (0.4, [b])], seq_length=16, split=(1,), part=0, seed=1)

    def read(workers, consumed):
        sampler = DataParallelSampler(total_samples=96, consumed_samples=consumed,
                                      global_batch_size=8, micro_batch_size=4, dp_rank=1,
                                      dp_size=2)
        return list(build_loader(data, sampler, num_workers=workers, pin_memory=False,
                                 prefetch_factor=2, seed=1))

    state = torch.get_rng_state()
    plain, workers, resumed = read(0, 0), read(2, 0), read(2, 48)
    assert torch.equal(torch.get_rng_state(), state)  # dropout's generator untouched
    assert len(plain) == len(workers) == 12 and len(resumed) == 6
    for x, y in zip(plain, workers):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.sample_index, y.sample_index)
    for x, y in zip(plain[6:], resumed):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.sample_index, y.sample_index)
    assert torch.equal(plain[0].sample_index, torch.arange(4, 8))


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _worker_pids(loader) -> list[int]:
    # torch's iterator keeps its worker processes (multiprocessing.Process) in ``_workers``
    return [w.pid for w in loader.dataloader._iterator._workers]


def test_split_loaders_fork_before_a_large_allocation_and_reposition_without_new_workers(
        two_datasets):
    from rtd_scale.data.loader import SplitLoaders

    a, b = two_datasets
    data = build_split([(0.6, [a]), (0.4, [b])], seq_length=16, split=(1,), part=0, seed=1)
    kw = dict(global_batch_size=8, micro_batch_size=4, dp_rank=1, dp_size=2)
    loaders = SplitLoaders({"train": data}, num_workers=2, pin_memory=False, seed=1, **kw)
    # what a training rank holds after its engine (ZeRO offload's fp32 state): 512 MB, written
    big = torch.ones(128 * 2**20)
    late = build_loader(data, DataParallelSampler(total_samples=96, consumed_samples=0, **kw),
                        num_workers=2, pin_memory=False, seed=1)
    iter(late.dataloader)  # forks its workers now, after the allocation
    try:
        early_pids = _worker_pids(loaders.get("train", consumed=0, total=96))
        # a forked worker's resident size counts the pages it shares with its parent: the
        # workers forked after the allocation hold it (the control), those forked before do not
        early = max(_rss_bytes(p) for p in early_pids)
        assert min(_rss_bytes(p) for p in _worker_pids(late)) - early > 0.9 * big.numel() * 4
        plain = list(build_loader(data, DataParallelSampler(total_samples=96, consumed_samples=0,
                                                            **kw),
                                  num_workers=0, pin_memory=False))
        first = list(loaders.get("train", consumed=0, total=96))
        # a rollback's new position (samples 16–31 skipped): the same processes read it
        moved = list(loaders.get("train", consumed=8, total=96, skip=[(16, 32)]))
        assert _worker_pids(loaders.get("train", consumed=0, total=0)) == early_pids
    finally:
        loaders.close()
        del late, big
    assert len(first) == 12 and len(moved) == 11  # (96 − 8) // 8 steps
    for x, y in zip(plain, first):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.sample_index, y.sample_index)
    # rank 1's half of each step: [8, 16) → 12–15; the next skips [16, 32): [32, 40) → 36–39
    assert torch.equal(moved[0].sample_index, torch.arange(12, 16))
    assert torch.equal(moved[1].sample_index, torch.arange(36, 40))
