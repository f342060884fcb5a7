"""Weights & Biases and the step profiler without a launcher: the flags' checks, the one-line
error when wandb is missing, the fan-out to every sink, and a CPU torch.profiler trace of the
traced iterations with the RTD step's phase ranges (tests/e2e/test_monitoring_launcher.py runs
both through the real launcher)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from rtd_scale.config import ConfigError, MonitorConfig
from rtd_scale import phases
from rtd_scale.training.metrics import MetricsLogger
from rtd_scale.training.profiler import StepProfiler
from tests.helpers.launcher import pretrain_error


def _args(wiki_shards, save, *extra):
    tok, prefix = wiki_shards
    return ["--ds_config", "ds_configs/zero3.json", "--data-path", prefix, "--tokenizer-model",
            tok, "--save", str(save), "--train-iters", "2", "--micro-batch-size", "4",
            "--global-batch-size", "8", *extra]


def test_megatron_defaults():
    m = MonitorConfig()  # Megatron-LM's arguments.py: start 10, end 12, ranks [0]
    assert (m.profile_step_start, m.profile_step_end, m.profile_ranks) == (10, 12, [0])
    assert list(m.profiled_iterations) == [10, 11]


@pytest.mark.parametrize("start,end", [(0, 2), (5, 5), (6, 3)])
def test_profile_range_refused(start, end):
    m = MonitorConfig(profile=True, profile_step_start=start, profile_step_end=end)
    with pytest.raises(ConfigError, match=rf"--profile-step-start {start} --profile-step-end "
                                          rf"{end}: .*1 <= start < end"):
        m.validate(train_iters=100)


def test_profile_ranks_from_set_are_ints():
    m = MonitorConfig(profile=True, profile_ranks=["0", "1"])  # --set gives strings
    m.validate(train_iters=100)
    assert m.profile_ranks == [0, 1]
    with pytest.raises(ConfigError, match="--profile-ranks 0 x: expected global rank numbers"):
        MonitorConfig(profile_ranks=["0", "x"]).validate(train_iters=100)


def test_missing_wandb_is_one_line_naming_the_extra(wiki_shards, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importlib.util.find_spec → None
    err = pretrain_error(capsys, _args(wiki_shards, tmp_path / "run", "--wandb-project", "p"),
                         monkeypatch)
    assert err == ("error: --wandb-project p: the wandb package is not installed; "
                   "pip install 'rtd_scale[wandb]' (or drop --wandb-project)")
    assert not (tmp_path / "run").exists()  # stopped before anything was written


def test_wandb_without_a_directory(wiki_shards, capsys, monkeypatch):
    tok, prefix = wiki_shards
    argv = ["--ds_config", "ds_configs/zero3.json", "--data-path", prefix, "--tokenizer-model",
            tok, "--train-iters", "2", "--wandb-project", "p"]
    assert pretrain_error(capsys, argv, monkeypatch) == (
        "error: --wandb-project p: W&B needs a directory for its files; pass --wandb-save-dir "
        "DIR or --save")


def test_profile_rank_outside_the_world(wiki_shards, tmp_path, capsys, monkeypatch):
    err = pretrain_error(capsys, _args(wiki_shards, tmp_path / "run", "--profile",
                                       "--profile-ranks", "0", "3"), monkeypatch, world_size=2)
    assert err == ("error: --profile-ranks 3: no such rank (the world has ranks 0 … 1); pass "
                   "global ranks below 2")


def test_metrics_logger_hands_every_sink_the_same_values():
    class Sink:
        def __init__(self):
            self.got, self.closed = [], False

        def write(self, step, scalars):
            self.got.append((step, dict(scalars)))

        def write_text(self, tag, text, step):
            self.got.append((step, {tag: text}))

        def close(self):
            self.closed = True

    a, b = Sink(), Sink()
    log = MetricsLogger(a, None, b)  # a sink not asked for (None) is left out
    log.write(3, {"loss/mlm": 1.25})
    log.write_text("config/run", "{}", 3)
    log.close()
    assert a.got == b.got == [(3, {"loss/mlm": 1.25}), (3, {"config/run": "{}"})]
    assert a.closed and b.closed


class _Pair(torch.nn.Module):
    """Stands in for the RTD model: two encoders under the step's phase ranges."""

    def __init__(self):
        super().__init__()
        self.generator, self.discriminator = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        with torch.profiler.record_function(phases.PHASE_GENERATOR_FORWARD):
            h = self.generator(x)
        with torch.profiler.record_function(phases.PHASE_DISCRIMINATOR_FORWARD):
            return self.discriminator(h).sum()


@pytest.mark.parametrize("first_step", [1, 3])
def test_profiler_traces_the_asked_iterations(tmp_path, first_step):
    """Iterations 3–4 traced; a run resumed at iteration 3 traces them too, without a warm-up
    iteration before them; one log line names the trace."""
    lines = []
    m = MonitorConfig(profile=True, profile_step_start=3, profile_step_end=5, profile_ranks=[0])
    prof = StepProfiler(m, rank=0, device=torch.device("cpu"), tensorboard_dir=str(tmp_path),
                        first_step=first_step, print_fn=lines.append)
    model, opt = _Pair(), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for done in range(first_step, 7):
        with torch.profiler.record_function(f"iteration_{done}"):
            loss = model(torch.randn(2, 4))
            with torch.profiler.record_function(phases.PHASE_BACKWARD):
                loss.backward()
            with torch.profiler.record_function(phases.PHASE_OPTIMIZER_STEP):
                opt.step()
        prof.step(done)
    prof.close()
    traces = sorted((tmp_path / "profile").glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].name.startswith("rank0_iter3-4."), traces
    assert lines == [f"profiler: iterations 3–4 of rank 0 traced to {traces[0]} "
                     "(TensorBoard's profiler plugin or https://ui.perfetto.dev)"]
    names = {e.get("name") for e in json.loads(traces[0].read_text())["traceEvents"]}
    assert {"iteration_3", "iteration_4"} <= names
    assert not names & {f"iteration_{i}" for i in (1, 2, 5, 6)}
    assert {phases.PHASE_GENERATOR_FORWARD, phases.PHASE_DISCRIMINATOR_FORWARD, phases.PHASE_BACKWARD,
            phases.PHASE_OPTIMIZER_STEP} <= names


def test_profiler_with_stack_names_the_modules(tmp_path):
    m = MonitorConfig(profile=True, profile_step_start=1, profile_step_end=2,
                      profile_with_stack=True)
    prof = StepProfiler(m, rank=0, device=torch.device("cpu"), tensorboard_dir=str(tmp_path),
                        first_step=1, print_fn=lambda line: None)
    _Pair()(torch.randn(2, 4))
    prof.step(1)
    prof.close()
    trace, = (tmp_path / "profile").glob("rank0_iter1-1.*.pt.trace.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"nn.Module: _Pair_0", "nn.Module: Linear_0", "nn.Module: Linear_1"} <= names


def test_profiler_off_for_other_ranks_and_past_ranges(tmp_path):
    m = MonitorConfig(profile=True, profile_step_start=3, profile_step_end=5, profile_ranks=[1])
    assert StepProfiler(m, rank=0, device=torch.device("cpu"), tensorboard_dir=str(tmp_path),
                        first_step=1).prof is None
    m.profile_ranks = [0]  # resumed after the traced iterations
    assert StepProfiler(m, rank=0, device=torch.device("cpu"), tensorboard_dir=str(tmp_path),
                        first_step=5).prof is None


def test_a_broken_wandb_run_record_is_one_line(tmp_path):
    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.training.wandb_logger import previous_run_id

    assert previous_run_id(str(tmp_path)) is None  # no record: a new W&B run
    (tmp_path / "wandb_run.json").write_text('{"id": "abc123"}\n')
    assert previous_run_id(str(tmp_path)) == "abc123"
    (tmp_path / "wandb_run.json").write_text("{trunc")
    with pytest.raises(UserInputError, match=r"wandb_run.json: not a W&B run record .*delete it "
                                             "to start a new W&B run"):
        previous_run_id(str(tmp_path))
