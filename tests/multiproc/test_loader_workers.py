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
