"""Per-phase timers (training/timers.py, --timing-log-level): levels, the per-iteration means,
one device synchronize per read on CUDA and none on the CPU path, the log-line field, and the
fine phases — the step's masking and the model's parts, timed from outside the model by hooks —
adding up to the forward."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from rtd_scale.config import ConfigError
from rtd_scale.presets import preset
from rtd_scale.model.rtd import RTDModel
from rtd_scale import phases
from rtd_scale.training import timers as timers_mod
from rtd_scale.phases import (PHASE_BACKWARD, PHASE_DATA_WAIT,
                                       PHASE_DISCRIMINATOR_FORWARD, PHASE_FORWARD,
                                       PHASE_GENERATOR_FORWARD, PHASE_MASK, PHASE_OPTIMIZER_STEP,
                                       PHASE_PIPELINE_DISCRIMINATOR_PASS,
                                       PHASE_PIPELINE_GENERATOR_PASS, PHASE_PIPELINE_ID_HANDOVER,
                                       PHASE_PIPELINE_TIED_GRADIENTS, PHASE_SAMPLE)
from rtd_scale.training.timers import (LEVELS, NO_TIMERS, PARTS, CudaEventClock, PhaseTimers,
                                       format_timer_fields, timed_parts, timer_scalars)
from tests.helpers.sync import SyncRecorder

FINE = (PHASE_MASK, PHASE_GENERATOR_FORWARD, PHASE_SAMPLE, PHASE_DISCRIMINATOR_FORWARD)


class FakeClock:
    """A clock that advances 1 ms per reading and counts settles."""

    def __init__(self):
        self.t, self.settles, self.readings = 0.0, 0, 0

    def now(self):
        self.readings += 1
        self.t += 0.001
        return self.t

    def settle(self):
        self.settles += 1

    @staticmethod
    def elapsed_ms(a, b):
        return 1000.0 * (b - a)


def test_phase_names_and_levels():
    assert phases.ALL == ("rtd/data_wait", "rtd/mask", "rtd/generator_forward", "rtd/sample",
                          "rtd/discriminator_forward", "rtd/backward", "rtd/optimizer_step")
    assert set(LEVELS) == set(phases.ALL) | {PHASE_FORWARD} | set(phases.PIPELINE)
    assert {p for p, lv in LEVELS.items() if lv == 2} == set(FINE)
    assert timer_scalars({PHASE_DATA_WAIT: 1.5, PHASE_PIPELINE_ID_HANDOVER: 0.25}) == {
        "timers/data_wait_ms": 1.5, "timers/pipeline_id_handover_ms": 0.25}


def test_levels_choose_what_is_timed_and_read_gives_ms_per_iteration():
    clock = FakeClock()
    coarse = PhaseTimers(1, clock=clock)
    for _ in range(4):  # 4 iterations: forward entered twice per iteration, mask never timed
        with coarse(PHASE_FORWARD):
            with coarse(PHASE_MASK):
                pass
        with coarse(PHASE_FORWARD):
            pass
    assert clock.readings == 16  # two per level-1 entry, none for the level-2 phase
    # each entry: start reading, end reading 1 ms later (the fake clock) → 2 ms per iteration
    assert coarse.read(4) == pytest.approx({PHASE_FORWARD: 2.0})
    assert clock.settles == 1
    assert coarse.read(4) == {} and clock.settles == 1  # nothing since: no settle either

    fine = PhaseTimers(2, clock=FakeClock())
    with fine(PHASE_FORWARD):
        with fine(PHASE_MASK):  # readings 2, 3 inside 1 .. 4
            pass
    assert fine.read(1) == pytest.approx({PHASE_FORWARD: 3.0, PHASE_MASK: 1.0})

    off = PhaseTimers(0, clock=FakeClock())
    with off(PHASE_DATA_WAIT), off(PHASE_MASK):
        pass
    assert off.read(1) == {} and off.clock.readings == 0
    with NO_TIMERS(PHASE_FORWARD):
        pass
    assert NO_TIMERS.read(1) == {}


def test_cuda_path_records_events_and_synchronizes_once_per_read(monkeypatch):
    """The CUDA clock's real code with fake events: recording at every boundary, no
    synchronize and no elapsed_time until read(), then exactly one synchronize."""
    calls = {"sync": 0, "elapsed": 0, "recorded": 0}

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            calls["recorded"] += 1
            self.at = float(calls["recorded"])

        def elapsed_time(self, end):
            calls["elapsed"] += 1
            return end.at - self.at

    def synchronize(device=None):
        calls["sync"] += 1

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    t = PhaseTimers(1, clock=CudaEventClock(torch.device("cuda", 0)))
    for _ in range(10):
        with t(PHASE_BACKWARD):
            pass
    assert calls == {"sync": 0, "elapsed": 0, "recorded": 20}
    assert t.read(10) == pytest.approx({PHASE_BACKWARD: 1.0})
    assert calls["sync"] == 1 and calls["elapsed"] == 10


def test_device_picks_the_clock():
    assert isinstance(PhaseTimers(1, torch.device("cpu")).clock, timers_mod.HostClock)
    assert isinstance(PhaseTimers(1, torch.device("cuda", 0)).clock, CudaEventClock)


def _tiny_model():
    cfg = preset("tiny")
    cfg.model.vocab_size = 300
    for name in ("generator", "discriminator"):
        setattr(cfg.model, name, dataclasses.replace(
            getattr(cfg.model, name), hidden_size=32, ffn_hidden_size=64, hidden_dropout=0.0,
            attention_dropout=0.0))
    cfg.model.embedding_size = 32
    torch.manual_seed(3)
    return RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=(0, 1, 2, 3, 4),
                    pad_id=0, mask_id=4, seed=3)


def _ids(b=4, s=64):
    ids = torch.randint(5, 300, (b, s), generator=torch.Generator().manual_seed(1))
    ids[:, 0], ids[:, -1] = 1, 2
    return ids


def _timed_forward(model, timers, ids, step):
    """The one-stage step's forward as ``training/step.py`` times it: the masking at the step
    level, the model's parts by hooks (``timed_parts``)."""
    with timers(PHASE_FORWARD):
        with timers(PHASE_MASK):
            masks = model.mask(ids, torch.arange(ids.shape[0]))
        with timed_parts(model, timers):
            return model(ids, torch.arange(ids.shape[0]), step=step, masks=masks)


def test_fine_timers_on_cpu_never_wait_nor_touch_cuda(single_process_group, monkeypatch):
    """The level-2 step on the CPU path: no operation that would make the host wait for a GPU
    (SyncRecorder), no torch.cuda call, the same loss as the untimed step, and no hook left
    on the model after it."""
    def refuse(*a, **k):
        raise AssertionError("the CPU timers called torch.cuda")

    model = _tiny_model()
    ids = _ids()
    untimed = model(ids, torch.arange(4), step=7)
    for name in ("Event", "synchronize", "current_stream", "is_available", "device_count"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    t = PhaseTimers(2, torch.device("cpu"))
    rec = SyncRecorder()
    with rec:
        for _ in range(2):
            out = _timed_forward(model, t, ids, step=7)
            with t(PHASE_BACKWARD):
                out.loss.backward()
    assert rec.ops == []
    assert torch.equal(out.loss, untimed.loss) and torch.equal(out.corrupted_ids,
                                                               untimed.corrupted_ids)
    ms = t.read(2)
    assert set(ms) == {PHASE_FORWARD, PHASE_BACKWARD, *FINE}
    assert all(v > 0 for v in ms.values())
    for name in PARTS:
        part = getattr(model, name)
        assert not part._forward_pre_hooks and not part._forward_hooks, name


def test_fine_phases_add_up_to_the_forward(single_process_group):
    """The four fine phases cover the forward but for the losses, counts and a few tensor ops
    between the parts: their sum is within 10 % + 1 ms per iteration of the forward timed
    around the call (measured 5 % on CPU)."""
    model = _tiny_model()
    ids = _ids(8, 64)
    t = PhaseTimers(2, torch.device("cpu"))
    model(ids, torch.arange(8), step=0)  # warm-up, untimed
    start = time.perf_counter()
    for step in range(5):
        _timed_forward(model, t, ids, step)
    wall_ms = 1000 * (time.perf_counter() - start) / 5
    ms = t.read(5)
    fine = sum(ms[p] for p in FINE)
    assert fine <= ms[PHASE_FORWARD] <= wall_ms
    assert ms[PHASE_FORWARD] - fine <= 0.1 * ms[PHASE_FORWARD] + 1.0, ms
    assert ms[PHASE_GENERATOR_FORWARD] > ms[PHASE_MASK]


def test_log_line_field():
    one_stage = timer_scalars({PHASE_DATA_WAIT: 1.23, PHASE_FORWARD: 30.0, PHASE_MASK: 0.5,
                               PHASE_GENERATOR_FORWARD: 10.14, PHASE_SAMPLE: 2.0,
                               PHASE_DISCRIMINATOR_FORWARD: 15.26, PHASE_BACKWARD: 50.0,
                               PHASE_OPTIMIZER_STEP: 5.0})
    assert format_timer_fields(dict(one_stage, **{"loss/mlm": 7.0})) == (
        " time ms: data 1.2 | fwd 30.0 [mask 0.5, gen_fwd 10.1, sample 2.0, disc_fwd 15.3] | "
        "bwd 50.0 | step 5.0 |")
    pipeline = timer_scalars({PHASE_DATA_WAIT: 1.0, PHASE_PIPELINE_GENERATOR_PASS: 40.0,
                              PHASE_MASK: 0.5, PHASE_GENERATOR_FORWARD: 9.0, PHASE_SAMPLE: 2.0,
                              PHASE_PIPELINE_ID_HANDOVER: 0.3,
                              PHASE_PIPELINE_DISCRIMINATOR_PASS: 50.0,
                              PHASE_DISCRIMINATOR_FORWARD: 12.0,
                              PHASE_PIPELINE_TIED_GRADIENTS: 0.1, PHASE_OPTIMIZER_STEP: 5.0})
    assert format_timer_fields(pipeline) == (
        " time ms: data 1.0 | gen_pass 40.0 [mask 0.5, gen_fwd 9.0, sample 2.0] | "
        "id_handover 0.3 | disc_pass 50.0 [disc_fwd 12.0] | tied_grads 0.1 | step 5.0 |")
    assert format_timer_fields({"loss/mlm": 7.0}) == ""
    coarse = timer_scalars({PHASE_DATA_WAIT: 1.0, PHASE_FORWARD: 3.0, PHASE_BACKWARD: 4.0,
                            PHASE_OPTIMIZER_STEP: 2.0})
    assert format_timer_fields(coarse) == " time ms: data 1.0 | fwd 3.0 | bwd 4.0 | step 2.0 |"


def test_timing_log_level_is_checked():
    from rtd_scale.arguments import build_parser, config_from_args

    base = ["--ds_config", "x.json", "--data-path", "p", "--tokenizer-model", "t.model"]
    cfg = config_from_args(build_parser().parse_args(base + ["--timing-log-level", "2"]))
    assert cfg.train.timing_log_level == 2
    assert config_from_args(build_parser().parse_args(base)).train.timing_log_level == 0
    with pytest.raises(ConfigError, match=r"^--set train.timing_log_level must be 0 \(no timers\), 1 "
                                          r".* or 2 \(also the forward's phases\), got 3$"):
        config_from_args(build_parser().parse_args(base + ["--set", "train.timing_log_level=3"]))
