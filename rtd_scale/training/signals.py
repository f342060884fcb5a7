"""Stop a run cleanly: on SIGTERM, SIGINT (Ctrl-C), ``--exit-signal``, or when the ``deepspeed``
launcher above this rank goes away, every rank finishes the current step, the run saves a
checkpoint there and each rank exits 0.

How the DeepSpeed launcher (0.19.8, single node) passes signals on, which sets what is needed:

- ``deepspeed`` (``launcher/runner.py``) starts ``python -m deepspeed.launcher.launch`` and waits;
  it installs no handler (only with pdsh across nodes), so SIGTERM kills it and tells nobody:
  launch.py and the ranks would train on, orphaned. Hence the watch on the launcher processes
  (``launcher_processes``): a rank whose runner or launch.py exits stops as if signalled.
- ``launch.py`` handles SIGINT and SIGTERM by SIGTERM to each rank's process tree
  (``terminate_process_tree``), waits 30 s, then SIGKILLs what is left: the current step and the
  save must fit in those 30 s (a save cut short leaves the previous complete checkpoint the one
  ``--load`` takes: ``checkpoint/save.py``).
- Ctrl-C in a terminal sends SIGINT to the whole process group: runner, launch.py, the ranks and
  their DataLoader workers (which ignore it: ``data/loader.py``).
- Slurm's ``scancel`` and pdsh's kill command send SIGTERM to the ranks themselves.

A handler only records the signal; the loop asks ``StopRequest.agreed`` at the end of each step,
one MAX all-reduce of one int64 on the host (gloo), so every rank stops after the same step
without a device sync (Megatron-LM's ``DistributedSignalHandler`` all-gathers a CUDA tensor and
reads it every step instead).
"""
from __future__ import annotations

import os
import select
import signal
import threading
from typing import Iterable, Optional

import torch
import torch.distributed as dist

# the code a rank reports when a launcher process above it exited (beyond any signal number)
LAUNCHER_EXITED = 1024
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _parent_of(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state
    except (OSError, ValueError, IndexError):
        return None


def _is_runner(argv: list[str]) -> bool:
    """The ``deepspeed`` console script (``deepspeed``, ``ds``, ``deepspeed.pt``) or
    ``python -m deepspeed.launcher.runner``."""
    return any(os.path.basename(a) in ("deepspeed", "ds", "deepspeed.pt")
               or a == "deepspeed.launcher.runner" for a in argv[:3])


def launcher_processes(pid: Optional[int] = None) -> list[tuple[int, str]]:
    """(pid, name) of the DeepSpeed launcher processes above process ``pid`` (default: this
    one): its parent when that is ``deepspeed.launcher.launch``, and that one's parent when it
    is the ``deepspeed`` runner. Empty for any other parent (torchrun, srun, a shell): only a
    launcher's exit means the run is over, not, say, a shell's under ``nohup``."""
    parent = _parent_of(pid) if pid is not None else os.getppid()
    if parent is None or "deepspeed.launcher.launch" not in _cmdline(parent):
        return []
    found = [(parent, "deepspeed.launcher.launch process")]
    runner = _parent_of(parent)
    if runner and _is_runner(_cmdline(runner)):
        found.append((runner, "deepspeed launcher"))
    return found


class StopRequest:
    """Remembers the first stop request this rank saw: a signal in ``signums``, or the exit of a
    launcher process above it. Use as a context manager; it restores the previous handlers."""

    def __init__(self, signums: Iterable[int] = DEFAULT_SIGNALS, *,
                 watch_launcher: bool = True):
        self.signums = list(dict.fromkeys(signums))
        self.code = 0  # 0: nothing yet; a signal number; LAUNCHER_EXITED
        self.launcher: Optional[tuple[int, str]] = None  # the launcher process that exited
        self._previous: dict[int, object] = {}
        self._watch = watch_launcher
        self._wake: Optional[tuple[int, int]] = None

    def __enter__(self) -> "StopRequest":
        for s in self.signums:
            self._previous[s] = signal.signal(s, self._handle)
        procs = launcher_processes() if self._watch else []
        if procs:
            self._wake = os.pipe()
            threading.Thread(target=self._watch_launcher, args=(procs,), daemon=True,
                             name="rtd-launcher-watch").start()
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        if self._wake is not None:
            os.write(self._wake[1], b"x")  # ends the watching thread

    def _handle(self, signum, frame) -> None:
        self.code = self.code or signum

    def _watch_launcher(self, procs: list[tuple[int, str]]) -> None:
        """Block until a launcher process exits (a pidfd becomes readable: no polling)."""
        fds = {}
        for pid, name in procs:
            try:
                fds[os.pidfd_open(pid)] = (pid, name)
            except (AttributeError, OSError):  # no pidfd (Linux < 5.3) or already gone
                pass
        # the pids were read before the pidfds opened: still the same processes?
        if launcher_processes() != procs:
            fds, gone = {}, True
        else:
            gone = False
        if fds:
            ready, _, _ = select.select([*fds, self._wake[0]], [], [])
            gone = any(fd in fds for fd in ready)
            procs = [fds[fd] for fd in ready if fd in fds] or procs
        elif not gone:  # without pidfds: watch the parent chain once a second
            while launcher_processes() == procs:
                if select.select([self._wake[0]], [], [], 1.0)[0]:
                    return
            gone = True
        for fd in fds:
            os.close(fd)
        if gone and not self.code:
            self.launcher = procs[-1]
            self.code = LAUNCHER_EXITED

    def agreed(self, group: Optional[dist.ProcessGroup] = None) -> int:
        """The stop code every rank agrees on (the largest any rank saw; 0: go on). Collective
        over ``group`` (a gloo group: the value stays on the host) when torch.distributed runs
        with more than one rank."""
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return self.code
        flag = torch.tensor([self.code], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag[0])

    def reason(self, code: int) -> str:
        """What made the run stop, for the log line."""
        if code == LAUNCHER_EXITED:
            if self.launcher is not None:
                return f"the {self.launcher[1]} (pid {self.launcher[0]}) exited"
            return "a deepspeed launcher process exited"
        return f"exit signal {signal.Signals(code).name} received"
