"""Straggler naming (rtd_scale/training/stragglers.py): a rank that arrives late at the step's
first collective is the one named, not the peers that waited for it; with no late rank nobody
is named (the negative control). The real slow rank through the launcher:
tests/e2e/test_unattended.py."""
from __future__ import annotations

import pytest

from rtd_scale.training.stragglers import (StragglerMeter, format_fields, named,
                                           relative_speeds, summary_line)


def test_the_sleeping_rank_is_named_not_the_ranks_that_waited_for_it():
    # 4 ranks, 600 ms of work each; rank 2 sleeps 1500 ms before its step, so every rank's step
    # takes 2100 ms (the others wait in the first collective)
    arrive = [20.0, 22.0, 1521.0, 19.0]
    speeds = relative_speeds(2100.0, arrive)
    assert named(speeds, 0.7) == [(2, pytest.approx(600 / 2100, abs=0.01))]
    # the ranks that waited for it are as fast as their peers' median (rank 2 is one of three)
    assert all(s == pytest.approx(1.0, abs=0.01) for r, s in enumerate(speeds) if r != 2)
    # with two ranks the peer's median is the other rank alone
    assert [r for r, _ in named(relative_speeds(2100.0, [20.0, 1520.0]), 0.7)] == [1]


def test_no_rank_is_named_without_a_late_one():
    for arrive in ([20.0, 22.0, 25.0, 19.0], [150.0, 140.0], [5.0]):  # loader jitter only
        assert named(relative_speeds(600.0, arrive), 0.7) == []
    # a rank 25% late is above 0.7 of its peers: reported in TensorBoard, not named
    speeds = relative_speeds(800.0, [0.0, 0.0, 200.0])
    assert min(speeds) == pytest.approx(0.75) and named(speeds, 0.7) == []
    assert named(relative_speeds(2100.0, [0.0, 1500.0]), 0.0) == []  # threshold 0: off


def test_the_log_field_and_the_summary_line():
    assert format_fields([], 0.7) == ""
    assert format_fields([(3, 0.412), (1, 0.6)], 0.7) == \
        " stragglers (< 0.70 of the median peer): rank 3 0.41, rank 1 0.60 |"
    assert summary_line({"threshold": 0.7, "intervals": 6, "ranks": {}}) == \
        "  stragglers (own work below 0.70 of the median peer's): none in 6 log intervals"
    assert summary_line({"threshold": 0.7, "intervals": 6, "ranks": {1: (3, 0.29)}}) == \
        ("  stragglers (own work below 0.70 of the median peer's): rank 1 in 3 of 6 log "
         "intervals (lowest 0.29)")
    assert summary_line(None) is None


def test_the_meter_measures_the_time_to_the_first_collective_in_one_process():
    t = [0.0]
    meter = StragglerMeter(0.7, clock=lambda: t[0])
    for _ in range(4):
        meter.step_start()
        t[0] += 0.010  # data
        meter.data_done()
        t[0] += 0.002  # the fault hook, host work
        meter.ready()
        t[0] += 0.5  # the step's compute and collectives
    scalars: dict = {}
    assert meter.gather(512.0, scalars) == ""  # one rank: nobody to compare with
    assert scalars["stragglers/count"] == 0 and scalars["stragglers/slowest_rank"] == 0
    assert scalars["stragglers/max_data_wait_ms"] == pytest.approx(10.0)
    assert meter.summary() == {"threshold": 0.7, "intervals": 1, "ranks": {}}
