"""Signals stop a run through the real ``deepspeed`` launcher with a checkpoint, never silently.

``kill -TERM`` of the launcher (what ``kill`` and many schedulers send) kills the runner, which
passes nothing on (DeepSpeed 0.19.8, ``launcher/runner.py``); the ranks notice its exit. Ctrl-C
sends SIGINT to the whole process group. Either way every rank finishes the current step, the
run saves there, the logging rank prints one line naming the checkpoint and the ``--load`` that
resumes it, and no process of the run is left (training/signals.py).
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.env import REPO, free_port
from tests.helpers.launcher import _deepspeed_bin, common, launch

ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|", re.M)
STOPPED = re.compile(r"^(.*): stopped after iteration (\d+); saved (\S+); resume with --load (\S+)$",
                     re.M)
EXIT_WITHIN_S = 120  # the current step and the save (DeepSpeed's launch.py SIGKILLs after 30 s)


def _args(wiki_shards, save, iters: int, extra=()) -> list[str]:
    tok, prefix = wiki_shards  # no --save-interval: only the stop saves before the end
    return ["--ds_config", "ds_configs/zero3.json", "--preset", "tiny", "--data-path", prefix,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", str(iters),
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--lr", "1e-3", "--lr-warmup-iters", "4", "--log-interval", "1", "--eval-iters", "0",
            "--seed", "11", *extra]


class Run:
    """A 2-rank run in its own session (its own process group, as a terminal's job)."""

    def __init__(self, args):
        self.proc = subprocess.Popen(
            [_deepspeed_bin(), "--num_gpus", "2", "--master_port", str(free_port()),
             "rtd_scale/pretrain.py", *args], cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()  # ends at EOF: when every process holding the pipe has exited

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for_iteration(self, timeout=300) -> None:
        deadline = time.monotonic() + timeout
        while not ITERATION.search(self.out):
            assert self.proc.poll() is None, self.out[-3000:]
            assert time.monotonic() < deadline, "no iteration logged\n" + self.out[-3000:]
            time.sleep(0.2)

    def wait_for_exit(self, marker: str) -> float:
        """Seconds until the output closed and no process with ``marker`` in its command line
        is left (the ranks, launch.py, DataLoader workers)."""
        t0 = time.monotonic()
        self.reader.join(EXIT_WITHIN_S)
        while _processes_with(marker) and time.monotonic() - t0 < EXIT_WITHIN_S:
            time.sleep(0.2)
        left = _processes_with(marker)
        if left or self.reader.is_alive():
            for pid in left:  # leave nothing behind for the next test
                os.kill(pid, signal.SIGKILL)
            pytest.fail(f"still running {EXIT_WITHIN_S} s after the signal: {left}\n"
                        + self.out[-3000:])
        self.proc.wait(10)
        return time.monotonic() - t0


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def _assert_saved_at_stop(out: str, save, reason: str) -> int:
    stops = STOPPED.findall(out)
    assert len(stops) == 1, out[-3000:]  # one line, from the logging rank only
    why, step, ckpt, load = stops[0]
    step = int(step)
    assert why == reason, stops
    logged = [int(m) for m in ITERATION.findall(out)]
    assert logged == list(range(1, step + 1)), out[-3000:]  # it stopped where it logged last
    assert 1 <= step < 200 and ckpt == str(save / f"global_step{step}") and load == str(save)
    assert (save / f"global_step{step}" / "rtd_complete.json").is_file()
    assert (save / "latest").read_text().strip() == f"global_step{step}"
    assert sorted(p.name for p in save.glob("global_step*")) == [f"global_step{step}"]
    return step


def test_sigterm_to_the_launcher_saves_and_stops_every_rank(wiki_shards, tmp_path):
    save = tmp_path / "run"
    run = Run(_args(wiki_shards, save, 200))
    run.wait_for_iteration()
    run.proc.send_signal(signal.SIGTERM)  # kill -TERM <launcher pid>
    took = run.wait_for_exit(str(save))
    out = run.out
    print(f"[signals] SIGTERM → all processes gone in {took:.1f} s\n" + out[-2500:])
    assert run.proc.returncode == -signal.SIGTERM  # the runner itself dies of it (no handler)
    step = _assert_saved_at_stop(out, save, "the deepspeed launcher (pid "
                                 f"{run.proc.pid}) exited")
    assert out.count("exits successfully.") == 2, out[-3000:]  # launch.py: both ranks exit 0

    r = launch(_args(wiki_shards, save, step + 2, ["--load", str(save)]))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {save} at iteration {step} ({16 * step} samples consumed)" in r.stdout
    assert [int(m) for m in ITERATION.findall(r.stdout)] == [step + 1, step + 2], r.stdout[-3000:]
    assert (save / "latest").read_text().strip() == f"global_step{step + 2}"


def test_ctrl_c_saves_and_names_the_checkpoint_to_load(wiki_shards, tmp_path):
    save = tmp_path / "run"
    run = Run(_args(wiki_shards, save, 200))
    run.wait_for_iteration()
    os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole foreground group
    took = run.wait_for_exit(str(save))
    print(f"[signals] Ctrl-C → all processes gone in {took:.1f} s")
    out = run.out
    _assert_saved_at_stop(out, save, "exit signal SIGINT received")
    # the only traceback there can be is DeepSpeed's runner's own KeyboardInterrupt (runner.py
    # waits on launch.py without a SIGINT handler on one node); none comes from a rank. Whether
    # the runner prints it is a race with launch.py's exit (a loaded machine printed none)
    assert out.count("Traceback (most recent call last)") <= 1, out[-3000:]
    if "Traceback (most recent call last)" in out:
        tb = out[out.index("Traceback (most recent call last)"):]
        assert tb.splitlines()[1].strip().startswith(f'File "{_deepspeed_bin()}"'), tb[:1000]
        # no frame of the package (the checkout's own folder may be named rtd_scale, and its
        # .venv holds DeepSpeed's runner)
        frames = re.findall(r'File "([^"]*)"', tb.split("KeyboardInterrupt")[0])
        assert not [f for f in frames if re.search(r"/rtd_scale/(?!\.venv/)", f)], tb[:2000]
    assert "Main process received SIGINT" in out  # launch.py's, after the ranks exited


# ------------------------------------------------------ a stop of tools/supervise.py ----
# One run stopped three ways, each stop resumed by the command the previous one printed:
# (a) kill -TERM of the supervisor (kill, systemd, process managers); (b) Ctrl-C in a terminal,
# SIGINT to the foreground process group the supervisor is in; (c) the supervisor started with
# `&` from a script (bash starts it with SIGINT ignored) and SIGINT sent to the script's group.
# Every rank sleeps a quarter second before each step (RTD_FAULTS) so that the run is still
# training when the signal lands, however fast the machine.
SUPERVISED_ITERS = 40
SUPERVISE_LINE = re.compile(r"^\[rtd-supervise [\d-]+ [\d:]+\] (.*)$", re.M)


class Supervised:
    """tools/supervise.py running ``argv`` (or a bash script around it) in a session of its
    own, as a terminal's job."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for_iteration(self, step: int, timeout=300) -> None:
        deadline = time.monotonic() + timeout
        while not any(int(m) >= step for m in ITERATION.findall(self.out)):
            assert self.proc.poll() is None, self.out[-3000:]
            assert time.monotonic() < deadline, f"no iteration {step}\n" + self.out[-3000:]
            time.sleep(0.1)


def _supervised_stop(save, argv: list[str], how: str, resumed_at: int) -> dict:
    """Run ``argv`` (a tools/supervise.py command), stop it ``how`` ("a", "b", "c") two
    iterations after ``resumed_at``; what it left: its status, output, the processes of the
    run still there when it exited."""
    env = {**os.environ, "RTD_FAULTS": "sleep=0.25@1:*"}
    if how == "c":  # bash starts a background job with SIGINT ignored (no job control)
        script = shlex.join(argv) + ' & p=$!; trap "" INT; wait "$p"; echo "[status] $?"'
        run = Supervised(["bash", "-c", script], env)
    else:
        run = Supervised(argv, env)
    try:
        run.wait_for_iteration(resumed_at + 2)
        if how == "a":
            run.proc.send_signal(signal.SIGTERM)  # kill -TERM <supervise.py pid>
        else:  # Ctrl-C: the whole foreground group; (c): the script's group, supervise.py in it
            os.killpg(run.proc.pid, signal.SIGINT)
        run.proc.wait(EXIT_WITHIN_S)
        left = _processes_with(str(save))  # the moment the supervisor (or the script) exited
        run.reader.join(30)
    finally:  # leave nothing behind for the next test
        for pid in _processes_with(str(save)):
            os.kill(pid, signal.SIGKILL)
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
    out = run.out
    status = run.proc.returncode
    if how == "c":
        found = re.findall(r"^\[status\] (\d+)$", out, re.M)
        status = int(found[0]) if found else None
    return {"status": status, "out": out, "left": left}


@pytest.fixture(scope="module")
def supervised_stops(wiki_shards, tmp_path_factory):
    save = tmp_path_factory.mktemp("supervised") / "run"
    args = common(wiki_shards, save, SUPERVISED_ITERS, ["--eval-iters", "0"],
                  save_interval=None)
    del args[args.index("--save"):args.index("--save") + 2]
    argv = [sys.executable, str(REPO / "tools" / "supervise.py"), "--backoff", "0", "--",
            _deepspeed_bin(), "--num_gpus", "2", "--master_port", str(free_port()),
            "rtd_scale/pretrain.py", *args, f"--save={save}"]  # argparse's other spelling
    stops, resumed_at = {}, 0
    t0 = time.monotonic()
    for how in "abc":
        stops[how] = stop = _supervised_stop(save, argv, how, resumed_at)
        lines = SUPERVISE_LINE.findall(stop["out"])
        resume = lines[-1].split("; resume with: ", 1)[-1] if lines else ""
        stop["lines"], stop["resume"], stop["resumed_at"] = lines, shlex.split(resume), resumed_at
        logged = [int(m) for m in ITERATION.findall(stop["out"])]
        if not (lines and logged and stop["resume"]):
            break
        resumed_at = logged[-1]
        argv = list(stop["resume"])  # the printed command, on a fresh port
        argv[argv.index("--master_port") + 1] = str(free_port())
    print(f"\n[signals] three supervised stops: {time.monotonic() - t0:.1f} s")
    return save, stops


@pytest.mark.parametrize("how,signum", [("a", signal.SIGTERM), ("b", signal.SIGINT),
                                        ("c", signal.SIGINT)])
def test_a_stop_of_the_supervisor_saves_and_is_not_restarted(supervised_stops, how, signum):
    save, stops = supervised_stops
    assert how in stops, "an earlier stop printed no resume command"
    stop = stops[how]
    out = stop["out"]
    assert stop["left"] == [], out[-3000:]  # nothing of the run outlived its supervisor
    assert stop["status"] == 128 + signum, out[-3000:]
    logged = [int(m) for m in ITERATION.findall(out)]
    step, first = logged[-1], stop["resumed_at"] + 1
    assert logged == list(range(first, step + 1)), out[-3000:]  # one run, no restart
    assert step >= first + 1 and step < SUPERVISED_ITERS
    if first > 1:
        assert f"resumed from {save} at iteration {first - 1}" in out
    # the ranks stopped at the end of that step and saved it, complete
    assert re.search(rf"^.*: stopped after iteration {step}; saved {save}/global_step{step}; "
                     rf"resume with --load {save}$", out, re.M), out[-3000:]
    assert (save / f"global_step{step}" / "rtd_complete.json").is_file()
    if how == "c":  # the last stop: its checkpoint is the one a --load takes
        assert (save / "latest").read_text().strip() == f"global_step{step}"
    assert not (save / "restarts.jsonl").exists()
    # one line: the signal, the checkpoint, the command that resumes it (exactly one --load)
    assert len(stop["lines"]) == 1, stop["lines"]
    assert stop["lines"][0].startswith(
        f"stopped by {signal.Signals(signum).name} after iteration {step}: the newest complete "
        f"checkpoint is {save}/global_step{step}; resume with: "), stop["lines"]
    resume = stop["resume"]
    assert resume[:2] == [sys.executable, str(REPO / "tools" / "supervise.py")]
    assert resume.count("--load") == 1 and resume[resume.index("--load") + 1] == str(save)
    assert not any(w.startswith("--load=") for w in resume) and f"--save={save}" in resume
    assert "Traceback" not in out, out[-3000:]
