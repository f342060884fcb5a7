"""The loss-spike rule and what the loop does with a spike (rtd_scale/training/spikes.py, the
loop's ``_answer_spikes``): the negative control is three real training curves that never
trigger it; the positive cases are the same curves with one iteration raised. The rollback
through the launcher, with a corrupted batch: tests/e2e/test_loss_spike_rollback.py."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from rtd_scale.config import LossSpikePolicy, TrainConfig
from rtd_scale.training.loop import _answer_spikes
from rtd_scale.training.metrics import MetricsLogger
from rtd_scale.training.spikes import (CLIENT_KEY, Crossing, LossSpikeRollbacksError, Spike,
                                       SpikeMonitor, SpikeRule, SpikeState)
from tests.helpers.env import TEST_DATA

# per-iteration (step, L_MLM, L_RTD, grad norm) of three ordinary runs, read from their log
# lines (--log-interval 1): tests/data/loss_curves.json says which runs
CURVES = json.loads((TEST_DATA / "loss_curves.json").read_text())
DEFAULTS = TrainConfig()


def _rule(window: int) -> SpikeRule:
    return SpikeRule(window, DEFAULTS.loss_spike_threshold, DEFAULTS.loss_spike_min_rise)


def _spikes(rows, window: int) -> list[int]:
    rule = _rule(window)
    return [r[0] for r in rows if (c := rule.observe(r[0], r[1:])) is not None and c.is_spike]


@pytest.mark.parametrize("name", sorted(CURVES))
@pytest.mark.parametrize("window", [20, 50, DEFAULTS.loss_spike_window_iters])
def test_normal_training_curves_never_spike(name, window):
    """The negative control: each curve from its first iteration (the steep descent and the
    grad-norm swings of warm-up included; the known-answer run's L_MLM wiggles by ±30% near
    0.6), at the e2e test's window, a longer one and the default, under the default
    threshold."""
    rows = CURVES[name]["rows"]
    assert len(rows) - window >= 20  # armed over 20 iterations at least
    assert _spikes(rows, window) == []


def _limit(rows, at: int, q: int, window: int) -> float:
    rule = _rule(window)
    for r in rows[:at]:
        rule.observe(r[0], r[1:])
    return rule.limits()[q - 1][1]


@pytest.mark.parametrize("name", sorted(CURVES))
def test_one_raised_iteration_is_the_one_spike_found(name):
    """The same curves with one iteration's L_MLM or L_RTD raised just over its limit: found at
    that iteration and nowhere else; just under it, not found."""
    rows = CURVES[name]["rows"]
    at = len(rows) - 15
    for q in (1, 2):
        limit = _limit(rows, at, q, 20)
        for factor, want in ((1.01, [rows[at][0]]), (0.99, [])):
            raised = [list(r) for r in rows]
            raised[at][q] = factor * limit
            assert _spikes(raised, 20) == want, (q, factor)


def test_the_tiny_presets_limit_is_below_the_corrupted_batchs_rise():
    """Past the steep descent, the tiny preset's L_MLM limit (window 20, as in the e2e test)
    stays under the rise a batch of text read with another tokenizer's ids in half the global
    batch gave (1.22 × the median at iteration 32, tests/e2e/test_loss_spike_rollback.py).
    A window that holds part of the descent has a wider spread and so a higher limit (1.29 ×
    at iteration 25 with window 20; 1.22 × at iteration 115 with window 100 over this
    120-iteration curve): a spike there has to be larger to count."""
    rows = CURVES["tiny"]["rows"]
    rule = _rule(20)
    for r in rows[:-5]:
        rule.observe(r[0], r[1:])
    median, limit = rule.limits()[0]
    assert limit / median < 1.2


def test_the_rule_is_its_docstring_and_arms_once_the_window_is_full():
    values = [2.0, 2.2, 1.9, 2.1, 2.0]  # median 2.0; logs' median absolute deviation ~0.048

    def filled() -> SpikeRule:
        rule = _rule(5)
        for step, x in enumerate(values, 1):
            assert rule.observe(step, (x, 0.5, 1.0)) is None  # not armed: nothing crosses
        assert rule.armed
        return rule

    logs = [math.log(x) for x in values]
    m = sorted(logs)[2]
    s = 1.4826 * sorted(abs(v - m) for v in logs)[2]
    limit = math.exp(m + max(6.0 * s, math.log(1.1)))
    median, got = filled().limits()[0]
    assert median == pytest.approx(2.0) and got == pytest.approx(limit) and limit / 2 > 1.1
    below = filled()
    assert below.observe(6, (limit * 0.999, 0.5, 1.0)) is None
    assert [s for s, _ in below.history] == [2, 3, 4, 5, 6]
    above = filled()
    crossing = above.observe(6, (limit * 1.001, 0.5, 1.0))
    assert crossing.is_spike and crossing.over == {0: (limit * 1.001, median, got)}
    assert [s for s, _ in above.history] == [1, 2, 3, 4, 5]  # the spike stays out


def _out(mlm: float, rtd: float):
    return SimpleNamespace(mlm_loss=torch.tensor(mlm), rtd_loss=torch.tensor(rtd))


def _monitor(window: int = 20) -> SpikeMonitor:
    return SpikeMonitor(_rule(window), torch.device("cpu"), loss_rank=True, norm_rank=True)


def test_the_grad_norm_never_spikes_alone_but_a_crossing_just_before_a_spike_belongs_to_it():
    """A gradient norm ten times its median is a crossing, not a spike; right before a loss
    spike it widens the spike (and the samples it skips) back to its iteration. Each
    iteration's loss is its two micro-batches' mean, as the loop adds them."""
    rows = CURVES["debertav3-tiny"]["rows"][300:341]  # past the steep descent
    mon = _monitor()
    for step, mlm, rtd, norm in rows[:40]:
        mon.record(step, [_out(mlm, rtd), _out(mlm, rtd)], norm, (32 * step - 32, 32 * step))
    assert mon.check() == []
    step, mlm, rtd, norm = rows[40]
    mon.record(step, [_out(mlm, rtd)] * 2, 10 * norm, (32 * step - 32, 32 * step))  # the norm
    mon.record(step + 1, [_out(mlm, rtd)] * 2, norm, (32 * step, 32 * step + 32))
    assert mon.check() == []
    first = 32 * step + 32
    mon.record(step + 2, [_out(mlm, rtd)] * 2, torch.tensor(10 * norm), (first, first + 32))
    mon.record(step + 3, [_out(1.3 * mlm, rtd)] * 2, norm, (first + 32, first + 64))  # spike
    mon.record(step + 4, [_out(mlm, rtd)] * 2, 10 * norm, (first + 64, first + 96))  # damage
    (spike,) = mon.check()
    assert (spike.first_step, spike.last_step, spike.samples) == (step + 2, step + 3,
                                                                  (first, first + 64))
    assert spike.ratio == pytest.approx(1.3, rel=0.05)
    assert f"iterations {step + 2}–{step + 3} ({step + 2}: grad norm" in spike.describe()


def test_state_goes_through_the_checkpoint_and_a_rollback_forgets_what_came_after():
    mon = _monitor(window=4)
    for step in range(1, 7):
        mon.record(step, [_out(3.0, 0.5)], None, (step * 8 - 8, step * 8))
    assert mon.check() == []
    state = SpikeState(skipped=[(8, 16)], rollbacks=1, window=mon.rule.state())
    client = json.loads(json.dumps({CLIENT_KEY: state.to_client()}))  # plain data
    again = SpikeState.from_client(client)
    assert (again.skipped, again.rollbacks) == ([(8, 16)], 1)
    assert [row[:3] for row in again.window] == [[s, 3.0, 0.5] for s in (3, 4, 5, 6)]
    assert math.isnan(again.window[0][3])  # no gradient norm known: left out
    assert SpikeState.from_client({"step": 3}) == SpikeState()  # a checkpoint from before
    mon.forget_after(4)
    assert [s for s, _ in mon.rule.history] == [3, 4] and not mon.rule.armed


def _spike(step: int = 12) -> Spike:
    return Spike(step, step, (176, 192), (Crossing(step, {0: (7.0, 5.6, 6.16)}),))


def _answer(policy, ours, state=None, stopping=False, limit=5):
    t = TrainConfig(loss_spike_policy=policy, max_loss_spike_rollbacks=limit, save="runs/x")
    lines: list[str] = []
    back = _answer_spikes([_spike()], t, state or SpikeState(), ours, 12, MetricsLogger(),
                          lines.append, rollback_possible=not stopping)
    return back, lines


def test_what_a_spike_does_under_each_policy():
    ours = [(5, "runs/x/global_step5"), (10, "runs/x/global_step10"), (12, "runs/x/global_step12")]
    assert _answer(LossSpikePolicy.ROLLBACK, ours) == ((10, "runs/x/global_step10"), [])
    back, lines = _answer(LossSpikePolicy.WARN, ours)
    assert back is None and lines == [
        "warning: loss spike at iteration 12 (12: mlm loss 7.000E+00 = 1.25 × its median "
        "(limit 1.10 ×)); --loss-spike-policy warn: training goes on"]
    back, lines = _answer(LossSpikePolicy.ROLLBACK, ours[2:])  # no checkpoint before it
    assert back is None and lines[0].endswith(
        "no checkpoint of this run before it to roll back to; training goes on")
    back, lines = _answer(LossSpikePolicy.ROLLBACK, ours, stopping=True)
    assert back is None and "stops here without saving" in lines[0]
    with pytest.raises(LossSpikeRollbacksError) as e:
        _answer(LossSpikePolicy.ROLLBACK, ours, state=SpikeState(rollbacks=5))
    assert str(e.value) == (
        "loss spike at iteration 12 (12: mlm loss 7.000E+00 = 1.25 × its median (limit 1.10 ×)) "
        "after 5 rollback(s) (--max-loss-spike-rollbacks 5); stopped at iteration 12; the last "
        "checkpoint before it is runs/x/global_step10; lower --lr or raise --lr-warmup-iters, "
        "or raise --max-loss-spike-rollbacks, then resume with --load runs/x")


def test_recording_an_iteration_never_waits_for_the_device():
    """What the loop adds every iteration (STYLE rule 9): no operation that would make the host
    wait for a GPU, whatever form the gradient norm takes; the check reads once."""
    from tests.helpers.sync import SyncRecorder

    mon = _monitor()
    with SyncRecorder() as rec:
        for step, norm in enumerate((2.5, torch.tensor(2.5, dtype=torch.float64), None), 1):
            mon.record(step, [_out(3.0, 0.5)] * 2, norm, (16 * step - 16, 16 * step))
    assert rec.ops == []
    with SyncRecorder() as rec:
        assert mon.check() == []
    assert len(rec.ops) <= 1, rec.ops
