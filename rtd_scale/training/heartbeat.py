"""A heartbeat per rank: a run whose ranks stop finishing steps ends in minutes, saying which rank
stopped and where every rank was.

The loop beats once per finished step (:meth:`Heartbeat.beat`: a clock read and one ``pwrite``
of the rank's progress file, no collective). A watchdog thread in each rank compares the time
since the last beat with the budget of the section the rank is in, as NVIDIA's resiliency
extension does with its rank monitors (sections ``setup``, ``step``, ``checkpointing``; NeMo's
defaults 600 / 180 / 420 s): ``setup`` until the first finished step of this process (and
during a validation), ``step`` between steps, ``checkpointing`` during a save. A budget left
open (``None``) is derived as the run goes: ``safety_factor`` (5, the extension's) × the median
of the last 100 step times, or × the longest save so far, never below its floor
(``config.FaultToleranceConfig``; ``--ft-rank-section-timeouts``).

When a rank's budget runs out (``--save`` set):

1. it creates ``<save>/hangs/request.json`` (``O_EXCL``: one rank wins and reports) naming a
   directory ``hangs/iteration<N>-<time>/``;
2. every rank whose own last beat is older than half its budget looks for that request once
   per poll (so a run that progresses never touches the file system), and each one that sees
   it — or whose budget ran out too — writes its Python stack there, every thread,
   ``faulthandler.dump_traceback`` from its watchdog thread, while the main thread stays where
   it hung (in a collective, typically);
3. after a grace period the reporting rank writes ``stacks.txt``: each rank's stack in rank
   order, and for a rank that wrote none "no stack: did not answer" with the host, pid and
   iteration its progress file holds. A SIGSTOPped, dead or GIL-holding rank cannot dump
   itself, so its peers name it. The ranks named are those that did not answer; when all
   answered, those not waiting in a collective (their main thread has no ``torch.distributed``
   or ``deepspeed.comm`` frame); else all. A named rank on the reporter's host that is stopped
   (``/proc`` state T) is killed, so the launcher need not wait out its SIGTERM grace — once
   the reporter's own exit (75) has been collected by its parent (:func:`_kill_after`), so the
   deepspeed launcher, which exits with the first failed rank's status it sees, exits 75 and
   not 247 (a SIGKILLed rank's);
4. the reporter prints one line — ``error: hang: rank(s) … stopped beating at iteration N
   (… s without a finished step, the step budget …); every rank's Python stack: PATH`` — and
   writes ``hang.json`` there for the supervisor (``rtd_scale/restarts.py``);
5. every rank that answered exits with ``cli_errors.EXIT_HANG`` (75); the launcher ends the
   rest, and slurm/lib/pretrain_job.sh or tools/supervise.py restarts the run from its newest
   complete checkpoint.

Without ``--save`` a rank whose budget ran out prints its own stack to stderr and exits 75.

Progress files, ``<save>/progress/rank<R>.json`` (host, pid, the iteration in progress, time),
are written once a step with ``os.pwrite`` into the page cache (no fsync): what a supervisor
reads after a crash to name the iteration that failed.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from collections import deque
from typing import Callable, Optional

from rtd_scale.atomic import write_atomic
from rtd_scale.cli_errors import EXIT_HANG

SECTIONS = ("setup", "step", "checkpointing")
HANGS_DIR = "hangs"
PROGRESS_DIR = "progress"
REQUEST_FILE = "request.json"
STACKS_FILE = "stacks.txt"
RECORD_FILE = "hang.json"
_PROGRESS_BYTES = 512  # fixed size: each pwrite replaces the whole record
# frames of a thread waiting in a collective (faulthandler prints the file of each frame)
_COLLECTIVE_FRAMES = ("torch/distributed/", "deepspeed/comm/")


class Budgets:
    """Seconds each section may go without a beat: the configured value, or derived from what
    was measured (``safety_factor`` × median step, × longest save) with a floor."""

    def __init__(self, ft, window: int = 100):
        self.ft = ft
        self.step_times: deque[float] = deque(maxlen=window)
        self.longest_save = 0.0

    def of(self, section: str) -> Optional[float]:
        """The budget of ``section`` in seconds; None: off."""
        ft = self.ft
        if section == "setup":
            value = ft.setup_timeout_s
            return None if not value else value
        if section == "step":
            if ft.step_timeout_s is not None:
                return ft.step_timeout_s or None
            measured = statistics.median(self.step_times) if self.step_times else 0.0
            return max(ft.step_timeout_floor_s, ft.safety_factor * measured)
        if ft.checkpointing_timeout_s is not None:
            return ft.checkpointing_timeout_s or None
        return max(ft.checkpointing_timeout_floor_s, ft.safety_factor * self.longest_save)


def progress_path(save: str, rank: int) -> str:
    return os.path.join(save, PROGRESS_DIR, f"rank{rank}.json")


def read_progress(save: str, rank: int) -> Optional[dict]:
    """A rank's progress record (host, pid, iteration in progress, time), or None."""
    try:
        with open(progress_path(save, rank)) as f:
            return json.loads(f.read().strip("\0 \n") or "null")
    except (OSError, ValueError):
        return None


class Heartbeat:
    """One rank's heartbeat and watchdog thread (module docstring). ``start`` begins the setup
    section; the loop calls ``beat`` after each step and ``enter`` before a save or a
    validation; ``close`` stops the thread."""

    def __init__(self, ft, *, rank: int, world_size: int, save: Optional[str],
                 print_fn: Optional[Callable[[str], None]] = None, clock=time.monotonic,
                 exit_fn: Callable[[int], None] = os._exit, answer_s: Optional[float] = None):
        self.budgets = Budgets(ft)
        self.rank, self.world_size, self.save = rank, world_size, save
        self.print_fn = print_fn or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock, self.exit_fn = clock, exit_fn
        self.answer_s = answer_s  # how long the reporter waits for the others' stacks
        self.section = "setup"
        self.since = clock()  # the last beat, or the entry into the current section
        self.iteration = 0  # the iteration in progress (1-based)
        self.started_wall = time.time()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._fd: Optional[int] = None
        self._entered: Optional[float] = None
        self._stop_request: dict = {}

    @property
    def enabled(self) -> bool:
        return any(self.budgets.of(s) for s in SECTIONS)

    # ------------------------------------------------------------------ the main thread ----
    def start(self, done: int) -> "Heartbeat":
        """Begin watching: ``done`` iterations finished (the resumed step)."""
        self.iteration = done + 1
        if self.save:
            os.makedirs(os.path.join(self.save, PROGRESS_DIR), exist_ok=True)
            self._fd = os.open(progress_path(self.save, self.rank), os.O_WRONLY | os.O_CREAT,
                               0o644)
            self._write_progress()
        if self.enabled:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name="rtd-heartbeat")
            self._thread.start()
        return self

    def beat(self, done: int) -> None:
        """Iteration ``done`` finished (after its save, if any)."""
        now = self.clock()
        if self.section == "step":
            self.budgets.step_times.append(now - self.since)
        elif self.section == "checkpointing" and self._entered is not None:
            self.budgets.longest_save = max(self.budgets.longest_save, now - self._entered)
        self.section, self.since, self.iteration, self._entered = "step", now, done + 1, None
        if self._fd is not None:
            self._write_progress()

    def enter(self, section: str) -> None:
        """A save (``checkpointing``) or a validation (``setup``'s budget) starts now."""
        self.section, self.since = section, self.clock()
        self._entered = self.since

    def stopped(self, code: int, reason: str) -> None:
        """The run stops on a request (``signals.StopRequest``: ``code``, a signal number or
        ``LAUNCHER_EXITED``; ``reason``, its words): recorded in the progress file, so that a
        supervisor (rtd_scale/restarts.py) stops too instead of restarting a run the user
        stopped."""
        self._stop_request = {"stopped": reason, "stop_code": int(code)}
        if self._fd is not None:
            self._write_progress()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write_progress(self) -> None:
        record = json.dumps({"rank": self.rank, "host": socket.gethostname(),
                             "pid": os.getpid(), "iteration": self.iteration,
                             "time": round(time.time(), 3), **self._stop_request})
        os.pwrite(self._fd, record.ljust(_PROGRESS_BYTES).encode()[:_PROGRESS_BYTES], 0)

    # --------------------------------------------------------------- the watchdog thread ----
    def overdue(self, now: float) -> Optional[tuple[str, float, float]]:
        """(section, seconds without a beat, budget) when the budget ran out, else None."""
        budget = self.budgets.of(self.section)
        waited = now - self.since
        if budget and waited > budget:
            return self.section, waited, budget
        return None

    def _poll_s(self) -> float:
        budget = self.budgets.of(self.section) or 60.0
        return min(5.0, max(0.2, budget / 20))

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s()):
            now = self.clock()
            late = self.overdue(now)
            if late is not None:
                self._stalled(*late, asked=None)
                return
            budget = self.budgets.of(self.section)
            if self.save and budget and now - self.since > budget / 2:
                request = self._read_request()
                if request is not None:
                    self._stalled(self.section, now - self.since, budget, asked=request)
                    return

    def _hangs(self) -> str:
        return os.path.join(self.save, HANGS_DIR)

    def _read_request(self) -> Optional[dict]:
        try:
            with open(os.path.join(self._hangs(), REQUEST_FILE)) as f:
                request = json.load(f)
        except (OSError, ValueError):
            return None
        # a request left by an earlier attempt of the run is not this one's
        return request if request.get("time", 0) >= self.started_wall - 1 else None

    def _claim(self, section: str, waited: float, budget: float) -> tuple[dict, bool]:
        """(the request, whether this rank made it and so reports)."""
        os.makedirs(self._hangs(), exist_ok=True)
        path = os.path.join(self._hangs(), REQUEST_FILE)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        request = {"time": time.time(), "rank": self.rank, "iteration": self.iteration,
                   "section": section, "waited_s": round(waited, 1), "budget_s": budget,
                   "dir": f"iteration{self.iteration}-{stamp}"}
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                found = self._read_request()
                if found is not None:
                    return found, False
                try:  # an earlier attempt's request
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(request, f)
            return request, True
        return request, True

    def _stalled(self, section: str, waited: float, budget: float,
                 asked: Optional[dict]) -> None:
        if not self.save:
            self.print_fn(f"error: hang: rank {self.rank} finished no step for {waited:.0f} s "
                          f"in section {section} (budget {budget:.0f} s; "
                          "--ft-rank-section-timeouts); its Python stack follows (no --save: "
                          "the other ranks' stacks are in their own output)")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self._leave()
            return
        request, reporter = (asked, False) if asked is not None else \
            self._claim(section, waited, budget)
        folder = os.path.join(self._hangs(), request["dir"])
        os.makedirs(folder, exist_ok=True)
        self._dump_own(folder, section, waited)
        grace = self.answer_s if self.answer_s is not None else 2 * self._poll_s() + 3.0
        if reporter:
            deadline = self.clock() + grace
            while self.clock() < deadline and len(_parts(folder)) < self.world_size:
                time.sleep(0.1)
            self._report(request, folder)
        else:  # the reporter names the ranks; wait for its file so the launcher does not
            deadline = self.clock() + grace + 15.0  # kill it while it writes
            while self.clock() < deadline and not os.path.exists(
                    os.path.join(folder, RECORD_FILE)):
                time.sleep(0.2)
        self._leave()

    def _dump_own(self, folder: str, section: str, waited: float) -> None:
        path = os.path.join(folder, f"rank{self.rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"rank {self.rank} (host {socket.gethostname()}, pid {os.getpid()}): "
                    f"iteration {self.iteration}, section {section}, {waited:.1f} s since its "
                    f"last beat; main thread 0x{threading.main_thread().ident:016x}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        os.replace(path + ".tmp", path)

    def _report(self, request: dict, folder: str) -> None:
        parts = _parts(folder)
        texts = {r: open(os.path.join(folder, f"rank{r}.txt")).read() for r in parts}
        progress = {r: read_progress(self.save, r) for r in range(self.world_size)
                    if r not in parts}
        named = name_hung(self.world_size, texts)
        stacks = os.path.join(folder, STACKS_FILE)
        write_atomic(stacks, stacks_text(self.world_size, texts, progress, request))
        for r in named:  # a stopped rank on this host: end it (the launcher would wait)
            p = progress.get(r) or {}
            if p.get("host") == socket.gethostname() and _stopped(p.get("pid")):
                _kill_after(os.getpid(), p["pid"])
        line = hang_line(named, request, stacks)
        write_atomic(os.path.join(folder, RECORD_FILE), json.dumps(
            {**request, "ranks": named, "answered": parts, "stacks": stacks,
             "line": line}) + "\n")
        self.print_fn(line)

    def _leave(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self.exit_fn(EXIT_HANG)


def _kill_after(pid: int, victim: int) -> None:
    """SIGKILL process ``victim`` once process ``pid`` (this one) is gone and collected by its
    parent, from a small shell of its own: a launcher that takes the first failed child's
    status (DeepSpeed's launch.py polls its ranks once a second) sees ``pid``'s first. ``kill
    -0`` still finds an exited process its parent has not collected yet."""
    import subprocess

    try:
        subprocess.Popen(["sh", "-c", 'while kill -0 "$1" 2>/dev/null; do sleep 0.05; done; '
                                      'kill -9 "$2" 2>/dev/null', "sh", str(pid), str(victim)],
                         stdin=subprocess.DEVNULL, close_fds=True)
    except OSError:
        try:
            os.kill(victim, signal.SIGKILL)
        except OSError:
            pass


def _parts(folder: str) -> list[int]:
    """The ranks whose stack file is in ``folder``."""
    out = []
    for name in os.listdir(folder):
        if name.startswith("rank") and name.endswith(".txt") and name[4:-4].isdigit():
            out.append(int(name[4:-4]))
    return sorted(out)


def _stopped(pid) -> bool:
    """Whether process ``pid`` (on this host) is stopped (``/proc/PID/stat`` state T)."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, ValueError, IndexError, TypeError):
        return False


def _main_thread_frames(text: str) -> list[str]:
    """The frame lines of the main thread in a stack file (its header names the thread)."""
    head = text.split("\n", 1)[0]
    ident = head.rsplit("main thread ", 1)[-1].strip()
    blocks = text.split("\n\n")
    for block in blocks:
        first = block.strip().split("\n", 1)[0]
        if ident and first.startswith(("Thread ", "Current thread ")) and ident in first:
            return block.strip().split("\n")[1:]
    return []


def name_hung(world_size: int, texts: dict[int, str]) -> list[int]:
    """The ranks to name: those that wrote no stack; else those whose main thread waits in no
    collective; else every rank."""
    silent = [r for r in range(world_size) if r not in texts]
    if silent:
        return silent
    busy = [r for r, t in sorted(texts.items())
            if not any(m in line for line in _main_thread_frames(t) for m in _COLLECTIVE_FRAMES)]
    return busy or list(range(world_size))


def stacks_text(world_size: int, texts: dict[int, str], progress: dict[int, Optional[dict]],
                request: dict) -> str:
    """``stacks.txt``: one section per rank, in rank order."""
    out = [f"hang at iteration {request['iteration']}: rank {request['rank']} found no finished "
           f"step for {request['waited_s']} s in section {request['section']} (budget "
           f"{request['budget_s']:.0f} s)\n"]
    for r in range(world_size):
        out.append(f"\n=== rank {r} ===\n")
        if r in texts:
            out.append(texts[r].rstrip("\n") + "\n")
        else:
            p = progress.get(r) or {}
            where = (f"host {p.get('host')}, pid {p.get('pid')}, iteration "
                     f"{p.get('iteration')}" if p else "no progress record")
            state = " (stopped: /proc state T)" if p.get("host") == socket.gethostname() and \
                _stopped(p.get("pid")) else ""
            out.append(f"rank {r}: no stack: did not answer (stopped, dead, or holding the "
                       f"GIL in native code); last seen {where}{state}\n")
    return "".join(out)


def hang_line(named: list[int], request: dict, stacks: str) -> str:
    who = ("rank " if len(named) == 1 else "ranks ") + ", ".join(map(str, named))
    return (f"error: hang: {who} stopped beating at iteration {request['iteration']} "
            f"({request['waited_s']:.0f} s without a finished step, the {request['section']} "
            f"budget is {request['budget_s']:.0f} s; --ft-rank-section-timeouts); every rank's "
            f"Python stack: {stacks}")


def hang_records(save: str, since: float = 0.0) -> list[dict]:
    """The hang records (``hang.json``) under ``<save>/hangs`` written after ``since`` (epoch
    seconds), oldest first."""
    root = os.path.join(save, HANGS_DIR)
    found = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        path = os.path.join(root, name, RECORD_FILE)
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if record.get("time", 0) >= since:
            found.append(record)
    return sorted(found, key=lambda r: r.get("time", 0))
