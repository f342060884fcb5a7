"""The heartbeat's rules (rtd_scale/training/heartbeat.py): the budget of each section, derived
from the measured steps with a floor, and what a stall writes — the stack file with a section
per rank, the ranks it names, the one line — run in this process with the watchdog's exit
replaced. The real faults (a SIGSTOPped rank under the deepspeed launcher and under Slurm) are
tests/e2e/test_unattended.py and tests/e2e/test_slurm.py."""
from __future__ import annotations

import json
import os
import socket
import threading
import time

import pytest

from rtd_scale.cli_errors import EXIT_HANG
from rtd_scale.config import FaultToleranceConfig
from rtd_scale.training import heartbeat as hb
from rtd_scale.training.heartbeat import Budgets, Heartbeat, name_hung


def test_budgets_derive_from_the_median_step_with_a_floor():
    b = Budgets(FaultToleranceConfig())
    assert b.of("setup") == 600 and b.of("step") == 180 and b.of("checkpointing") == 420
    b.step_times.extend([1.0, 50.0, 60.0, 70.0, 2.0])  # median 50 s: 5 × 50 = 250 > 180
    assert b.of("step") == 250
    b.longest_save = 100.0
    assert b.of("checkpointing") == 500
    fixed = Budgets(FaultToleranceConfig(setup_timeout_s=0, step_timeout_s=12.0,
                                         checkpointing_timeout_s=30.0))
    fixed.step_times.append(1000.0)
    assert (fixed.of("setup"), fixed.of("step"), fixed.of("checkpointing")) == (None, 12.0, 30.0)


def test_a_beat_resets_the_clock_and_sections_keep_their_own_budget():
    now = [100.0]
    h = Heartbeat(FaultToleranceConfig(setup_timeout_s=10, step_timeout_s=2,
                                       checkpointing_timeout_s=5),
                  rank=0, world_size=1, save=None, clock=lambda: now[0])
    assert h.overdue(109.0) is None and h.overdue(110.5) == ("setup", 10.5, 10)
    now[0] = 110.0
    h.beat(1)  # the first step: from now on the step budget
    assert h.iteration == 2 and h.overdue(111.9) is None
    assert h.overdue(112.5) == ("step", 2.5, 2)
    h.enter("checkpointing")
    assert h.overdue(114.0) is None and h.overdue(115.5)[0] == "checkpointing"


def _collective_stack(rank: int, main: str) -> str:
    return (f"rank {rank} (host h, pid 1): iteration 5, section step, 9.0 s since its last beat; "
            f"main thread {main}\nCurrent thread 0x01 (most recent call first):\n"
            "  File \"/x/rtd_scale/training/heartbeat.py\", line 1 in _dump_own\n\n"
            f"Thread {main} (most recent call first):\n"
            "  File \"/v/torch/distributed/distributed_c10d.py\", line 3252 in all_reduce\n"
            "  File \"/x/rtd_scale/training/loop.py\", line 398 in train\n")


def test_the_ranks_named_are_the_silent_ones_else_those_outside_a_collective():
    waiting = {0: _collective_stack(0, "0x00aa"), 2: _collective_stack(2, "0x00aa")}
    assert name_hung(3, waiting) == [1]  # rank 1 wrote nothing: stopped or dead
    looping = dict(waiting)
    looping[1] = _collective_stack(1, "0x00bb").replace("torch/distributed/distributed_c10d",
                                                        "rtd_scale/data/loader")
    assert name_hung(3, looping) == [1]  # answered, but not waiting for anyone
    everyone = {r: _collective_stack(r, "0x00aa") for r in range(3)}
    assert name_hung(3, everyone) == [0, 1, 2]


def test_a_stall_writes_every_ranks_section_names_the_silent_rank_and_exits_75(tmp_path):
    """Rank 0 of a world of 2 whose budget runs out: rank 1 never answers (its progress file
    says where it was); the watchdog writes the stack file, the record and the line, then
    exits with EXIT_HANG."""
    save = tmp_path / "run"
    (save / "progress").mkdir(parents=True)
    (save / "progress" / "rank1.json").write_text(json.dumps(
        {"rank": 1, "host": "elsewhere", "pid": 4242, "iteration": 3, "time": time.time()}))
    lines, exits = [], []
    done = threading.Event()

    def leave(status):
        exits.append(status)
        done.set()

    h = Heartbeat(FaultToleranceConfig(setup_timeout_s=0.3), rank=0, world_size=2,
                  save=str(save), print_fn=lines.append, exit_fn=leave, answer_s=0.5)
    h.start(2)  # resumed at iteration 2: iteration 3 in progress
    t0 = time.monotonic()
    assert done.wait(15), "the watchdog did not fire"
    took = time.monotonic() - t0
    h.close()
    assert exits == [EXIT_HANG]
    (record_path,) = (save / "hangs").glob("iteration3-*/hang.json")
    record = json.loads(record_path.read_text())
    assert record["ranks"] == [1] and record["answered"] == [0]
    assert record["iteration"] == 3 and record["section"] == "setup"
    stacks = (record_path.parent / "stacks.txt").read_text()
    assert stacks.index("=== rank 0 ===") < stacks.index("=== rank 1 ===")
    assert f"rank 0 (host {socket.gethostname()}, pid {os.getpid()}): iteration 3" in stacks
    assert "in _watch" in stacks and "test_heartbeat.py" in stacks  # every thread of rank 0
    assert ("rank 1: no stack: did not answer (stopped, dead, or holding the GIL in native "
            "code); last seen host elsewhere, pid 4242, iteration 3") in stacks
    assert lines == [f"error: hang: rank 1 stopped beating at iteration 3 (0 s without a "
                     f"finished step, the setup budget is 0 s; --ft-rank-section-timeouts); "
                     f"every rank's Python stack: {record_path.parent / 'stacks.txt'}"]
    assert 0.3 < took < 5, took  # the budget, a poll, and the wait for rank 1's answer
    assert hb.hang_records(str(save), since=time.time() - 60)[0]["ranks"] == [1]
    assert hb.hang_records(str(save), since=time.time() + 60) == []


def test_a_rank_asked_by_the_reporter_dumps_its_stack_and_leaves(tmp_path):
    """Rank 1, past half its budget, finds rank 0's request: it writes its stack into the
    request's directory and exits once the reporter's record is there."""
    save = tmp_path / "run"
    folder = save / "hangs" / "iteration4-x"
    folder.mkdir(parents=True)
    exits = []
    done = threading.Event()
    h = Heartbeat(FaultToleranceConfig(setup_timeout_s=1.0), rank=1, world_size=2,
                  save=str(save), print_fn=lambda line: None,
                  exit_fn=lambda s: (exits.append(s), done.set()), answer_s=0.5)
    h.start(3)
    (save / "hangs" / "request.json").write_text(json.dumps(
        {"time": time.time(), "rank": 0, "iteration": 4, "section": "step", "waited_s": 9.0,
         "budget_s": 8.0, "dir": "iteration4-x"}))
    deadline = time.monotonic() + 10
    while not (folder / "rank1.txt").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (folder / "rank1.txt").read_text().startswith("rank 1 (host ")
    assert not exits  # it waits for the reporter's record
    (folder / "hang.json").write_text("{}")
    assert done.wait(5) and exits == [EXIT_HANG]
    h.close()


def test_no_budget_no_thread_and_progress_is_one_fixed_size_record(tmp_path):
    h = Heartbeat(FaultToleranceConfig(setup_timeout_s=0, step_timeout_s=0,
                                       checkpointing_timeout_s=0), rank=3, world_size=4,
                  save=str(tmp_path))
    assert not h.enabled
    h.start(0)
    assert h._thread is None
    for done in range(1, 12):
        h.beat(done)
    # a stop on request is in the record, for a supervisor (rtd_scale/restarts.py), at any
    # length a host name can have (HOST_NAME_MAX 64) and the longest reason
    h.stopped(1024, f"the deepspeed.launcher.launch process (pid {2 ** 22}) exited")
    h.close()
    raw = (tmp_path / "progress" / "rank3.json").read_bytes()
    assert len(raw) == 512
    record = hb.read_progress(str(tmp_path), 3)
    assert (record["iteration"], record["stop_code"]) == (12, 1024)
    assert record["stopped"] == "the deepspeed.launcher.launch process (pid 4194304) exited"
    assert len(raw.rstrip(b" ")) - len(record["host"]) + 64 < 512
    assert hb.read_progress(str(tmp_path), 0) is None


@pytest.mark.parametrize("value,want", [
    ("setup:60,step:12,checkpointing:none", (60.0, 12.0, 0.0)),
    ("step:auto", (600.0, None, None)),
])
def test_the_flag_sets_each_section(value, want):
    from rtd_scale.arguments import build_parser, config_from_args

    args = build_parser().parse_args(["--ds_config", "x", "--data-path", "p",
                                      "--tokenizer-model", "t",
                                      "--ft-rank-section-timeouts", value])
    ft = config_from_args(args).fault_tolerance
    assert (ft.setup_timeout_s, ft.step_timeout_s, ft.checkpointing_timeout_s) == want


@pytest.mark.parametrize("value,says", [
    ("step=12", "cannot read 'step=12'; expected SECTION:SECONDS"),
    ("setup:auto", "setup has no measured time"),
    ("step:soon", "step:soon is not seconds, auto or none"),
    # a run's config.json holds no inf or NaN, so its --config could not start it again
    ("step:inf", r"step:inf is not seconds, auto or none \(none: no budget\)"),
    ("setup:nan", r"setup:nan is not seconds, auto or none \(none: no budget\)"),
])
def test_a_bad_flag_value_is_one_line(value, says):
    from rtd_scale.arguments import build_parser, config_from_args
    from rtd_scale.cli_errors import UserInputError

    args = build_parser().parse_args(["--ds_config", "x", "--data-path", "p",
                                      "--tokenizer-model", "t",
                                      "--ft-rank-section-timeouts", value])
    with pytest.raises(UserInputError, match=says):
        config_from_args(args)
