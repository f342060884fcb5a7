"""Weights & Biases (offline) and the step profiler through the real launcher, in one 2-rank run
and its resume: W&B gets TensorBoard's very scalars at the same steps and the resolved config;
the resumed run continues the same W&B run with no step twice; each traced rank writes a
torch.profiler trace of the asked iterations holding the RTD step's phases, each model's work
under its own range."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from rtd_scale import phases
from tests.helpers import wandb_history
from tests.helpers.launcher import common, launch, scalars

pytestmark = pytest.mark.e2e

pytest.importorskip("wandb", reason="the wandb extra: pip install 'rtd_scale[wandb]'")

TRACE_LINE = re.compile(r"profiler: iterations 2–3 of rank (\d) traced to (\S+\.pt\.trace\.json)")


def _equal_as_tensorboard(wandb_value, tb_value: float) -> bool:
    """TensorBoard stores float32; W&B the float64 JSON value (NaN as the string "NaN")."""
    w = float(wandb_value)
    return (math.isnan(w) and math.isnan(tb_value)) or float(np.float32(w)) == tb_value


def _wandb_rows(save) -> dict[str, list[dict]]:
    """Every offline run file under <save>/wandb: {file: its history rows}."""
    return {str(f): wandb_history.history(f)
            for f in sorted((save / "wandb").glob("wandb/offline-run-*/run-*.wandb"))}


def test_wandb_offline_and_profiler_two_ranks_then_resume(wiki_shards, tmp_path, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    save = tmp_path / "run"
    flags = ["--save-interval", "2", "--eval-interval", "2", "--eval-iters", "1",
             "--wandb-project", "rtd-e2e", "--wandb-exp-name", "two-ranks",
             "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
             "--profile-ranks", "0", "1"]
    r = launch(common(wiki_shards, save, 4, flags))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    # the profiler: one line and one trace per traced rank, iterations 2 and 3
    traced = dict(TRACE_LINE.findall(r.stdout))
    assert sorted(traced) == ["0", "1"], r.stdout[-3000:]
    for rank, path in traced.items():
        assert path.startswith(str(save / "tensorboard" / "profile" / f"rank{rank}_iter2-3."))
        events = json.loads(open(path).read())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert set(phases.ALL) <= names, set(phases.ALL) - names
        steps = {n for n in names if n.startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#1", "ProfilerStep#2"}  # this run's 2nd and 3rd steps
        def ranges(phase):
            return [e for e in events if e.get("name") == phase and e.get("ph") == "X"]

        # 2 steps × 2 micro-batches train (a backward and an engine.step each); the validation
        # at iteration 2 adds 2 forwards (one global batch: 2 micro-batches per rank)
        assert len(ranges(phases.PHASE_BACKWARD)) == len(ranges(phases.PHASE_OPTIMIZER_STEP)) == 4
        # the masks: once a step for all its micro-batches (training/step.py's
        # masked_micro_batches), so 2 training steps and the one validation batch
        assert len(ranges(phases.PHASE_MASK)) == 3
        assert len(ranges(phases.PHASE_FORWARD)) == 6  # 4 training forwards and 2 validation
        # a training forward's parts (training/timers.py's PARTS, by hooks for the step's
        # length; validation's forwards are one range each): each model's encoder, head and
        # criterion in its own model's range, matrix products in the encoder's and the head's,
        # and one sampling range
        def with_matmuls(phase):
            return [rg for rg in ranges(phase) if any(
                e.get("cat") == "cpu_op" and e["tid"] == rg["tid"]
                and e.get("name") in ("aten::linear", "aten::addmm", "aten::mm")
                and rg["ts"] <= e["ts"] <= rg["ts"] + rg["dur"] for e in events)]

        for phase in (phases.PHASE_DISCRIMINATOR_FORWARD, phases.PHASE_GENERATOR_FORWARD):
            assert len(ranges(phase)) == 12, phase
            assert len(with_matmuls(phase)) == 8, phase
        assert len(ranges(phases.PHASE_SAMPLE)) == 4

    # W&B: one offline run, TensorBoard's scalars at TensorBoard's steps, the resolved config
    tb = scalars(str(save / "tensorboard"))
    runs = _wandb_rows(save)
    assert len(runs) == 1, runs.keys()
    (first_file, rows), = runs.items()
    assert [row["_step"] for row in rows] == [1, 2, 3, 4]
    run_id = json.loads((save / "wandb_run.json").read_text())["id"]
    assert wandb_history.run_id(first_file) == run_id
    by_step = {row["_step"]: row for row in rows}
    for tag, values in tb.items():
        for step, value in values.items():
            assert _equal_as_tensorboard(by_step[step][tag], value), (tag, step)
    assert {k for row in rows for k in row if not k.startswith("_")} == set(tb)
    assert "valid/rtd/auc" in by_step[2] and "loss/mlm" in by_step[2]  # one row per step
    config = wandb_history.config(first_file)
    resolved = json.loads((save / "config.json").read_text())
    for section in ("model", "rtd", "train", "monitor"):
        assert config[section] == resolved[section], section
    assert config["ds_config"]["train_batch_size"] == 16

    # resume from iteration 4 to 6: the same W&B run, iterations 5 and 6 only, once each
    r = launch(common(wiki_shards, save, 6, flags + ["--load", str(save)]))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from" in r.stdout and "profiler:" not in r.stdout  # 2–3 were traced before
    runs = _wandb_rows(save)
    assert len(runs) == 2, runs.keys()
    later = next(f for f in runs if f != first_file)
    assert wandb_history.run_id(later) == run_id
    assert json.loads((save / "wandb_run.json").read_text())["id"] == run_id
    assert [row["_step"] for row in runs[later]] == [5, 6]
    assert runs[first_file] == rows  # the first run's file is untouched
    tb = scalars(str(save / "tensorboard"))
    assert sorted(tb["loss/mlm"]) == [1, 2, 3, 4, 5, 6]
    for row in runs[later]:
        for tag in ("loss/mlm", "loss/rtd", "optim/lr", "throughput/tokens_per_s"):
            assert _equal_as_tensorboard(row[tag], tb[tag][row["_step"]]), (tag, row["_step"])
