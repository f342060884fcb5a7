"""One-line errors for the command-line tools.

A tool's ``main`` raises :class:`UserInputError` (or lets an ``OSError`` such as a missing file or a
full disk escape); :func:`run_cli` prints ``error: <message>`` on stderr and exits with status 1,
without a traceback. Any other exception is a bug and keeps its traceback. Set
``RTD_SCALE_TRACEBACK=1`` to see the traceback of a user error too.
"""

from __future__ import annotations

import argparse
import difflib
import gc
import os
import re
import sys
import textwrap
import warnings
from typing import Callable, Sequence

__all__ = ["EXIT_HANG", "EXIT_USER_ERROR", "HeldWarnings", "HyphenSafeHelpFormatter", "OneLineArgumentParser", "UserInputError",
           "check_writable_dir", "exit_process", "run_cli"]


# Exit statuses of rtd_scale/pretrain.py that a supervisor (slurm/lib/pretrain_job.sh,
# tools/supervise.py; rtd_scale/restarts.py) reads. A user-input error exits 2, argparse's status
# for a bad command line, so one number means "the input is wrong: a restart would fail the same
# way"; Python's status for an uncaught exception (1) and a signal's (128 + N) are what a crash
# gives, and those are restarted. The hang watchdog (training/heartbeat.py) ends the ranks it
# stops with 75, sysexits.h's EX_TEMPFAIL ("a temporary failure; retry").
EXIT_USER_ERROR = 2
EXIT_HANG = 75


class UserInputError(ValueError):
    """A problem with the user's data, files or flags, stated in one line with the fix.

    Subclasses ``ValueError`` so library callers can catch it as one.
    """


def run_cli(main: Callable[[Sequence[str] | None], None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)``; turn user errors into ``error: <message>`` on stderr and exit status 1.

    Returns the process exit status: 0 on success, 1 on a user error or ``OSError``, 130 on Ctrl-C.
    """
    try:
        main(argv)
    except (UserInputError, OSError) as e:
        if os.environ.get("RTD_SCALE_TRACEBACK") == "1":
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return 0


def exit_process(status: int) -> None:
    """``sys.exit(status)`` for a program that has finished its work, without the interpreter's
    last garbage collection: at exit CPython collects every tracked object, and torch,
    megatron-core and DeepSpeed leave ~400,000 of them (about 2 CPU-s a process, for each rank of
    every launch). ``gc.freeze`` moves them to the permanent generation, which that collection
    skips; files and writers are closed by the code that opened them, and atexit handlers and
    the flush of stdout and stderr still run (Python's gc module documents freeze)."""
    gc.freeze()
    sys.exit(status)


def one_line_warnings() -> None:
    """Show rtd_scale's own warnings (``warnings.warn`` in a file of this package) as one line,
    ``warning: <message>`` (``note: …`` as is), instead of Python's two lines with the file,
    line number and source line; every other warning keeps Python's format."""
    package = os.path.dirname(os.path.abspath(__file__))
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not os.path.abspath(filename).startswith(package + os.sep):
            return shown(message, category, filename, lineno, file, line)
        text = " ".join(str(message).split())
        stream = sys.stderr if file is None else file
        print(text if text.startswith("note:") else f"warning: {text}", file=stream)

    warnings.showwarning = show


class HyphenSafeHelpFormatter(argparse.HelpFormatter):
    """argparse's help formatter, wrapping at spaces only: textwrap's default also breaks after
    a hyphen, which splits ``debertav3-tiny`` into ``debertav3-`` / ``tiny``."""

    def _split_lines(self, text, width):  # argparse's override point (as RawTextHelpFormatter)
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


# How long a rank that fails silently waits before exiting (wait_for_rank0_line).
QUIET_EXIT_GRACE_S = 30.0


def wait_for_rank0_line(seconds: float = QUIET_EXIT_GRACE_S) -> None:
    """Before a rank other than 0 exits on a user error that rank 0 reports: wait, so that rank
    0 prints its line first. A launcher (``deepspeed``, ``torchrun``, ``srun
    --kill-on-bad-exit``) stops every rank when the first one fails: had the silent rank exited
    first, rank 0 could be killed before its line was out, and a loaded machine showed no error
    at all. Rank 0's exit ends this wait at once (the launcher kills the waiting rank)."""
    import time

    time.sleep(seconds)


class OneLineArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line, not the whole usage block:
    ``error: <argparse's message> (did you mean --closest-flag?); <prog> --help lists every
    flag``, exit status 2 (argparse's). The closest flag is offered for an unrecognized or
    ambiguous option (underscores read as dashes, as Megatron-LM users type ``--hidden_size``);
    an invalid choice keeps argparse's list of choices.

    Abbreviations are off (``allow_abbrev=False``, as in Megatron-LM's
    ``megatron/training/arguments.py``): ``--train-iter 2`` is an unrecognized argument with
    the hint ``(did you mean --train-iters?)``, not a silent ``--train-iters 2``; a flag added
    later can then never change what an old command line means.

    ``quiet=True`` (the ranks other than 0 of a launch, ``pretrain.main``): the same exit
    status, but nothing printed, neither the error nor ``--help``, so a launch of N ranks shows
    rank 0's line once, not N times, and only after :func:`wait_for_rank0_line`
    (tests/e2e/test_pretrain_errors.py::test_launcher_prints_a_flag_error_once).

    Help text wraps at spaces only, never inside a hyphenated name such as
    ``--tensorboard-dir`` or ``debertav3-tiny`` (:class:`HyphenSafeHelpFormatter`)."""

    def __init__(self, *args, quiet: bool = False, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HyphenSafeHelpFormatter)
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def print_help(self, file=None):  # noqa: D102 (argparse's hook, also behind --help)
        if not self.quiet:
            super().print_help(file)

    def exit(self, status=0, message=None):  # noqa: D102 (argparse's hook)
        if self.quiet and status:
            wait_for_rank0_line()
        super().exit(status, None if self.quiet else message)

    def error(self, message: str):  # noqa: D102 (argparse's hook)
        hint = ""
        if message.startswith(("unrecognized arguments:", "ambiguous option:")):
            words = re.findall(r"(--?[A-Za-z][\w-]*)", message.split(":", 1)[1])
            known = [o for a in self._actions for o in a.option_strings
                     if a.help is not argparse.SUPPRESS]
            for word in words[:1]:
                close = difflib.get_close_matches(word.replace("_", "-"), known, n=1, cutoff=0.75)
                if close and close[0] != word:
                    hint = f" (did you mean {close[0]}?)"
        self.exit(2, f"error: {message}{hint}; {self.prog} --help lists every flag\n")


class HeldWarnings:
    """Hold the warnings raised inside ``with HeldWarnings() as held:`` until ``held.release()``,
    which shows them (once, through the ``warnings.showwarning`` in force outside) and lets
    later warnings through; leaving the block without ``release()`` drops them.

    ``pretrain.main`` validates a run (config, ds_config, tokenizer, data, ``--load``) inside
    one, and releases it once everything is validated: a run that is refused prints its one
    error line, not also warnings about a run that never starts
    (tests/e2e/test_pretrain_errors.py::test_refused_run_prints_no_config_warning).
    """

    def __init__(self) -> None:
        self._cm = None
        self._caught: list = []

    def __enter__(self) -> "HeldWarnings":
        self._cm = warnings.catch_warnings(record=True)
        self._caught = self._cm.__enter__()
        return self

    def release(self) -> None:
        if self._cm is None:
            return
        cm, self._cm = self._cm, None
        cm.__exit__(None, None, None)
        for w in self._caught:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)

    def __exit__(self, *exc) -> bool:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(*exc)  # the held warnings are dropped
        return False


def check_writable_dir(path: str, flag: str) -> None:
    """Refuse, without creating anything, a directory that cannot be created or written:
    ``path`` itself, or its nearest existing ancestor, must be a directory this process may
    write into. Probed with ``os.access`` and by creating (and removing) a temporary directory
    there, since root passes ``os.access`` on a directory whose mode forbids writing but not
    one under /proc or on a read-only file system
    (tests/e2e/test_pretrain_errors.py::test_unwritable_tensorboard_dir).

    Raises:
        UserInputError: naming ``flag``, the path and the fix.
    """
    import errno
    import tempfile

    fix = f"pass a writable directory to {flag}"
    here = os.path.abspath(path)
    while not os.path.exists(here):  # the nearest existing ancestor
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        what = "exists and is not a directory" if here == os.path.abspath(path) else (
            f"cannot be created: {here} is a file, not a directory")
        raise UserInputError(f"{flag} {path}: {what}; {fix}")
    try:
        if not os.access(here, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        os.rmdir(tempfile.mkdtemp(prefix=".rtd_scale_probe", dir=here))
    except OSError as e:
        # a directory that exists but refuses a new entry: /proc and sysfs answer ENOENT,
        # whose "No such file or directory" would send the reader looking for a missing parent
        why = ("it takes no new directories" if e.errno == errno.ENOENT
               else e.strerror or type(e).__name__)
        if here == os.path.abspath(path):
            raise UserInputError(f"{flag} {path}: not writable ({why}); {fix}") from None
        raise UserInputError(f"{flag} {path}: cannot be created: {here} is not writable "
                             f"({why}); {fix}") from None
