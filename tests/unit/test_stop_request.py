"""training/signals.py in one process: what a handler records, what it restores, the stop line.
The launcher tree and real signals through it: tests/e2e/test_signals.py."""
from __future__ import annotations

import os
import signal

from rtd_scale.training.loop import stop_line
from rtd_scale.training.signals import LAUNCHER_EXITED, StopRequest, _is_runner, launcher_processes


def test_first_signal_is_kept_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with StopRequest([signal.SIGUSR1, signal.SIGUSR2], watch_launcher=False) as stop:
        assert stop.agreed() == 0
        os.kill(os.getpid(), signal.SIGUSR2)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.agreed() == signal.SIGUSR2  # the first one; no process group: this rank's
        assert stop.reason(stop.agreed()) == "exit signal SIGUSR2 received"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_the_launcher_is_recognised_by_its_command_line():
    assert _is_runner(["/venv/bin/python", "/venv/bin/deepspeed", "--num_gpus", "2"])
    assert _is_runner(["python", "-m", "deepspeed.launcher.runner"])
    assert not _is_runner(["/bin/bash", "-c", "deepspeed_wrapper.sh"])
    assert launcher_processes() == []  # pytest's parent is no deepspeed launch.py
    stop = StopRequest((), watch_launcher=False)
    stop.launcher, stop.code = (41, "deepspeed launcher"), LAUNCHER_EXITED
    assert stop.reason(LAUNCHER_EXITED) == "the deepspeed launcher (pid 41) exited"


def test_stop_line_names_the_checkpoint_and_the_load():
    assert stop_line("exit signal SIGINT received", 7, "runs/x", "runs/x/global_step7",
                     None) == ("exit signal SIGINT received: stopped after iteration 7; saved "
                               "runs/x/global_step7; resume with --load runs/x")
    assert stop_line("r", 7, "runs/x", None, "runs/x/global_step5") == (
        "r: stopped after iteration 7; not saved at this iteration; resume from "
        "runs/x/global_step5 with --load runs/x/global_step5")
    assert stop_line("r", 7, None, None, None) == \
        "r: stopped after iteration 7 (no --save: nothing saved)"
