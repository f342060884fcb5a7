"""The guard that keeps ``tests/unit/`` single-process (STYLE rule 11): while it is on, starting a
process — ``subprocess`` (``run``, ``Popen``, ``check_output``), ``os.system``, ``os.fork``,
``os.posix_spawn``, or a ``multiprocessing`` / ``torch.multiprocessing`` process or pool, whatever
its start method (DataLoader workers included) — fails the test with one line naming the rule.

Library-internal compiler runs are allowed: torch inductor's own children while it compiles in
this process, the C++ compiler it runs on the kernels it generated (``torch._inductor.cpp_builder``)
and the child Python that checks the built library loads
(``torch._inductor.cpu_vec_isa.VecISA._probe_load``); DeepSpeed's op builders probing which ops
this machine can build (``deepspeed/ops/op_builder/builder.py`` ``has_function``, run by
``deepspeed.ops`` on first use, compiles a test program with setuptools' distutils compiler). Its pool of compile workers is not (it
would run the test's compilation in other processes): ``tests/unit/conftest.py`` sets
``torch._inductor.config.compile_threads = 1``, inductor's switch for compiling in-process, and a
start from ``torch/_inductor/compile_worker/`` is refused.
"""
from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
import sysconfig
from typing import Iterator

RULE = "tests/unit/ is single-process: move this test to tests/tools/ or tests/e2e/"

# library code whose process starts are its own business (see the module docstring)
_ALLOWED_CALLERS = tuple(os.sep + os.path.join(*parts) + os.sep for parts in (
    ("torch", "_inductor"), ("deepspeed", "ops", "op_builder"),
    ("setuptools", "_distutils", "compilers")))
_REFUSED_CALLERS = (os.sep + os.path.join("torch", "_inductor", "compile_worker") + os.sep,)
_STDLIB = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep


class ProcessStartError(AssertionError):
    """A process was started while the guard was on."""


def _program(args) -> str:
    """The program of a ``Popen`` argument: a list's first item, a command line's first word."""
    words = os.fsdecode(args).split() if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return os.fsdecode(words[0]) if words else ""


def allowed_caller() -> bool:
    """Whether the nearest caller outside the standard library (the frame that asked for the
    process, past ``subprocess`` and this module) is library code allowed to start one."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        in_stdlib = path.startswith(_STDLIB) and "site-packages" not in path
        if path != os.path.realpath(__file__) and not in_stdlib:
            return (any(part in path for part in _ALLOWED_CALLERS)
                    and not any(part in path for part in _REFUSED_CALLERS))
        frame = frame.f_back
    return False


def check_popen(args) -> None:
    """Raise :class:`ProcessStartError` naming ``args``' program unless an allowed library
    caller started it."""
    if not allowed_caller():
        raise ProcessStartError(f"{RULE} (it started {_program(args) or args!r})")


def refuse(what: str):
    def refused(*_a, **_k):
        raise ProcessStartError(f"{RULE} (it called {what})")
    return refused


@contextlib.contextmanager
def no_processes() -> Iterator[list[str]]:
    """Within the block every process start raises :class:`ProcessStartError`; yields the list of
    refused starts' messages (so a start whose error some library swallowed still fails the test)."""
    refused: list[str] = []

    def record(fn):
        def wrapped(*a, **k):
            try:
                return fn(*a, **k)
            except ProcessStartError as e:
                refused.append(str(e))
                raise
        return wrapped

    real_init = subprocess.Popen.__init__

    def popen_init(self, args, *a, **k):
        check_popen(args)
        real_init(self, args, *a, **k)

    def process_start(self):
        raise ProcessStartError(f"{RULE}; a multi-process test goes to tests/multiproc/ (it started "
                                f"multiprocessing process {self.name})")

    patches: list[tuple[object, str, object]] = [
        (subprocess.Popen, "__init__", record(popen_init)),
        (multiprocessing.process.BaseProcess, "start", record(process_start)),
    ]
    for name in ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            patches.append((os, name, record(refuse(f"os.{name}"))))
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield refused
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)



@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """:func:`no_processes` with torch inductor compiling in this process
    (``compile_threads = 1``, see the module docstring). A refused start whose error code inside
    the block caught (or turned into another error) still raises :class:`ProcessStartError`."""
    from torch._inductor import config as inductor_config

    refused: list[str] = []
    threads, inductor_config.compile_threads = inductor_config.compile_threads, 1
    try:
        with no_processes() as refused:
            yield
    except ProcessStartError:
        raise
    except BaseException as e:
        if refused:
            raise ProcessStartError(f"{refused[0]} (then: {type(e).__name__}: {e})") from e
        raise
    finally:
        inductor_config.compile_threads = threads
    if refused:
        raise ProcessStartError(f"{refused[0]} (its error was caught inside the test)")
