"""Blending by weight, the data-parallel sampler and the DataLoader (rtd_scale/data/blend.py,
loader.py), and the data flags' parsing. DataLoader worker processes are in
tests/multiproc/test_loader_workers.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import ConfigError, DataConfig
from rtd_scale.presets import preset
from rtd_scale.data.blend import SPLIT_INDEX_BASE, BlendSchedule, build_split
from rtd_scale.data.loader import (DataParallelSampler, advance, global_batch, merge_ranges,
                                   rank_micro_batches)
from rtd_scale.data.packed import PackedDataset


@pytest.mark.parametrize("weights, period", [([0.7, 0.3], 10), ([0.5, 0.3, 0.2], 10),
                                             ([1, 2], 3), ([1.0], 1)])
def test_blend_holds_the_weights_exactly_every_period(weights, period):
    s = BlendSchedule(weights)
    assert s.period == period
    d, j = s.locate(np.arange(100 * period))
    w = np.asarray(weights) / sum(weights)
    for p in range(100):  # exact proportions in every period, not only on average
        counts = np.bincount(d[p * period:(p + 1) * period], minlength=len(weights))
        np.testing.assert_array_equal(counts, np.round(w * period))
    for di in range(len(weights)):  # each dataset's running index counts 0, 1, 2, … in k order
        np.testing.assert_array_equal(j[d == di], np.arange((d == di).sum()))
    if weights == [0.7, 0.3]:  # interleaved, not 7 A then 3 B
        assert d[:10].tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 1, 0]


def test_blend_of_inexact_weights_is_close_and_a_pure_function_of_k():
    s = BlendSchedule([1.0, 2 ** 0.5, 0.01])
    assert s.period == 10_000
    k = np.arange(200_000)
    d, j = s.locate(k)
    realised = np.bincount(d) / len(k)
    np.testing.assert_allclose(realised, s.weights, atol=1e-4)
    pick = np.random.default_rng(0).choice(len(k), 500, replace=False)
    dp, jp = s.locate(k[pick])  # any k on its own gives the same answer
    np.testing.assert_array_equal(dp, d[pick])
    np.testing.assert_array_equal(jp, j[pick])


def test_a_weight_too_small_to_sample_is_a_clear_error():
    with pytest.raises(UserInputError, match="--data-path: the weight of tiny .* below 1/10000"):
        BlendSchedule([1.0, 1e-6], ["big", "tiny"])


def test_blended_samples_come_from_each_datasets_own_order(two_datasets):
    a, b = two_datasets
    data = build_split([(0.75, [a]), (0.25, [b])], seq_length=16, split=(1,), part=0, seed=3)
    k = np.arange(0, 400)
    d, sample = data.locate(k)
    assert np.bincount(d).tolist() == [300, 100]
    nb = len(data.datasets[1])
    for di, ds in enumerate(data.datasets):
        seen = sample[d == di]
        # dataset b (fewer samples) wraps into its next epoch, reshuffled
        expected = np.concatenate([ds.order(3, e, () if di == 0 else (0, di))
                                   for e in range(-(-len(seen) // len(ds)))])[:len(seen)]
        np.testing.assert_array_equal(seen, expected)
    assert (d == 1).sum() > nb  # really wrapped
    mb = data[k[10:14]]
    assert mb.input_ids.shape == (4, 16) and torch.equal(mb.sample_index, torch.arange(10, 14))
    for row, di, si in zip(mb.input_ids.numpy(), d[10:14], sample[10:14]):
        np.testing.assert_array_equal(row, data.datasets[di][si])
        ids = row[1:][row[1:] > 2]
        assert ((ids >= 500) == bool(di)).all()  # dataset b's ids are 500+, a's 100..149


def test_validation_split_has_its_own_mask_keys_and_order(two_datasets):
    a, _ = two_datasets
    kw = dict(sources=[(1.0, [a])], seq_length=16, split=(8, 2), seed=3)
    train, valid = build_split(part=0, **kw), build_split(part=1, **kw)
    assert valid.datasets[0].document_range == (160, 200)
    assert torch.equal(valid[np.arange(3)].sample_index, SPLIT_INDEX_BASE + torch.arange(3))
    assert torch.equal(train[np.arange(3)].sample_index, torch.arange(3))
    np.testing.assert_array_equal(valid.locate(np.arange(5))[1],
                                  valid.datasets[0].order(3, 0, (1, 0))[:5])


def test_an_empty_validation_split_is_a_clear_error(two_datasets):
    _, b = two_datasets
    with pytest.raises(UserInputError, match=r"--split 100,0\.1 leaves no valid documents in "
                                             r"--data-path b \(60 documents\).*--eval-iters 0"):
        build_split([(1.0, [b])], seq_length=16, split=(100, 0.1), part=1, seed=0)


def test_sampler_resumes_exactly_and_ranks_split_the_global_batch():
    kw = dict(global_batch_size=8, micro_batch_size=2, dp_size=2)
    full = [list(DataParallelSampler(total_samples=80, consumed_samples=0, dp_rank=r, **kw))
            for r in range(2)]
    resumed = [list(DataParallelSampler(total_samples=80, consumed_samples=40, dp_rank=r, **kw))
               for r in range(2)]
    for r in range(2):
        assert len(full[r]) == 20 and len(resumed[r]) == 10
        for x, y in zip(full[r][10:], resumed[r]):
            np.testing.assert_array_equal(x, y)
    # step t: rank 0 reads [8t, 8t+4), rank 1 [8t+4, 8t+8), in micro-batches of 2
    np.testing.assert_array_equal(np.concatenate(full[0][2:4] + full[1][2:4]), np.arange(8, 16))
    assert [m.tolist() for m in rank_micro_batches(16, dp_rank=1, **kw)] == [[20, 21], [22, 23]]


# overlapping and touching on purpose; the checkpoint's field lists them merged
SKIPPED = [(5, 9), (20, 22), (21, 30), (30, 31)]


def _stream_without(skipped, start: int, steps: int, batch: int) -> list[list[int]]:
    """The reference: sample indices from ``start`` on minus the skipped ones, ``batch`` a step."""
    gone = {k for a, b in skipped for k in range(a, b)}
    stream = (k for k in range(start, 10_000) if k not in gone)
    return [[next(stream) for _ in range(batch)] for _ in range(steps)]


def _steps(dp_size: int, consumed: int, steps: int, batch: int, skip) -> list[list[int]]:
    """Every step's global batch as the ranks' samplers read it (rank 0's slice first)."""
    per_step = batch // dp_size // 2  # micro-batches of 2
    ranks = [list(DataParallelSampler(total_samples=consumed + steps * batch,
                                      consumed_samples=consumed, global_batch_size=batch,
                                      micro_batch_size=2, dp_rank=r, dp_size=dp_size, skip=skip))
             for r in range(dp_size)]
    return [np.concatenate([m for r in range(dp_size)
                            for m in ranks[r][t * per_step:(t + 1) * per_step]]).tolist()
            for t in range(steps)]


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_skipped_samples_are_never_read_at_any_data_parallel_size_and_after_resume(dp_size):
    """The loss-spike rollback's ranges (training/spikes.py): every step reads the next global
    batch outside them, split over the ranks as usual; a resume at the position the loop records
    (``advance``), at another data-parallel size or global batch, reads on exactly."""
    from rtd_scale.training.spikes import CLIENT_KEY, SpikeState

    assert merge_ranges(SKIPPED) == [(5, 9), (20, 31)]
    want = _stream_without(SKIPPED, 0, 10, 8)
    assert want[0] == [0, 1, 2, 3, 4, 9, 10, 11] and want[2] == list(range(31, 39))
    assert _steps(dp_size, 0, 10, 8, SKIPPED) == want
    position = 0
    for _ in range(3):  # the checkpoint after step 3 records this position and the ranges
        position = advance(position, 8, SKIPPED)
    assert position == want[2][-1] + 1 == 39
    client = {CLIENT_KEY: SpikeState(skipped=SKIPPED, rollbacks=2).to_client()}
    skip = SpikeState.from_client(client).skipped
    assert skip == [(5, 9), (20, 31)]
    assert _steps(dp_size, position, 7, 8, skip) == want[3:]
    # a resume at another global batch, from a position before a skipped range
    assert _steps(dp_size, 17, 3, 16, skip) == _stream_without(SKIPPED, 17, 3, 16)
    assert global_batch(17, 4, skip).tolist() == [17, 18, 19, 31]
    # without ranges: the contiguous batches of before (the control)
    assert _steps(dp_size, 0, 3, 8, ()) == [list(range(8 * t, 8 * t + 8)) for t in range(3)]
    assert advance(16, 8) == 24


def test_data_path_and_split_flags_parse():
    cfg = DataConfig(data_path=["A", "B"])
    assert cfg.sources() == [(1.0, ["A", "B"])]
    assert DataConfig(data_path=["3", "A", "1", "B"]).sources() == [(0.75, ["A"]), (0.25, ["B"])]
    assert DataConfig(split="969, 30, 1").split_weights() == (969.0, 30.0, 1.0)
    assert DataConfig(split="98,2").split_weights() == (98.0, 2.0, 0.0)
    model = preset("tiny").model
    for bad in (["0.7", "A", "0.3"], ["0.7", "A", "B", "0.3"], ["0.7", "A", "-1", "B"],
                ["0.5", "A", "0.5", "0.5"]):
        with pytest.raises(ConfigError, match="--data-path .*WEIGHT PREFIX pairs"):
            DataConfig(data_path=bad, seq_length=64).validate(model)
    for bad in ("0,1,0", "a,b", "1,2,3,4", "1,-1"):
        with pytest.raises(ConfigError, match=f"^data.split '{bad}'"):
            DataConfig(split=bad, seq_length=64).validate(model)
    with pytest.raises(ConfigError, match="^data.num_workers must be >= 0"):
        DataConfig(num_workers=-1, seq_length=64).validate(model)


def test_no_validation_share_warns_that_eval_has_no_effect():
    cfg = preset("tiny")
    cfg.data.split = "100,0,0"
    with pytest.warns(UserWarning, match="--eval-interval has no effect"):
        cfg.validate()


def test_plain_data_path_is_one_concatenated_dataset(two_datasets):
    a, b = two_datasets
    data = build_split([(1.0, [a, b])], seq_length=16, split=(1,), part=0, seed=0)
    whole = PackedDataset([a, b], seq_length=16, cache=False)
    assert len(data.datasets) == 1 and len(data.datasets[0]) == len(whole)
    assert data.datasets[0].total_documents == 260


@pytest.mark.parametrize("train_iters, eval_interval, start_step, available, says", [
    (3, 1000, 0, 284, True),  # off the interval: validates once, after the last step
    (3, 2, 0, 284, True),  # validates at 2 (2 × 200 samples against 284) and 3
    (3, 2, 2, 284, True),  # resumed after the last validation on the interval: 3 still
    (4, 2, 2, 284, True),  # resumed, validates again at 4
    (3, 2, 3, 284, False),  # nothing left to train (a finished run): no validation
    (3, 2, 0, 400, False),  # the split holds one validation's samples
])
def test_short_validation_note_only_when_a_validation_runs(train_iters, eval_interval,
                                                           start_step, available, says):
    from rtd_scale.training.loop import short_validation_note

    cfg = preset("tiny")
    t = cfg.train
    t.train_iters, t.eval_interval, t.eval_iters, t.global_batch_size = (
        train_iters, eval_interval, 2, 200)
    note = short_validation_note(t, start_step, available)
    assert note == ("note: one validation reads 400 samples but the validation split holds 284: "
                    "samples repeat (masked afresh); lower --eval-iters or raise the validation "
                    "share of --split" if says else None)
