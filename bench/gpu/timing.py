"""A row of the table, one training step (``Stepper``), the clocks, the bf16 matmul ceiling, the
timed steps and the phase split."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.profiler import record_function

from bench.common import sync
from bench.gpu.workloads import Settings
from rtd_scale.phases import PHASE_BACKWARD, PHASE_DATA_WAIT, PHASE_FORWARD, PHASE_OPTIMIZER_STEP


def fmt_k(x: Optional[float]) -> str:
    """A rate as the table and the log print it: 24.5k, 812.3, or - when not measured."""
    if x is None:
        return "-"
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.1f}"


# H100 / H200 SXM dense bf16 datasheet peak, the MFU denominator of tools/estimate_cost.py
PEAK_FLOPS = 989e12


class RowSkipped(Exception):
    """A row that cannot run on this machine (a kernel or package missing): reported as
    skipped with the reason, not as an error."""


@dataclass
class Row:
    """One line of the table."""

    workload: str
    impl: str
    title: str
    micro_batch: int
    seq_length: int
    flops_per_token: float
    target_tokens_per_s: Optional[float] = None
    anchor_tokens_per_s: Optional[float] = None
    status: str = "ok"  # ok | OOM | error | skipped | timeout
    note: str = ""
    steps: int = 0
    step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None
    mfu: Optional[float] = None
    mfu_peak: Optional[float] = None  # of the datasheet's dense bf16 peak (PEAK_FLOPS)
    core: str = ""  # rtd_scale rows: the attention core (workloads.CORES), "" the default
    peak_mem_gib: Optional[float] = None
    seconds: float = 0.0  # wall time of the row, build included


@dataclass
class Stepper:
    """One training step, ``stepper(i, timers)``, with its phases entered as ``timers(phase)``
    (``rtd_scale/phases.py``'s names), the convention of ``training/step.py``'s ``train_step``:
    the phase split times them with ``training/timers.py``'s ``PhaseTimers`` and the sync census
    reads which phase an operation belongs to."""

    run: Callable[[int, Any], Any]
    keep: list = field(default_factory=list)  # objects to free with the row

    # by default each phase is a torch.profiler range, as ``training/timers.py``'s ``NO_TIMERS``
    def __call__(self, i: int, timers=record_function) -> None:
        self.run(i, timers)


def phased(forward: Callable[[int], Any], backward: Callable[[Any], None],
           update: Callable[[], None]) -> Callable[[int, Any], None]:
    """``Stepper.run`` of a step written as forward (batch i → loss), backward and update."""
    def run(i: int, timers) -> None:
        with timers(PHASE_FORWARD):
            out = forward(i)
        with timers(PHASE_BACKWARD):
            backward(out)
        with timers(PHASE_OPTIMIZER_STEP):
            update()

    return run


class Clock:
    """CUDA events on the GPU (no host sync until ``elapsed_ms``), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def release(device: torch.device) -> None:
    """Return a finished row's device memory and restart the peak-memory count (GPU only: on
    CPU memory is not measured, and a full collection costs ~0.3 s with these libraries)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def failure_note(e: BaseException) -> str:
    text = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, oom) or "out of memory" in str(e).lower()


def matmul_ceiling(s: Settings) -> float:
    """Best bf16 ``torch.mm`` FLOP/s over three trials of n³ products (n = 8192 on GPU)."""
    n = s.matmul_size
    g = torch.Generator(device=s.device).manual_seed(0)
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device=s.device, dtype=torch.bfloat16)
    reps = 2 if s.tiny else 25
    for _ in range(3):
        torch.mm(a, b, out=c)
    clock, best = Clock(s.device), 0.0
    for _ in range(3):
        t0 = clock.mark()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        ms = clock.elapsed_ms(t0, clock.mark())
        best = max(best, 2.0 * n ** 3 * reps / (ms / 1e3))
    del a, b, c
    return best


def time_steps(step: Stepper, s: Settings, start: int = 0) -> tuple[float, int]:
    """(ms per step, timed steps): warm-up, one probe step to size the timed run to the row's
    budget (when the step count is not fixed), then ``n`` steps back to back between two CUDA
    events; the host waits for the device only after the last one."""
    for i in range(s.warmup_steps):
        step(start + i)
    first = start + s.warmup_steps
    n = s.min_steps
    if s.max_steps > s.min_steps:
        sync(s.device)
        t0 = time.perf_counter()
        step(first)
        sync(s.device)
        probe = time.perf_counter() - t0
        n = int(min(s.max_steps, max(s.min_steps, s.row_budget_s // max(probe, 1e-6))))
        first += 1
    clock = Clock(s.device)
    a = clock.mark()
    for i in range(first, first + n):
        step(i)
    b = clock.mark()
    return clock.elapsed_ms(a, b) / n, n


def phase_split(step: Stepper, s: Settings, start: int, n: int = 3) -> dict[str, float]:
    """Mean ms per step in forward, backward and optimizer update: the step's own phases timed by
    ``training/timers.py``'s ``PhaseTimers`` at level 1 (device time between CUDA events; one
    synchronize at the read). The data wait (the batch's copy to the device) counts as forward."""
    from rtd_scale.training.timers import PhaseTimers

    timers = PhaseTimers(1, s.device)
    for i in range(start, start + n):
        step(i, timers)
    ms = timers.read(n)
    return {"forward": ms.get(PHASE_DATA_WAIT, 0.0) + ms.get(PHASE_FORWARD, 0.0),
            "backward": ms.get(PHASE_BACKWARD, 0.0),
            "update": ms.get(PHASE_OPTIMIZER_STEP, 0.0)}


def stack_stepper(module: torch.nn.Module, run: Callable[[torch.Tensor], torch.Tensor],
                  x: torch.Tensor) -> Stepper:
    """A layer stack alone in bf16 weights: forward of the fixed input ``x`` (``run(x)``),
    backward of a fixed random output gradient, no optimizer (the gradients are dropped)."""
    module.to(torch.bfloat16).train()
    x.requires_grad_(True)
    grad = torch.randn_like(x)

    def update():
        module.zero_grad(set_to_none=True)
        x.grad = None

    return Stepper(phased(lambda i: run(x), lambda out: out.backward(grad), update),
                   keep=[module, x])
