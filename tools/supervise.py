#!/usr/bin/env python
"""Restart a training run on one machine after a crash or a hang, as the Slurm job does.

    python tools/supervise.py -- deepspeed --num_gpus 8 rtd_scale/pretrain.py \\
        --ds_config ds_configs/zero3.json ... --save runs/base

Runs the command; when it fails, decides as slurm/lib/pretrain_job.sh does
(rtd_scale/restarts.py): a user-input error (pretrain.py's exit status 2, after its ``error:``
line) is not restarted; a crash (a signal, a Python exception, a collective error) or a hang the
heartbeat found (``training/heartbeat.py``, exit status 75) is restarted from the newest complete
checkpoint in ``--save`` (``--load`` is added once one exists) after a back-off, up to
``--max-restarts`` times; the same iteration failing ``--max-failures-at-step`` times in a row
stops with one line naming it. Each restart is one ``[rtd-supervise]`` line here, one line in
``<save>/restarts.jsonl`` and one event in the restarted run's TensorBoard (``restarts/*``).
Exits 0 when the run finished, else with the last failure's status.

A stop is a stop: SIGTERM (``kill``, systemd), SIGINT (Ctrl-C) or SIGHUP here reaches the whole
run (its own process group) as SIGTERM; every rank finishes its step and saves there, nothing is
restarted (neither is a run whose ranks stopped on a signal sent to them), and once no process of
the run is left one line names the newest complete checkpoint and the command that resumes it;
the status is 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP).

torchrun's ``--max-restarts`` also restarts a failed run, but it restarts a user error too, gives
a fresh start no ``--load`` when a checkpoint appears, and cannot tell one crash loop from
another; this wrapper does those, with the same rules as the Slurm job.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.cli_errors import (EXIT_USER_ERROR, OneLineArgumentParser,  # noqa: E402
                                  exit_process)
from rtd_scale.restarts import (DEFAULT_BACKOFF_S, DEFAULT_MAX_RESTARTS,  # noqa: E402
                                DEFAULT_MAX_SAME, command_flags, supervise)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv and any(a in ("-h", "--help") for a in argv):
        argv = [*argv, "--"]  # the help, without a command to supervise
    if "--" not in argv:
        print("error: expected `tools/supervise.py [options] -- COMMAND ...` (the deepspeed "
              "command after --)", file=sys.stderr)
        return EXIT_USER_ERROR
    split = argv.index("--")
    own, cmd = argv[:split], argv[split + 1:]
    p = OneLineArgumentParser(prog="tools/supervise.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS,
                   help=f"restarts after a crash or a hang (default {DEFAULT_MAX_RESTARTS})")
    p.add_argument("--max-failures-at-step", type=int, default=DEFAULT_MAX_SAME,
                   help="stop once the same iteration failed this many times in a row (default "
                        f"{DEFAULT_MAX_SAME}; 0: never)")
    p.add_argument("--backoff", type=float, default=DEFAULT_BACKOFF_S, metavar="SECONDS",
                   help=f"wait before the first restart, doubled each time (default "
                        f"{DEFAULT_BACKOFF_S:g})")
    a = p.parse_args(own)
    for flag, value, least in (("--max-restarts", a.max_restarts, 0),
                               ("--max-failures-at-step", a.max_failures_at_step, 0),
                               ("--backoff", a.backoff, 0)):
        if not value >= least:  # also NaN
            print(f"error: {flag} {value}: must be >= {least}", file=sys.stderr)
            return EXIT_USER_ERROR
    if not cmd:
        print("error: no command after --: expected `tools/supervise.py [options] -- deepspeed "
              "... rtd_scale/pretrain.py ... --save DIR`", file=sys.stderr)
        return EXIT_USER_ERROR
    if shutil.which(cmd[0]) is None:
        print(f"error: {cmd[0]}: no such command (the first word after --); give the launcher's "
              "path, e.g. .venv/bin/deepspeed", file=sys.stderr)
        return EXIT_USER_ERROR
    save = command_flags(cmd).save  # as pretrain.py reads it: --save D, --save=D
    if not save:
        print("error: the command has no --save DIR: a restart resumes from the checkpoints "
              "there; add --save and --save-interval", file=sys.stderr)
        return EXIT_USER_ERROR
    save = os.path.abspath(save)
    # the restart records live there: a run that fails before creating it is still counted
    os.makedirs(save, exist_ok=True)
    relaunch = [sys.executable, sys.argv[0], *own, "--"]
    return supervise(cmd, save=save, max_restarts=a.max_restarts,
                     max_same=a.max_failures_at_step, backoff_s=a.backoff, relaunch=relaunch)


if __name__ == "__main__":
    exit_process(main())
