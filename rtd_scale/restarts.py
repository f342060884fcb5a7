"""Restarting a failed run: why it stopped, whether a restart can help, and the record the
restarted run turns into a TensorBoard (and W&B) event.

Two supervisors share it: slurm/lib/pretrain_job.sh (a new ``srun`` in the same allocation, up
to RTD_MAX_RESTARTS, then a requeue; ``python -m rtd_scale.restarts after-failure …`` after each
failed step) and tools/supervise.py (the ``deepspeed`` launcher on one machine, :func:`supervise`).

Why a run stopped (:func:`classify`), from what the run left behind:

- a user-input error: pretrain.py exits 2 (``cli_errors.EXIT_USER_ERROR``) after its one
  ``error:`` line. A restart would fail the same way, so there is none. Read from each rank's own
  status (``<save>/logs/rank<R>.exit``, written by slurm/lib/rank_env.sh around the rank) where
  there is one, else from the launcher's status: srun reports the highest status of its tasks,
  or a signal's, so a rank killed on the way out would hide the first rank's 2;
- a stop: the ranks stopped on a request — a signal (the line "exit signal … received") or
  their launcher's exit — and saved (``training/signals.py``), recorded in their progress files
  (``<save>/progress/rank<R>.json``, ``stopped``). The user stopped the run: it is never
  restarted, whatever the launcher's status (DeepSpeed's launch.py exits 1 after it passed a
  signal on), and no failure is recorded;
- a hang: ``hangs/*/hang.json`` written during this attempt (``training/heartbeat.py``), which
  names the ranks that stopped beating and their stack file;
- a crash: anything else — a signal (a segfault, an out-of-memory kill, a lost node), an exit
  status (a Python exception, a collective error: 1). The failing rank is the first whose own
  status is not 0 (by the time its wrapper recorded it); the iteration is the one that rank's
  progress file (``<save>/progress/rank<R>.json``) was in.

What follows (:func:`decide`): a user error or a stop stops; the same iteration failing
``max_same`` times in a row (RTD_MAX_FAILURES_AT_STEP, default 3) stops with one line naming the
iteration, the rank and its log; otherwise a restart, while ``restarts_done`` < ``max_restarts``, else a
requeue (the job's own choice; tools/supervise.py stops).

Every failure is one line in the supervisor's log and one JSON line in ``<save>/restarts.jsonl``
(number, time, cause, rank, iteration, the checkpoint the restart resumes from and when it was
saved). The restarted run is told its number (``RTD_RESTART``) and writes that record at its
first step as the scalars ``restarts/count``, ``restarts/failed_iteration``, ``restarts/rank``
(-1: not known) and ``restarts/time_lost_s`` (from the resumed checkpoint's save to this run's
start: the redone training plus the detection, back-off and start-up), and the text
``restarts/cause`` (:func:`event`).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from rtd_scale.cli_errors import EXIT_USER_ERROR, OneLineArgumentParser, run_cli

__all__ = ["Decision", "Failure", "backoff", "classify", "decide", "event", "supervise"]

RECORDS = "restarts.jsonl"
LOGS = "logs"
ENV_RESTART = "RTD_RESTART"  # the number of the restart a run is (its line in RECORDS)
DEFAULT_MAX_RESTARTS = 3
DEFAULT_MAX_SAME = 3
DEFAULT_BACKOFF_S = 10.0


@dataclass
class Failure:
    """Why an attempt stopped. ``cause``: "user-error", "stopped" (the ranks stopped on a
    signal and saved there: a stop the user asked for, never restarted), "hang" or "crash"."""

    cause: str
    status: int  # the launcher's exit status
    what: str  # e.g. "rank 1 died of SIGSEGV", "ranks 1 stopped beating"
    rank: Optional[int] = None
    iteration: Optional[int] = None  # the iteration that failed (1-based); None: before the first
    log: Optional[str] = None  # the failing rank's log
    stacks: Optional[str] = None  # a hang's stack file
    stop_code: Optional[int] = None  # "stopped": the ranks' signal (signals.LAUNCHER_EXITED)


@dataclass
class Decision:
    action: str  # "restart", "requeue" or "stop"
    line: str
    number: int = 0  # the restart's number (its record), for "restart" and "requeue"


def describe_status(status: int) -> str:
    """A process status as words: "exit status 1", "SIGSEGV" (128 + N from bash or srun;
    256 − N from the deepspeed launcher, which exits with a child's negative returncode)."""
    sig = None
    if 128 < status <= 128 + 64:
        sig = status - 128
    elif 256 - 64 <= status < 256:
        sig = 256 - status
    elif status < 0:
        sig = -status
    if sig:
        try:
            return signal.Signals(sig).name
        except ValueError:
            return f"signal {sig}"
    return f"exit status {status}"


def rank_exits(save: str) -> dict[int, tuple[int, float]]:
    """{rank: (status, time)} from ``<save>/logs/rank<R>.exit`` ("STATUS EPOCH" lines)."""
    out = {}
    folder = os.path.join(save, LOGS)
    try:
        names = os.listdir(folder)
    except OSError:
        return {}
    for name in names:
        if not (name.startswith("rank") and name.endswith(".exit") and name[4:-5].isdigit()):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                status, when = f.read().split()[:2]
            out[int(name[4:-5])] = (int(status), float(when))
        except (OSError, ValueError):
            continue
    return out


def clear_exits(save: str) -> None:
    """Remove the ranks' exit records before an attempt (slurm/lib/pretrain_job.sh)."""
    for rank in rank_exits(save):
        try:
            os.unlink(os.path.join(save, LOGS, f"rank{rank}.exit"))
        except OSError:
            pass


def _progress(save: str, rank: Optional[int], since: float) -> Optional[int]:
    """The iteration ``rank`` (any rank: the furthest) was in, from progress files written
    during this attempt."""
    from rtd_scale.training.heartbeat import PROGRESS_DIR, read_progress

    ranks = [rank] if rank is not None else sorted(
        int(n[4:-5]) for n in _listdir(os.path.join(save, PROGRESS_DIR))
        if n.startswith("rank") and n.endswith(".json") and n[4:-5].isdigit())
    found = []
    for r in ranks:
        p = read_progress(save, r)
        if p and p.get("time", 0) >= since - 1:
            found.append(int(p["iteration"]))
    return max(found) if found else None


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _log_of(save: str, rank: Optional[int]) -> Optional[str]:
    if rank is None:
        return None
    path = os.path.join(save, LOGS, f"rank{rank}.log")
    return path if os.path.exists(path) else None


def stop_requests(save: str, started: float) -> list[dict]:
    """The progress records (``training/heartbeat.py``) of the ranks that stopped on a request
    (a signal, or their launcher's exit: ``signals.StopRequest``, the line "exit signal …
    received") during the attempt that started at ``started``, by rank."""
    from rtd_scale.training.heartbeat import PROGRESS_DIR, read_progress

    found = []
    for name in sorted(_listdir(os.path.join(save, PROGRESS_DIR))):
        if name.startswith("rank") and name.endswith(".json") and name[4:-5].isdigit():
            p = read_progress(save, int(name[4:-5]))
            if p and p.get("stopped") and p.get("time", 0) >= started - 1:
                found.append(p)
    return sorted(found, key=lambda p: p.get("rank", 0))


def classify(save: str, status: int, started: float) -> Failure:
    """Why the attempt that started at ``started`` (epoch seconds) and ended with the
    launcher's ``status`` stopped (module docstring)."""
    from rtd_scale.training.heartbeat import hang_records

    exits = {r: v for r, v in rank_exits(save).items() if v[1] >= started - 1}
    if status == EXIT_USER_ERROR or any(s == EXIT_USER_ERROR for s, _ in exits.values()):
        rank = min((r for r, (s, _) in exits.items() if s == EXIT_USER_ERROR), default=None)
        return Failure("user-error", status, "the run stopped on a user-input error (exit "
                       f"status {EXIT_USER_ERROR}: its error line is above)", rank=rank,
                       log=_log_of(save, rank))
    stops = stop_requests(save, started)
    if stops:
        first = stops[0]
        return Failure("stopped", status, first["stopped"], rank=first.get("rank"),
                       iteration=int(first.get("iteration", 1)) - 1,
                       stop_code=first.get("stop_code"))
    hangs = hang_records(save, since=started - 1)
    if hangs:
        h = hangs[-1]
        ranks = h.get("ranks") or []
        who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        rank = ranks[0] if ranks else None
        return Failure("hang", status, f"{who} stopped beating", rank=rank,
                       iteration=h.get("iteration"), log=_log_of(save, rank),
                       stacks=h.get("stacks"))
    failed = sorted((when, r, s) for r, (s, when) in exits.items() if s != 0)
    if failed:
        _, rank, rank_status = failed[0]
        what = describe_status(rank_status)
        what = f"rank {rank} died of {what}" if what.startswith("SIG") or \
            what.startswith("signal") else f"rank {rank} exited with {what}"
    else:
        rank = None
        what = describe_status(status)
        what = f"a rank died of {what}" if not what.startswith("exit") else \
            f"the launcher exited with {what}"
    return Failure("crash", status, what, rank=rank, iteration=_progress(save, rank, started),
                   log=_log_of(save, rank))


def read_records(save: str) -> list[dict]:
    try:
        with open(os.path.join(save, RECORDS)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _checkpoint(save: str) -> tuple[Optional[str], Optional[float]]:
    """(the newest complete checkpoint's tag, when it was saved), or (None, None)."""
    from rtd_scale.training.checkpoint.choose import newest_complete
    from rtd_scale.training.checkpoint.files import RECORD_FILE

    tag = newest_complete(save) if os.path.isdir(save) else None
    if tag is None:
        return None, None
    try:
        return tag, os.path.getmtime(os.path.join(save, tag, RECORD_FILE))
    except OSError:
        return tag, None


def _where(failure: Failure) -> str:
    at = (f"at iteration {failure.iteration}" if failure.iteration is not None
          else "before its first iteration")
    log = f"; its log: {failure.log}" if failure.log else ""
    stacks = f"; every rank's stack: {failure.stacks}" if failure.stacks else ""
    return f"{failure.what} {at}{log}{stacks}"


# How a stop line names the two limits: the Slurm job's variables, tools/supervise.py's flags.
SLURM_LIMITS = ("RTD_MAX_RESTARTS={}", "RTD_MAX_FAILURES_AT_STEP={}")
SUPERVISE_LIMITS = ("--max-restarts {}", "--max-failures-at-step {}")


def decide(save: str, failure: Failure, *, restarts_done: int, max_restarts: int,
           max_same: int, backoff_s: float, requeue_left: bool = False,
           now: Optional[float] = None, limits: tuple[str, str] = SLURM_LIMITS) -> Decision:
    """What to do after ``failure``; appends the failure's record to ``<save>/restarts.jsonl``
    (module docstring). ``limits``: how the line names ``max_restarts`` and ``max_same``, as
    the user set them (``SLURM_LIMITS`` or ``SUPERVISE_LIMITS``)."""
    now = time.time() if now is None else now
    records = read_records(save)
    number = len(records) + 1
    tag, saved_at = _checkpoint(save)
    same = 1
    for r in reversed(records):
        if r.get("cause") == "user-error" or r.get("iteration") != failure.iteration:
            break
        same += 1
    resume = f"resuming from {tag}" if tag else "starting again from scratch (no complete " \
        "checkpoint yet)"
    redone = f"; {(now - saved_at) / 60:.1f} min of training since it is redone" \
        if saved_at else ""
    if failure.cause == "stopped":  # the user's stop: no restart, and no failure to record
        where = f"{save}/{tag}" if tag else f"none in {save}"
        return Decision("stop", f"not restarting: the ranks stopped on request ({failure.what}) "
                                f"after iteration {failure.iteration}; the newest complete "
                                f"checkpoint is {where}", 0)
    if failure.cause == "user-error":
        action = "stop"
        line = (f"error: not restarting: {failure.what}; fix it and resubmit "
                f"(its checkpoints are as they were)")
    elif max_same and same >= max_same:
        action = "stop"
        at = (f"iteration {failure.iteration}" if failure.iteration is not None
              else "the start (before iteration 1)")
        log = f" (its log: {failure.log})" if failure.log else ""
        line = (f"error: {at} failed {same} times in a row, the last time: {failure.what}"
                f"{log}; not restarting ({limits[1].format(max_same)}); the newest "
                f"complete checkpoint is {tag or 'none'}")
    elif restarts_done < max_restarts:
        action = "restart"
        line = (f"restart {number} ({restarts_done + 1} of {max_restarts} here): "
                f"{failure.cause}: {_where(failure)}; {resume} in {backoff_s:.0f} s{redone}")
    else:
        action = "requeue" if requeue_left else "stop"
        then = "requeueing the job" if requeue_left else "stopping"
        line = (f"error: {failure.cause}: {_where(failure)}; {max_restarts} restarts used "
                f"({limits[0].format(max_restarts)}): {then}; the newest complete checkpoint is "
                f"{tag or 'none'}")
    record = {"restart": number, "time": round(now, 3), "action": action, **{
        k: v for k, v in asdict(failure).items()}, "resume_from": tag,
        "checkpoint_time": saved_at, "line": line,
        "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT") or 0)}
    if os.path.isdir(save):
        with open(os.path.join(save, RECORDS), "a") as f:
            f.write(json.dumps(record) + "\n")
    return Decision(action, line, number)


def backoff(restarts_done: int, base_s: float) -> float:
    """Seconds to wait before restart ``restarts_done + 1`` of an allocation: ``base_s``
    doubled each time, at most 5 minutes."""
    return min(300.0, base_s * 2 ** restarts_done)


def event(save: Optional[str], environ=None, now: Optional[float] = None
          ) -> Optional[tuple[dict[str, float], str]]:
    """(scalars, cause text) of the restart this run is (``RTD_RESTART``), or None."""
    environ = os.environ if environ is None else environ
    number = environ.get(ENV_RESTART)
    if not (save and number and number.isdigit()):
        return None
    record = next((r for r in read_records(save) if r.get("restart") == int(number)), None)
    if record is None:
        return None
    now = time.time() if now is None else now
    since = record.get("checkpoint_time") or record.get("time") or now
    scalars = {"restarts/count": float(record["restart"]),
               "restarts/failed_iteration": float(record.get("iteration") or 0),
               "restarts/rank": float(-1 if record.get("rank") is None else record["rank"]),
               "restarts/time_lost_s": max(0.0, now - since)}
    return scalars, record.get("line", "")


def requeued(save: str, environ=None) -> Optional[int]:
    """The number of the restart a requeued Slurm job is: the last record, when it requeued
    the job this one continues (its SLURM_RESTART_COUNT one below this job's)."""
    environ = os.environ if environ is None else environ
    records = read_records(save)
    if not records or records[-1].get("action") != "requeue":
        return None
    now = int(environ.get("SLURM_RESTART_COUNT") or 0)
    return records[-1]["restart"] if records[-1].get("slurm_restart", -1) + 1 == now else None


# ----------------------------------------------------------- tools/supervise.py, one node ----

def _script_args(cmd: Sequence[str]) -> int:
    """Where pretrain.py's own arguments start in ``cmd`` (after ``…/pretrain.py`` or
    ``-m rtd_scale.pretrain``; for another program, after its first word)."""
    for i, word in enumerate(cmd):
        if os.path.basename(word) == "pretrain.py" or (
                word == "rtd_scale.pretrain" and i and cmd[i - 1] == "-m"):
            return i + 1
    return 1


def command_flags(cmd: Sequence[str]) -> argparse.Namespace:
    """pretrain.py's flags in ``cmd`` as pretrain.py reads them (its own parser:
    ``arguments.build_parser``; ``--save D`` and ``--save=D``, the last one given wins); the
    launcher's flags and anything else are left aside. A flag pretrain.py would refuse exits
    with pretrain.py's one-line error (status 2)."""
    from rtd_scale.arguments import build_parser

    args = list(cmd[_script_args(cmd):])
    try:
        return build_parser(quiet=True).parse_known_args(args)[0]
    except SystemExit:
        return build_parser().parse_known_args(args)[0]  # prints the error line and exits 2


def command_with_load(cmd: Sequence[str], save: str, *, replace: bool) -> list[str]:
    """``cmd`` with exactly one ``--load SAVE`` when SAVE holds a complete checkpoint (a fresh
    start must not pass one: it would refuse an empty directory). A ``--load`` of the command's
    own (``--load X`` or ``--load=X``) is kept on the first start and replaced by SAVE when
    ``replace`` (a restart or a resume: the newest checkpoint is in SAVE). The ``--load`` is
    spelled as the command spells its ``--save`` (a relative ``--save runs/x`` gets
    ``--load runs/x``, resolved in the same working directory), SAVE where it has none."""
    cmd = list(cmd)
    flags = command_flags(cmd)
    has_load = flags.load is not None
    if _checkpoint(save)[0] is None or (has_load and not replace):
        return cmd
    start, out, skip = _script_args(cmd), cmd[:_script_args(cmd)], False
    for word in cmd[start:]:
        if skip:
            skip = False
        elif word == "--load":
            skip = True
        elif not word.startswith("--load="):
            out.append(word)
    return [*out, "--load", flags.save or save]


def _zombie_status(pid: int) -> Optional[int]:
    """The status of process ``pid`` once it has exited and its parent has not yet reaped it
    (``/proc/PID/stat``'s state Z and exit_code, field 52), as bash gives it (128 + N for
    signal N); None while it runs or once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] != "Z" or len(fields) < 50:
        return None
    code = int(fields[49])
    return 128 + (code & 0x7F) if code & 0x7F else code >> 8


def watch_ranks(save: str, stop: threading.Event, started: float, poll_s: float = 0.1) -> None:
    """For a launcher without slurm/lib/rank_env.sh around each rank (the deepspeed launcher,
    which reaps a rank up to a second after it exits): write ``<save>/logs/rank<R>.exit`` for
    each rank (from its progress file's pid) seen exited, until ``stop``."""
    from rtd_scale.training.heartbeat import PROGRESS_DIR, read_progress

    seen: set[int] = set()
    while not stop.wait(poll_s):
        for name in _listdir(os.path.join(save, PROGRESS_DIR)):
            if not (name.startswith("rank") and name.endswith(".json")) or \
                    not name[4:-5].isdigit() or int(name[4:-5]) in seen:
                continue
            rank = int(name[4:-5])
            p = read_progress(save, rank)
            if not p or p.get("time", 0) < started - 1:
                continue
            status = _zombie_status(int(p["pid"]))
            if status is not None:
                seen.add(rank)
                os.makedirs(os.path.join(save, LOGS), exist_ok=True)
                with open(os.path.join(save, LOGS, f"rank{rank}.exit"), "w") as f:
                    f.write(f"{status} {time.time()}\n")


# What stops a supervised run: the signals of ``kill``, systemd and process managers (SIGTERM),
# a terminal's Ctrl-C (SIGINT) and its hang-up (SIGHUP).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GROUP_GONE_S = 60.0  # after a run's launcher exits, how long its other processes may take
# (DeepSpeed's launch.py gives its ranks 30 s after a SIGTERM, then SIGKILLs them)


def _become_subreaper() -> None:
    """Adopt the run's processes whose parent exits (the runner dies at once of SIGTERM,
    leaving launch.py and the ranks), so that they are reaped here and their exit is seen
    (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``); nothing elsewhere."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _drain(pgid: int, timeout_s: float = GROUP_GONE_S) -> None:
    """Wait until no process of the run's process group ``pgid`` is left (reaping the ones
    adopted here); SIGKILL what is left after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        if time.monotonic() > deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
            deadline = time.monotonic() + 5.0
        time.sleep(0.1)


def stop_status(signum: int) -> int:
    """The exit status of a program stopped by signal ``signum``, as a shell reports one."""
    return 128 + signum


def supervise(cmd: list[str], *, save: str, max_restarts: int, max_same: int,
              backoff_s: float, print_fn=print, relaunch: Sequence[str] = ()) -> int:
    """Run ``cmd`` (a ``deepspeed … rtd_scale/pretrain.py … --save SAVE`` command) until it
    succeeds, restarting it after a crash or a hang (:func:`decide`); returns its last status
    (0, or the failure's).

    A stop is one rule: SIGTERM, SIGINT or SIGHUP here is passed on as SIGTERM to the run's own
    process group (the runner, launch.py, the ranks: each rank finishes its step and saves,
    ``training/signals.py``), and a run whose ranks stopped on a request is never restarted;
    once every process of the run is gone, one line names the newest complete checkpoint and
    the command that resumes it (``relaunch``, this supervisor's own words, then the command
    with ``--load SAVE``), and the status is 128 + the signal's number."""
    done = 0
    env = dict(os.environ)
    got: list[int] = []  # the stop signal received here, if any
    group: list[int] = []  # the running attempt's process group

    def on_signal(signum, frame) -> None:
        got.append(signum)
        for pgid in group:
            try:
                os.killpg(pgid, signal.SIGTERM)
            except OSError:
                pass

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    _become_subreaper()
    try:
        while not got:
            started = time.time()
            clear_exits(save)
            stop = threading.Event()
            watcher = threading.Thread(target=watch_ranks, args=(save, stop, started),
                                       daemon=True)
            watcher.start()
            try:
                # its own session and process group: a stop reaches all of it, and nothing else
                proc = subprocess.Popen(command_with_load(cmd, save, replace=done > 0),
                                        env=env, start_new_session=True)
                group.append(proc.pid)
                if got:  # a signal before the group was known
                    on_signal(got[0], None)
                status = proc.wait()
                _drain(proc.pid)
                group.clear()
            finally:
                stop.set()
                watcher.join()
            if status == 0 and not got:
                return 0
            status = status if status >= 0 else 128 - status  # as bash reports a signal
            failure = classify(save, status, started)
            if got or failure.cause == "stopped":
                break
            decision = decide(save, failure, restarts_done=done, max_restarts=max_restarts,
                              max_same=max_same, backoff_s=backoff(done, backoff_s),
                              limits=SUPERVISE_LIMITS)
            print_fn(f"[rtd-supervise {time.strftime('%F %T')}] {decision.line}")
            sys.stdout.flush()
            if decision.action != "restart":
                return status if status else 1
            until = time.monotonic() + backoff(done, backoff_s)
            while not got and time.monotonic() < until:
                time.sleep(min(0.1, max(0.0, until - time.monotonic())))
            done += 1
            env[ENV_RESTART] = str(decision.number)
        else:
            failure = None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return _stopped(save, cmd, got, failure, relaunch, print_fn)


def _stopped(save: str, cmd: list[str], got: list[int], failure: Optional[Failure],
             relaunch: Sequence[str], print_fn) -> int:
    """The one line of a stopped run, and its status (:func:`supervise`)."""
    import shlex

    from rtd_scale.training.signals import LAUNCHER_EXITED

    if got:
        signum = got[0]
    elif failure is not None and failure.stop_code and failure.stop_code != LAUNCHER_EXITED:
        signum = failure.stop_code
    else:  # the ranks' launcher was killed (its status: 128 + N)
        signum = failure.status - 128 if failure and 128 < failure.status <= 192 else \
            signal.SIGTERM
    name = signal.Signals(signum).name
    after = (f" after iteration {failure.iteration}" if failure is not None
             and failure.cause == "stopped" and failure.iteration is not None else "")
    tag = _checkpoint(save)[0]
    resume = shlex.join([*relaunch, *command_with_load(cmd, save, replace=True)])
    where = (f"the newest complete checkpoint is {os.path.join(save, tag)}; resume with: "
             if tag else f"no complete checkpoint in {save}; start again with: ")
    try:  # after a hang-up the terminal may be gone: the status still says it
        print_fn(f"[rtd-supervise {time.strftime('%F %T')}] stopped by {name}{after}: "
                 f"{where}{resume}")
        sys.stdout.flush()
    except OSError:
        pass
    return stop_status(signum)


# ------------------------------------------------- slurm/lib/pretrain_job.sh's questions ----

def _after_failure(argv: Optional[Sequence[str]]) -> None:
    p = OneLineArgumentParser(prog="python -m rtd_scale.restarts after-failure")
    p.add_argument("--save", required=True)
    p.add_argument("--status", type=int, required=True)
    p.add_argument("--started", type=float, required=True)
    p.add_argument("--restarts-done", type=int, required=True)
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS)
    p.add_argument("--max-same", type=int, default=DEFAULT_MAX_SAME)
    p.add_argument("--backoff", type=float, default=DEFAULT_BACKOFF_S)
    p.add_argument("--requeue-left", action="store_true")
    a = p.parse_args(argv)
    failure = classify(a.save, a.status, a.started)
    wait = backoff(a.restarts_done, a.backoff)
    d = decide(a.save, failure, restarts_done=a.restarts_done, max_restarts=a.max_restarts,
               max_same=a.max_same, backoff_s=wait, requeue_left=a.requeue_left)
    print(f"{d.action} {d.number} {wait:g}")
    print(d.line)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"after-failure": _after_failure,
                "requeued": lambda rest: print(requeued(rest[0]) or "")}
    if not argv or argv[0] not in commands:
        print("usage: python -m rtd_scale.restarts {after-failure,requeued} ...",
              file=sys.stderr)
        return EXIT_USER_ERROR
    return run_cli(commands[argv[0]], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
