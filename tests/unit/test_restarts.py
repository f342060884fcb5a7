"""What a supervisor does after a failed attempt (rtd_scale/restarts.py), from the files a run
leaves: each rank's exit record and progress, a hang record, the history of restarts. The
real launches: tests/e2e/test_unattended.py (deepspeed, tools/supervise.py),
tests/e2e/test_slurm.py and tests/e2e/test_multinode.py (slurm/lib/pretrain_job.sh)."""
from __future__ import annotations

import json
import time

import pytest

from rtd_scale import restarts
from rtd_scale.restarts import classify, decide, describe_status, event


def _attempt(save, exits=(), progress=(), hang=None):
    """Files of an attempt that started a second ago: exit records {rank: status} in the
    order given, progress {rank: iteration}, and a hang record."""
    now = time.time()
    (save / "logs").mkdir(parents=True, exist_ok=True)
    (save / "progress").mkdir(exist_ok=True)
    for i, (rank, status) in enumerate(exits):
        (save / "logs" / f"rank{rank}.exit").write_text(f"{status} {now + i * 0.1}\n")
        (save / "logs" / f"rank{rank}.log").write_text("...\n")
    for rank, iteration in progress:
        (save / "progress" / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "host": "h", "pid": 1, "iteration": iteration, "time": now}))
    if hang is not None:
        folder = save / "hangs" / "iteration7-x"
        folder.mkdir(parents=True)
        (folder / "hang.json").write_text(json.dumps({"time": now, **hang}))
    return now - 1


def test_statuses_in_words():
    assert describe_status(139) == "SIGSEGV"  # bash and srun: 128 + N
    assert describe_status(245) == "SIGSEGV"  # the deepspeed launcher: 256 − N
    assert describe_status(-9) == "SIGKILL"
    assert describe_status(1) == "exit status 1"


def test_the_first_rank_to_fail_is_named_with_its_iteration_and_log(tmp_path):
    # rank 1 segfaults; rank 0 then fails in its collective and srun kills it
    started = _attempt(tmp_path, exits=[(1, 139), (0, 1)], progress=[(0, 4), (1, 4)])
    f = classify(str(tmp_path), 143, started)
    assert (f.cause, f.rank, f.iteration, f.what) == ("crash", 1, 4, "rank 1 died of SIGSEGV")
    assert f.log == str(tmp_path / "logs" / "rank1.log")


def test_a_user_error_is_found_even_when_srun_reports_a_signal(tmp_path):
    """srun returns the highest status of its tasks, or a killed task's signal: the rank's
    own record of status 2 decides."""
    started = _attempt(tmp_path, exits=[(0, 2), (1, 137)])
    f = classify(str(tmp_path), 137, started)
    assert (f.cause, f.rank) == ("user-error", 0)
    d = decide(str(tmp_path), f, restarts_done=0, max_restarts=3, max_same=3, backoff_s=10)
    assert d.action == "stop"
    assert d.line.startswith("error: not restarting: the run stopped on a user-input error")
    # the deepspeed launcher has no rank records: its own status 2 says it
    assert classify(str(tmp_path / "none"), 2, time.time()).cause == "user-error"


def test_a_hang_record_of_this_attempt_names_the_stopped_rank(tmp_path):
    started = _attempt(tmp_path, exits=[(1, 75), (0, 137)], hang={
        "ranks": [0], "iteration": 7, "stacks": "/s/stacks.txt"})
    f = classify(str(tmp_path), 137, started)
    assert (f.cause, f.rank, f.iteration, f.stacks) == ("hang", 0, 7, "/s/stacks.txt")
    assert f.what == "rank 0 stopped beating"
    # a hang of an earlier attempt is not this one's
    assert classify(str(tmp_path), 137, time.time() + 30).cause == "crash"


def test_restarts_then_requeue_then_a_crash_loop_stops_in_one_line(tmp_path):
    save = str(tmp_path)
    started = _attempt(tmp_path, exits=[(1, 139)], progress=[(1, 5)])
    f = classify(save, 139, started)
    d1 = decide(save, f, restarts_done=0, max_restarts=2, max_same=3, backoff_s=10, now=100.0)
    assert d1.action == "restart" and d1.number == 1
    assert d1.line == (f"restart 1 (1 of 2 here): crash: rank 1 died of SIGSEGV at iteration 5; "
                       f"its log: {tmp_path}/logs/rank1.log; starting again from scratch (no "
                       "complete checkpoint yet) in 10 s")
    d2 = decide(save, f, restarts_done=1, max_restarts=2, max_same=3, backoff_s=20)
    assert d2.action == "restart" and d2.number == 2
    d3 = decide(save, f, restarts_done=2, max_restarts=2, max_same=3, backoff_s=40)
    assert d3.action == "stop" and d3.line.startswith(
        f"error: iteration 5 failed 3 times in a row, the last time: rank 1 died of SIGSEGV "
        f"(its log: {tmp_path}/logs/rank1.log); not restarting (RTD_MAX_FAILURES_AT_STEP=3)")
    records = restarts.read_records(save)
    assert [(r["restart"], r["action"], r["iteration"]) for r in records] == \
        [(1, "restart", 5), (2, "restart", 5), (3, "stop", 5)]
    # a failure elsewhere is no loop: restarts used up, the job requeues itself
    f.iteration = 9
    d4 = decide(save, f, restarts_done=2, max_restarts=2, max_same=3, backoff_s=40,
                requeue_left=True)
    assert d4.action == "requeue" and "2 restarts used (RTD_MAX_RESTARTS=2): requeueing" in d4.line
    # the requeued job (Slurm's restart count one higher) writes that failure's event
    assert restarts.requeued(save, {"SLURM_RESTART_COUNT": "1"}) == 4
    assert restarts.requeued(save, {"SLURM_RESTART_COUNT": "2"}) is None  # a later requeue


def test_the_restarted_run_gets_its_event(tmp_path):
    save = str(tmp_path)
    _attempt(tmp_path)
    f = restarts.Failure("hang", 137, "rank 0 stopped beating", rank=0, iteration=7)
    decide(save, f, restarts_done=0, max_restarts=3, max_same=3, backoff_s=1, now=1000.0)
    assert event(save, environ={}) is None  # a run that is no restart writes nothing
    scalars, text = event(save, environ={"RTD_RESTART": "1"}, now=1060.0)
    assert scalars == {"restarts/count": 1.0, "restarts/failed_iteration": 7.0,
                       "restarts/rank": 0.0, "restarts/time_lost_s": 60.0}
    assert text.startswith("restart 1 (1 of 3 here): hang: rank 0 stopped beating at iteration 7")
    assert event(save, environ={"RTD_RESTART": "2"}) is None


@pytest.mark.parametrize("done,want", [(0, 10.0), (1, 20.0), (2, 40.0), (9, 300.0)])
def test_backoff_doubles_to_five_minutes(done, want):
    assert restarts.backoff(done, 10.0) == want


def test_ranks_that_stopped_on_a_signal_are_a_stop_never_a_restart(tmp_path):
    """The ranks' clean stop (``exit signal SIGINT received``, recorded in their progress files
    by the heartbeat) ended the attempt: whatever the launcher's status (DeepSpeed's launch.py
    exits 1 after passing a signal on), nothing is restarted and nothing is recorded."""
    started = _attempt(tmp_path, exits=[(0, 0), (1, 0)])
    for rank in (0, 1):
        (tmp_path / "progress" / f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "host": "h", "pid": 1, "iteration": 8, "time": time.time(),
             "stopped": "exit signal SIGINT received", "stop_code": 2}))
    f = classify(str(tmp_path), 1, started)
    assert (f.cause, f.what, f.iteration, f.stop_code) == (
        "stopped", "exit signal SIGINT received", 7, 2)
    d = decide(str(tmp_path), f, restarts_done=0, max_restarts=3, max_same=3, backoff_s=10)
    assert (d.action, d.line) == ("stop", "not restarting: the ranks stopped on request (exit "
                                  "signal SIGINT received) after iteration 7; the newest "
                                  f"complete checkpoint is none in {tmp_path}")
    assert restarts.read_records(str(tmp_path)) == []
    # a stop of an earlier attempt is not this one's: a crash now is restarted
    assert classify(str(tmp_path), 1, time.time() + 30).cause == "crash"
