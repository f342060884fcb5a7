"""Per-phase timers: Megatron-LM's ``--timing-log-level`` (0 none, 1 coarse, 2 fine).

Level 1 times, per iteration: the data wait (the loader's next micro-batches and their copy to
the device), the forward (the step's masking and counts, then ``engine(...)``: both encoders,
sampling and the losses), the backward (``engine.backward``, under ZeRO-2/3 with the gradient
reduce-scatter its hooks run) and the optimizer step (``engine.step``). Level 2 adds the
forward's parts, nested inside it: mask (the step's ``RTDModel.mask`` of every micro-batch),
generator forward (the generator encoder, its MLM head and L_MLM), sample (the
``ReplacementSampler``'s Gumbel-max draw) and discriminator forward (the discriminator encoder,
its RTD head and L_RTD); the masked rows' gather, the corrupted ids, their labels and the
counts are small tensor ops between the parts, in the forward only. Under pipeline parallelism the forward and backward of level 1 are instead
the two 1F1B passes, the hand-over of the corrupted ids and the tied-gradient all-reduce
(``training/pipeline.py``); the fine phases nest inside the passes. Names: ``rtd_scale/phases.py``.

The timers stay at the step level (STYLE rule 3: model code reads as a network): the step enters
its phases itself, and the forward's parts are timed by hooks on the model's submodules
(``timed_parts``, ``PARTS``) that the step's owner attaches.

Where the time goes:
- CPU: ``time.perf_counter`` at each boundary; this path never touches ``torch.cuda``.
- CUDA: one pair of CUDA events per phase entry, recorded on the current stream; nothing waits
  until ``read()`` at the log interval, which synchronizes once and sums ``elapsed_time``. A
  phase is then the stream's time between its boundaries: host work hidden behind queued
  kernels (a loader that keeps up) reads as ~0. Megatron-LM's timers instead synchronize the
  device at every start and stop (and optionally barrier); DeepSpeed's ``wall_clock_breakdown``
  reads its events and prints every step — both a host sync per step, which these avoid.

DeepSpeed 0.19.8's own timers (``wall_clock_breakdown`` in the ds_config, honoured as written):
``fwd``, ``bwd``, ``bwd_inner``, ``bwd_allreduce``, ``step`` and ZeRO-3's ``optimizer_step``.
They are not read here: they are logged and reset by ``engine.step()`` every step. ZeRO-3's
parameter all-gather is timed only by its coordinator's profiler, off by a module constant
(``partitioned_param_coordinator.ENABLE_PROFILER = False``), and its reduce-scatter runs inside
the backward hooks (``bwd_inner``) but for the last bucket (``bwd_allreduce``); here both land in
the phase whose modules they serve (the gathers in the forward phases and the backward, the
reduce-scatter in the backward).

Reported: the logging rank's milliseconds per iteration, averaged over the log interval, as
TensorBoard ``timers/<phase>_ms`` (the phase name without ``rtd/``) and in the log line.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional

import torch
from torch.profiler import record_function

from rtd_scale.phases import (PHASE_BACKWARD, PHASE_DATA_WAIT,
                                       PHASE_DISCRIMINATOR_FORWARD, PHASE_FORWARD,
                                       PHASE_GENERATOR_FORWARD, PHASE_MASK, PHASE_OPTIMIZER_STEP,
                                       PHASE_PIPELINE_DISCRIMINATOR_PASS,
                                       PHASE_PIPELINE_GENERATOR_PASS, PHASE_PIPELINE_ID_HANDOVER,
                                       PHASE_PIPELINE_TIED_GRADIENTS, PHASE_SAMPLE)

# The level a phase is timed from (Megatron-LM's --timing-log-level). Level-1 phases do not
# overlap; each level-2 phase lies inside one of its PARENTS.
LEVELS = {PHASE_DATA_WAIT: 1, PHASE_FORWARD: 1, PHASE_BACKWARD: 1,
          PHASE_PIPELINE_GENERATOR_PASS: 1, PHASE_PIPELINE_ID_HANDOVER: 1,
          PHASE_PIPELINE_DISCRIMINATOR_PASS: 1, PHASE_PIPELINE_TIED_GRADIENTS: 1,
          PHASE_OPTIMIZER_STEP: 1,
          PHASE_MASK: 2, PHASE_GENERATOR_FORWARD: 2, PHASE_SAMPLE: 2,
          PHASE_DISCRIMINATOR_FORWARD: 2}
PARENTS = {PHASE_MASK: (PHASE_FORWARD, PHASE_PIPELINE_GENERATOR_PASS),
           PHASE_GENERATOR_FORWARD: (PHASE_FORWARD, PHASE_PIPELINE_GENERATOR_PASS),
           PHASE_SAMPLE: (PHASE_FORWARD, PHASE_PIPELINE_GENERATOR_PASS),
           PHASE_DISCRIMINATOR_FORWARD: (PHASE_FORWARD, PHASE_PIPELINE_DISCRIMINATOR_PASS)}
# The log line's labels, in the order it shows them (the step's order).
LABELS = {PHASE_DATA_WAIT: "data", PHASE_FORWARD: "fwd", PHASE_MASK: "mask",
          PHASE_GENERATOR_FORWARD: "gen_fwd", PHASE_SAMPLE: "sample",
          PHASE_DISCRIMINATOR_FORWARD: "disc_fwd", PHASE_BACKWARD: "bwd",
          PHASE_PIPELINE_GENERATOR_PASS: "gen_pass", PHASE_PIPELINE_ID_HANDOVER: "id_handover",
          PHASE_PIPELINE_DISCRIMINATOR_PASS: "disc_pass",
          PHASE_PIPELINE_TIED_GRADIENTS: "tied_grads", PHASE_OPTIMIZER_STEP: "step"}
TIMING_LOG_LEVELS = (0, 1, 2)


def scalar_tag(phase: str) -> str:
    """The TensorBoard tag of ``phase``: ``rtd/data_wait`` → ``timers/data_wait_ms``."""
    return f"timers/{phase.removeprefix('rtd/')}_ms"


_PHASE_OF_TAG = {scalar_tag(p): p for p in LEVELS}


class HostClock:
    """``time.perf_counter`` seconds; never touches ``torch.cuda``."""

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @staticmethod
    def settle() -> None:
        pass

    @staticmethod
    def elapsed_ms(start: float, end: float) -> float:
        return 1000.0 * (end - start)


class CudaEventClock:
    """CUDA events on the current stream; ``settle`` (the one synchronize) at read time."""

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def now():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return start.elapsed_time(end)


class _Span:
    """A timed phase, inside its ``torch.profiler`` range."""

    __slots__ = ("timers", "phase", "start", "range")

    def __init__(self, timers: "PhaseTimers", phase: str):
        self.timers, self.phase = timers, phase

    def __enter__(self):
        self.range = record_function(self.phase)
        self.range.__enter__()
        self.start = self.timers.clock.now()

    def __exit__(self, *exc):
        self.timers._spans.setdefault(self.phase, []).append((self.start, self.timers.clock.now()))
        self.range.__exit__(*exc)


class PhaseTimers:
    """``timers(phase)`` is a context manager timing ``phase`` when its level (``LEVELS``) is at
    most ``level``; at every level it marks ``phase`` as a ``torch.profiler`` range (``--profile``,
    ``training/profiler.py``; without a profiler running that is a no-op); a phase may be entered many times per iteration (its
    times add up). ``read(iterations)`` gives each timed phase's milliseconds per iteration since
    the previous read, and starts afresh.

    Args:
        level: 0 (time nothing), 1 (coarse) or 2 (fine); Megatron-LM's --timing-log-level.
        device: the training device; CUDA events on ``cuda``, ``time.perf_counter`` otherwise.
        clock: replaces the device's clock (tests).
    """

    def __init__(self, level: int, device: Optional[torch.device] = None, *, clock=None):
        assert level in TIMING_LOG_LEVELS, level  # TrainConfig.validate names the flag
        self.level = level
        if clock is None:
            cuda = device is not None and torch.device(device).type == "cuda"
            clock = CudaEventClock(torch.device(device)) if cuda else HostClock()
        self.clock = clock
        self._spans: dict[str, list] = {}

    def __call__(self, phase: str):
        if LEVELS[phase] > self.level:
            return record_function(phase)
        return _Span(self, phase)

    def read(self, iterations: int) -> dict[str, float]:
        """Milliseconds per iteration of each phase timed since the previous read (a phase never
        entered is absent). On CUDA one device synchronize; call it at the log interval."""
        if not self._spans:
            return {}
        self.clock.settle()
        out = {phase: sum(self.clock.elapsed_ms(a, b) for a, b in spans) / max(iterations, 1)
               for phase, spans in self._spans.items()}
        self._spans = {}
        return out


NO_TIMERS = PhaseTimers(0)  # times nothing (marks profiler ranges); keeps no state

# The forward's level-2 parts: the RTDModel submodules whose calls each phase times (the first
# pipeline stage holds the encoders' embeddings, the last the heads and the sampler; every
# stage its share of each encoder).
PARTS = {"generator": PHASE_GENERATOR_FORWARD, "mlm_head": PHASE_GENERATOR_FORWARD,
         "sampler": PHASE_SAMPLE, "mlm_criterion": PHASE_GENERATOR_FORWARD,
         "discriminator": PHASE_DISCRIMINATOR_FORWARD, "rtd_head": PHASE_DISCRIMINATOR_FORWARD,
         "rtd_criterion": PHASE_DISCRIMINATOR_FORWARD}


@contextlib.contextmanager
def timed_parts(model: torch.nn.Module, timers: Callable) -> Iterator[None]:
    """Within the block, every call of ``model``'s parts (``PARTS``; those this stage holds) is
    entered as ``timers(phase)`` (a ``PhaseTimers``, or any callable giving a context manager),
    by forward hooks: the first pre-hook and the last hook of each module, so a phase holds
    what other hooks do around the call (DeepSpeed ZeRO-3's parameter gather and release).
    The hooks are removed on leaving."""
    handles = []
    try:
        for name, phase in PARTS.items():
            module = getattr(model, name, None)
            if module is None:
                continue
            open_spans: list = []

            def enter(_module, _args, phase=phase, open_spans=open_spans):
                span = timers(phase)
                span.__enter__()
                open_spans.append(span)

            def leave(_module, _args, _output, open_spans=open_spans):
                open_spans.pop().__exit__(None, None, None)

            handles.append(module.register_forward_pre_hook(enter, prepend=True))
            handles.append(module.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def timer_scalars(ms: dict[str, float]) -> dict[str, float]:
    """``read()``'s result as TensorBoard scalars (``scalar_tag``)."""
    return {scalar_tag(phase): v for phase, v in ms.items()}


def format_timer_fields(scalars: dict[str, float]) -> str:
    """The log line's ``time ms:`` field from the ``timers/*_ms`` scalars ("" when none): the
    level-1 phases in the step's order, each followed by the level-2 phases inside it, e.g.
    `` time ms: data 1.2 | fwd 30.0 [mask 0.5, gen_fwd 10.1, sample 2.0, disc_fwd 15.3] |
    bwd 50.2 | step 5.0 |``."""
    ms = {_PHASE_OF_TAG[k]: v for k, v in scalars.items() if k in _PHASE_OF_TAG}
    if not ms:
        return ""
    fields, shown = [], set()
    for phase in LABELS:
        if LEVELS[phase] != 1 or phase not in ms:
            continue
        parts = [p for p in LABELS if p in ms and phase == next(
            (q for q in PARENTS.get(p, ()) if q in ms), None)]
        shown.update(parts)
        inner = f" [{', '.join(f'{LABELS[p]} {ms[p]:.1f}' for p in parts)}]" if parts else ""
        fields.append(f"{LABELS[phase]} {ms[phase]:.1f}{inner}")
    # level-2 phases with no parent timed (not in this step's layout): shown on their own
    fields += [f"{LABELS[p]} {ms[p]:.1f}" for p in LABELS if p in ms and LEVELS[p] == 2
               and p not in shown]
    return " time ms: " + " | ".join(fields) + " |"
