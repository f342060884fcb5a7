"""tools/supervise.py's decisions on a stand-in for the launcher (a small Python script that
exits as it is told, writing the progress file a rank writes): a user error is not restarted
and says so in one line; a crash loop stops after --max-failures-at-step failures of the same
iteration, naming it; a crash elsewhere is restarted with the restart's number in RTD_RESTART.
The real launcher with real faults: tests/e2e/test_unattended.py."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.helpers.env import REPO

# each start, as the deepspeed launcher does: a child "rank 1" writes its progress (iteration 5)
# and exits with the plan's next status; the launcher reaps it after 2 s and exits with it
# (DeepSpeed's launch.py polls once a second; with 1 s here, a supervisor still starting on a
# loaded 2-core machine missed the exited rank's zombie, its 0.1 s watch not yet running, and
# named the launcher instead: restarts.watch_ranks)
STAND_IN = r"""
import json, os, subprocess, sys, time
save = next(a.split("=", 1)[1] if "=" in a else sys.argv[i + 1]
            for i, a in enumerate(sys.argv) if a.split("=", 1)[0] == "--save")
plan = sys.argv[1].split(",")
os.makedirs(os.path.join(save, "progress"), exist_ok=True)
starts = os.path.join(save, "starts")
n = len(open(starts).read().splitlines()) if os.path.exists(starts) else 0
with open(starts, "a") as f:
    f.write(os.environ.get("RTD_RESTART", "-") + "\n")
with open(os.path.join(save, "commands"), "a") as f:
    f.write(json.dumps(sys.argv[2:]) + "\n")
if os.environ.get("STAND_IN_CHECKPOINT") and n == 0:  # a complete checkpoint, as a save leaves
    sys.path.insert(0, os.environ["STAND_IN_REPO"])
    from rtd_scale.training.checkpoint import files
    ckpt = os.path.join(save, "global_step3")
    os.makedirs(ckpt)
    with open(os.path.join(ckpt, files.META_FILE), "w") as f:
        json.dump({"step": 3, "consumed_samples": 48, "layout": {"world_size": 2},
                   "config": {}, "record_format": files.RECORD_FORMAT}, f)
    files.write_record(ckpt, 3)
    files.write_latest(save, "global_step3")
rank = ("import json, os, sys, time\n"
        f"json.dump(dict(rank=1, host='h', pid=os.getpid(), iteration=5, time=time.time()), "
        f"open({os.path.join(save, 'progress', 'rank1.json')!r}, 'w'))\n"
        f"sys.exit({int(plan[n])})\n")
child = subprocess.Popen([sys.executable, "-c", rank])
time.sleep(2.0)
status = child.wait()
if status == 2:
    print("error: --mask-prob 2: must be in (0, 1)", file=sys.stderr)
sys.exit(status)
"""


def _supervise(tmp_path, plan: str, *flags: str, command=None, env=None
               ) -> subprocess.CompletedProcess:
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    return subprocess.run([sys.executable, str(REPO / "tools" / "supervise.py"), "--backoff",
                           "0", *flags, "--", sys.executable, str(tmp_path / "stand_in.py"),
                           plan, *(command or ["--save", str(tmp_path / "run")])],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, **(env or {})})


def _lines(r) -> list[str]:
    return [line.split("] ", 1)[1] for line in r.stdout.splitlines()
            if line.startswith("[rtd-supervise ")]


def test_a_user_error_is_not_restarted(tmp_path):
    r = _supervise(tmp_path, "2,0")
    assert r.returncode == 2
    assert r.stderr == "error: --mask-prob 2: must be in (0, 1)\n"
    assert _lines(r) == ["error: not restarting: the run stopped on a user-input error (exit "
                         "status 2: its error line is above); fix it and resubmit (its "
                         "checkpoints are as they were)"]
    assert (tmp_path / "run" / "starts").read_text() == "-\n"  # one start, no restart


def test_a_crash_is_restarted_and_the_restart_knows_its_number(tmp_path):
    r = _supervise(tmp_path, "1,0")
    assert r.returncode == 0, r.stdout + r.stderr
    # the rank that failed, seen exited before the launcher reaped it (restarts.watch_ranks)
    assert _lines(r) == ["restart 1 (1 of 3 here): crash: rank 1 exited with exit status 1 at "
                         "iteration 5; starting again from scratch (no complete checkpoint yet) "
                         "in 0 s"]
    assert (tmp_path / "run" / "starts").read_text() == "-\n1\n"
    record = json.loads((tmp_path / "run" / "restarts.jsonl").read_text())
    assert (record["restart"], record["cause"], record["iteration"]) == (1, "crash", 5)


def test_a_crash_loop_stops_after_k_failures_of_the_same_iteration(tmp_path):
    r = _supervise(tmp_path, "1,1,1,0", "--max-failures-at-step", "2")
    assert r.returncode == 1
    lines = _lines(r)
    assert len(lines) == 2 and lines[0].startswith("restart 1 (1 of 3 here): crash:")
    assert lines[1] == ("error: iteration 5 failed 2 times in a row, the last time: rank 1 "
                        "exited with exit status 1; not restarting "
                        "(--max-failures-at-step 2); the newest complete checkpoint is none")
    assert (tmp_path / "run" / "starts").read_text() == "-\n1\n"


def test_restarts_used_up_are_named_by_the_flag_that_set_them(tmp_path):
    r = _supervise(tmp_path, "1,1,0", "--max-restarts", "1")
    assert r.returncode == 1
    lines = _lines(r)
    assert len(lines) == 2 and lines[0].startswith("restart 1 (1 of 1 here): crash:")
    assert lines[1] == ("error: crash: rank 1 exited with exit status 1 at iteration 5; "
                        "1 restarts used (--max-restarts 1): stopping; the newest complete "
                        "checkpoint is none")


def test_save_and_load_are_read_as_pretrain_reads_them(tmp_path):
    """``--save=D`` is pretrain.py's (argparse's) other spelling of ``--save D``; a command
    holding ``--load=X`` keeps it on its first start, and its restart resumes from the newest
    checkpoint in D with exactly one --load (argparse would take the last of two)."""
    run, other = tmp_path / "run", tmp_path / "elsewhere"
    r = _supervise(tmp_path, "1,0", command=[f"--save={run}", "--lr", "1e-3", f"--load={other}"],
                   env={"STAND_IN_CHECKPOINT": "1", "STAND_IN_REPO": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = _lines(r)
    assert len(lines) == 1 and lines[0].startswith(
        "restart 1 (1 of 3 here): crash: rank 1 exited with exit status 1 at iteration 5; "
        "resuming from global_step3 in 0 s;"), lines
    commands = [json.loads(x) for x in (run / "commands").read_text().splitlines()]
    assert commands == [[f"--save={run}", "--lr", "1e-3", f"--load={other}"],
                        [f"--save={run}", "--lr", "1e-3", "--load", str(run)]]


def test_a_relative_save_is_resumed_by_the_same_relative_load(tmp_path):
    """The restart's ``--load`` is spelled as the command's ``--save`` (here relative to the
    supervisor's working directory, the run's too), not the supervisor's absolute path of it."""
    r = _supervise(tmp_path, "1,0", command=["--save", "run", "--lr", "1e-3"],
                   env={"STAND_IN_CHECKPOINT": "1", "STAND_IN_REPO": str(REPO)})
    assert r.returncode == 0, r.stdout + r.stderr
    commands = [json.loads(x) for x in (tmp_path / "run" / "commands").read_text().splitlines()]
    assert commands == [["--save", "run", "--lr", "1e-3"],
                        ["--save", "run", "--lr", "1e-3", "--load", "run"]]


def test_help_needs_no_command():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "supervise.py"), "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: tools/supervise.py [-h] "), r.stderr


def test_a_command_without_save_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "tools" / "supervise.py"), "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: the command has no --save DIR")


def _refusal(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "supervise.py"), *argv],
                          capture_output=True, text=True, timeout=60)


def test_bad_options_and_a_missing_command_are_one_line_each(tmp_path):
    save = str(tmp_path / "run")
    for argv, line in (
            (["--max-restarts", "-1", "--", "true", "--save", save],
             "error: --max-restarts -1: must be >= 0"),
            (["--backoff", "nan", "--", "true", "--save", save],
             "error: --backoff nan: must be >= 0"),
            (["--"], "error: no command after --: expected `tools/supervise.py [options] -- "
                     "deepspeed ... rtd_scale/pretrain.py ... --save DIR`"),
            (["--", str(tmp_path / "nowhere"), "--save", save],
             f"error: {tmp_path / 'nowhere'}: no such command (the first word after --); give "
             "the launcher's path, e.g. .venv/bin/deepspeed")):
        r = _refusal(*argv)
        assert (r.returncode, r.stderr) == (2, line + "\n"), (argv, r.stderr)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_run_that_fails_before_making_its_directory_is_counted(tmp_path):
    """The restart records go to --save, made by the supervisor: restarts are numbered 1, 2
    and the crash loop stops (a command that never creates it, as a run dying at start-up)."""
    r = subprocess.run([sys.executable, str(REPO / "tools" / "supervise.py"), "--backoff", "0",
                        "--max-failures-at-step", "2", "--", "false", "--save",
                        str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    lines = _lines(r)
    assert r.returncode == 1 and len(lines) == 2, r.stdout + r.stderr
    assert lines[0].startswith("restart 1 (1 of 3 here): crash: ")
    assert lines[1].startswith("error: the start (before iteration 1) failed 2 times in a row")


# rank 0 of two, whose main thread stops finishing steps: its heartbeat (setup budget 1 s)
# finds rank 1 silent, names it, ends it if it is stopped, and exits 75
HUNG_RANK0 = r"""
import sys, time
sys.path.insert(0, sys.argv[2])
from rtd_scale.config import FaultToleranceConfig
from rtd_scale.training.heartbeat import Heartbeat
Heartbeat(FaultToleranceConfig(setup_timeout_s=1, step_timeout_s=0, checkpointing_timeout_s=0),
          rank=0, world_size=2, save=sys.argv[1], answer_s=0.5).start(0)
time.sleep(120)
"""


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_hang_ends_with_the_reporters_status_before_the_stopped_rank_is_killed(tmp_path):
    """DeepSpeed's launch.py exits with the status of the first failed rank it collects: the
    heartbeat's reporter (75) must be that one, not the SIGSTOPped rank it kills (a launcher
    status of 247, 256 − SIGKILL). The stopped rank dies only once the reporter's exit has
    been collected by its parent, here this test as the launcher."""
    save = tmp_path / "run"
    (save / "progress").mkdir(parents=True)
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    os.kill(stopped.pid, signal.SIGSTOP)
    (save / "progress" / "rank1.json").write_text(json.dumps(
        {"rank": 1, "host": socket.gethostname(), "pid": stopped.pid, "iteration": 1,
         "time": time.time()}))
    reporter = subprocess.Popen([sys.executable, "-c", HUNG_RANK0, str(save), str(REPO)])
    try:
        deadline = time.monotonic() + 120
        while _state(reporter.pid) != "Z":  # exited, its status not collected yet
            assert time.monotonic() < deadline and stopped.poll() is None, stopped.returncode
            time.sleep(0.05)
        time.sleep(1.0)
        assert stopped.poll() is None, "the stopped rank was killed before the reporter's exit"
        assert reporter.wait() == 75
        assert stopped.wait(30) == -signal.SIGKILL  # then it is ended, without a grace period
    finally:
        for p in (reporter, stopped):
            if p.poll() is None:
                p.kill()
                p.wait()
    (record,) = save.glob("hangs/*/hang.json")
    assert json.loads(record.read_text())["ranks"] == [1]
