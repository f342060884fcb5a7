"""The step profiler, with Megatron-LM's flags (``--profile --profile-step-start N
--profile-step-end M --profile-ranks R …``; its ``--use-pytorch-profiler`` path).

On each rank of ``profile_ranks``, a ``torch.profiler`` trace of iterations N … M − 1 (1-based,
as in the log; Megatron-LM's PyTorch-profiler schedule traces the same M − N steps), with one
warm-up iteration before them when there is one (the profiler's start-up cost stays out of the
trace), CPU and (on GPU) CUDA activity and shapes. The step's phases are ranges named in
``rtd_scale/phases.py`` (the phase timers' ``record_function``, ``training/timers.py``), so the
generator's and the discriminator's work each sit under their own range. Python stacks and
module names (``nn.Module: Encoder_0``, …; torch.profiler's ``with_stack``, which they need) come
with ``--set monitor.profile_with_stack=true``: off by default, as they make the trace some 100×
larger (268 MB for two tiny-preset CPU steps). The trace is a Chrome-trace JSON file,
``<tensorboard_dir>/profile/rank<R>_iter<N>-<M-1>.<ms>.pt.trace.json``: TensorBoard's profiler
plugin (``pip install torch-tb-profiler``; ``tensorboard --logdir <tensorboard_dir>``) and
https://ui.perfetto.dev read it. The rank names the file in one log line.

A resumed run traces the part of N … M − 1 after its checkpoint; a run that stops early (the exit
signal) writes the iterations traced so far.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Callable, Optional

import torch

from rtd_scale.config import MonitorConfig


def trace_dir(tensorboard_dir: str) -> str:
    return os.path.join(tensorboard_dir, "profile")


class StepProfiler:
    """Tell it each finished iteration (``step``); ``close`` at the end of training."""

    def __init__(self, monitor: MonitorConfig, *, rank: int, device: torch.device,
                 tensorboard_dir: Optional[str], first_step: int,
                 print_fn: Callable[[str], None] = print):
        """``first_step``: the first iteration this run trains (1-based: 1, or the checkpoint's
        step + 1)."""
        self.prof = None
        self.rank, self.print_fn = rank, print_fn
        wanted = monitor.profiled_iterations
        self.first, self.last = max(wanted.start, first_step), wanted.stop - 1
        if not monitor.profile or rank not in monitor.profile_ranks or self.first > self.last:
            return
        assert tensorboard_dir, "config_from_args/prepare require a TensorBoard directory"
        self.out_dir = trace_dir(tensorboard_dir)
        skip = self.first - first_step  # iterations before the traced ones, in this run
        warmup = 1 if skip >= 1 else 0
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # the schedule's step k is this run's (k+1)-th iteration: step() follows each one
        with warnings.catch_warnings():  # no warm-up when tracing from this run's first step
            warnings.filterwarnings("ignore", message=".*won't be using warmup.*")
            schedule = torch.profiler.schedule(wait=skip - warmup, warmup=warmup,
                                               active=self.last - self.first + 1, repeat=1)
        self.prof = torch.profiler.profile(
            activities=activities, schedule=schedule,
            on_trace_ready=self._save, record_shapes=True,
            with_stack=monitor.profile_with_stack, with_modules=monitor.profile_with_stack)
        self.prof.start()
        self.traced_to = self.first - 1

    def step(self, done: int) -> None:
        """Iteration ``done`` (1-based) has finished."""
        if self.prof is not None:
            if self.first <= done <= self.last:
                self.traced_to = done
            self.prof.step()

    def _save(self, prof) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        name = (f"rank{self.rank}_iter{self.first}-{self.traced_to}."
                f"{time.time_ns() // 1_000_000}.pt.trace.json")
        path = os.path.join(self.out_dir, name)
        prof.export_chrome_trace(path)
        self.print_fn(f"profiler: iterations {self.first}–{self.traced_to} of rank {self.rank} "
                      f"traced to {path} (TensorBoard's profiler plugin or https://ui.perfetto.dev)")

    def close(self) -> None:
        """Stop; a trace still recording (the run stopped early) is written."""
        if self.prof is not None:
            prof, self.prof = self.prof, None
            prof.stop()
