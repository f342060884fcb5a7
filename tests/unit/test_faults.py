"""The test-only fault hook (rtd_scale/training/faults.py): what an ``RTD_FAULTS`` entry means,
which rank and step it hits, ``!once`` markers, and the corrupted batch. The faults that end a
process (segv, kill, exit, stop) are exercised on real launches in tests/e2e/."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.data.packed import MicroBatch
from rtd_scale.training import faults
from rtd_scale.training.faults import Fault, FaultPlan, parse


def test_entries_read_with_their_step_rank_argument_and_once():
    got = parse("segv@3:1, sleep=0.5@2:*,corrupt@7!once,exit=17@4")
    assert got == [Fault("segv", 3, 1, None, False, "segv@3:1"),
                   Fault("sleep", 2, None, 0.5, False, "sleep=0.5@2:*"),
                   Fault("corrupt", 7, 0, None, True, "corrupt@7!once"),
                   Fault("exit", 4, 0, 17.0, False, "exit=17@4")]


@pytest.mark.parametrize("bad", ["segv", "segv@x", "boom@3", "exit@3", "sleep@2", "hold@2",
                                 "stop=1@2", "segv@3:a"])
def test_a_malformed_entry_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"RTD_FAULTS: cannot read '{bad}'"):
        parse(bad)


def test_a_plan_keeps_only_this_ranks_faults_and_sleep_lasts_from_its_step():
    plan = FaultPlan(parse("segv@3:1,sleep=0.1@2:*,stop@5:0"), rank=1)
    assert [f.text for f in plan.faults] == ["segv@3:1", "sleep=0.1@2:*"]
    sleep = plan.faults[1]
    assert [sleep.hits(s, 1) for s in (1, 2, 3, 9)] == [False, True, True, True]
    assert [plan.faults[0].hits(s, 1) for s in (2, 3, 4)] == [False, True, False]
    assert not FaultPlan.from_env(0, environ={}).enabled


def test_once_fires_a_single_time_per_save_directory(tmp_path):
    plan = FaultPlan(parse("corrupt@2:0!once"), rank=0, marker_dir=str(tmp_path))
    mb = MicroBatch(torch.tensor([[1, 7, 9, 2, 0]]), torch.tensor([11]))
    assert plan.before_step(1, [mb])[0] is mb
    hit = plan.before_step(2, [mb])[0]
    assert hit.input_ids.tolist() == [[1, 9, 7, 2, 0]]
    assert (tmp_path / "faults" / "fired-corrupt@2_0_once-rank0").read_text() == "2\n"
    # a restarted run (a new plan, the same --save) reaches iteration 2 again: no fault
    again = FaultPlan(parse("corrupt@2:0!once"), rank=0, marker_dir=str(tmp_path))
    assert again.before_step(2, [mb])[0] is mb
    # without !once it fires every time the step comes round
    always = FaultPlan(parse("corrupt@2:0"), rank=0, marker_dir=str(tmp_path))
    assert always.before_step(2, [mb])[0] is not mb


def test_corrupt_mirrors_the_ids_and_keeps_shape_specials_padding_and_sample_index():
    mb = MicroBatch(torch.tensor([[1, 5, 6, 300, 2, 0, 0], [1, 8, 2, 9, 44, 2, 0]]),
                    torch.tensor([3, 4]))
    bad = faults.corrupt(mb, special_ids=(0, 1, 2, 3, 4))
    # lo + hi − id over the real ids 5…300: frequent (low) pieces become rare (high) ones
    assert bad.input_ids.tolist() == [[1, 300, 299, 5, 2, 0, 0], [1, 297, 2, 296, 261, 2, 0]]
    assert bad.sample_index.tolist() == [3, 4]
    assert mb.input_ids[0, 1] == 5  # the loader's batch is left alone


def test_hold_waits_in_the_save_of_its_iteration_only(capsys):
    """``hold`` (a kill during a save: bench/faults.py's kill-during-save) waits in
    training/checkpoint/save.py, never before a step."""
    import time

    from rtd_scale.training.faults import hold_in_save

    env = {"RTD_FAULTS": "hold=0.3@2:*"}
    assert parse(env["RTD_FAULTS"])[0].arg == 0.3
    t0 = time.monotonic()
    hold_in_save(1, 0, env)
    hold_in_save(2, 1, {})  # no RTD_FAULTS: nothing
    assert time.monotonic() - t0 < 0.2 and capsys.readouterr().out == ""
    hold_in_save(2, 1, env)
    assert time.monotonic() - t0 >= 0.3
    assert capsys.readouterr().out == (
        "[rtd-fault] rank 1: injecting hold=0.3@2:* in the save of iteration 2\n")
    t0 = time.monotonic()
    FaultPlan(parse(env["RTD_FAULTS"]), rank=0).before_step(2, [])
    assert time.monotonic() - t0 < 0.2
