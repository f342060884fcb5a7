"""Loss spikes: found against the recent window without a host sync per step, and what a
rollback skips.

The rule (``SpikeRule``; ``--loss-spike-*``, ``config.TrainConfig``). For each of L_MLM, L_RTD
and the global gradient norm, the window is its value at the last ``window`` iterations that
were not spikes. With m the median of the window's logarithms and s = 1.4826 × their median
absolute deviation (a robust standard deviation: s = σ for normal noise), a value x crosses its
limit when

    ln x − m > max(Z · s, ln(1 + min_rise))

i.e. x is more than Z robust standard deviations above the median *and* more than
``min_rise`` above it (the second clause keeps a very smooth window from making a 2% bump a
spike). On three ordinary runs, every iteration (tests/data/loss_curves.json: the tiny and
debertav3-tiny presets and a known-answer run), the highest robust z of a loss against its
window was 4.4 at window 20, 3.3 at 50 and 2.3 at 100 (Z = 6 by default), and the highest
ratio to the median 1.37 (the known-answer run's end, where L_MLM ≈ 0.6 wiggles by a third and
the z clause keeps the limit above it); text read with another tokenizer's ids in half a
global batch (``training/faults.py``) raised the tiny preset's L_MLM to 1.22 × its
20-iteration median (limit 1.15 ×). The logarithm makes the rule scale-free: a loss of 2 and
one of 9 get the same relative limit. The rule arms once the window is full.

A *spike* is an iteration whose L_MLM or L_RTD crosses its limit; the gradient norm, whose
clipped jumps are common and harmless on their own (OLMo 2, arXiv 2501.00656 §3.2, counts them
separately), never triggers one, but a run of iterations just before a spike whose gradient
norm crossed its limit belongs to it: a bad batch can pass with an ordinary loss and damage the
next iteration's. ``SpikeRule.observe`` leaves spikes out of the window, so one spike does not
widen the limit for the next.

Cost (``SpikeMonitor``): each iteration adds its micro-batches' L_MLM and L_RTD (device
tensors) and the gradient norm (DeepSpeed's host float under ZeRO 1–3 and its bf16/fp16
optimizers; ``NonFiniteSkippingAdamW``'s device value at ZeRO stage 0 in fp32) to a device
buffer: no host sync. ``check`` — at the log interval and before a save, where the loop already
reads the device — all-reduces the buffer once over every rank (so every rank takes the same
decision) and reads it. A spike is thus seen at most ``--log-interval`` iterations late.

What a rollback skips: the samples of the spiking iterations ([first sample of the first, one
past the last sample of the last), global sample indices, ``data/loader.py``'s skipped ranges),
kept with the rollback count and the window in every later checkpoint's client state under
:data:`CLIENT_KEY`, so a resume at any layout or global batch skips them too and detects as
the uninterrupted run would.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from rtd_scale.cli_errors import UserInputError
from rtd_scale.data.loader import merge_ranges

CLIENT_KEY = "loss_spikes"  # the checkpoint client state's field (``SpikeState.to_client``)
QUANTITIES = ("mlm loss", "rtd loss", "grad norm")
TRIGGERS = (0, 1)  # indices into QUANTITIES that make a spike: the losses
ROBUST_SD = 1.4826  # σ / median absolute deviation for normal noise


class LossSpikeRollbacksError(UserInputError):
    """The run stopped: a spike came after ``--max-loss-spike-rollbacks`` rollbacks."""


@dataclass(frozen=True)
class Crossing:
    """One iteration's values that crossed their limits: ``over`` maps a quantity's index in
    :data:`QUANTITIES` to (value, the window's median, the limit)."""

    step: int
    over: dict[int, tuple[float, float, float]]

    @property
    def is_spike(self) -> bool:
        return any(q in self.over for q in TRIGGERS)

    def describe(self) -> str:
        """e.g. ``mlm loss 6.673E+00 = 1.18 × its median (limit 1.15 ×)``, worst first."""
        parts = sorted(self.over.items(), key=lambda kv: -kv[1][0] / kv[1][1])
        return ", ".join(f"{QUANTITIES[q]} {x:.3E} = {x / m:.2f} × its median (limit "
                         f"{lim / m:.2f} ×)" for q, (x, m, lim) in parts)


class SpikeRule:
    """The rule of the module docstring over a stream of iterations; pure host arithmetic.

    ``observe(step, values)`` takes one iteration's (L_MLM, L_RTD, gradient norm) — NaN where
    one is unknown or not finite, which then neither crosses nor enters the window — and
    returns its :class:`Crossing` (None when nothing crossed). A value that crossed its limit
    stays out of its window; a spike keeps all three out.
    """

    def __init__(self, window: int, threshold: float, min_rise: float,
                 history: Sequence[Sequence[float]] = ()):
        self.window, self.threshold, self.min_rise = window, threshold, min_rise
        self.history: deque[tuple[int, tuple[float, ...]]] = deque(
            ((int(h[0]), tuple(float(v) for v in h[1:])) for h in history), maxlen=window)

    @property
    def armed(self) -> bool:
        return len(self.history) == self.window

    def limits(self) -> list[Optional[tuple[float, float]]]:
        """Per quantity (the window's median, the limit), or None (not armed, no values)."""
        if not self.armed:
            return [None] * len(QUANTITIES)
        logs = np.log(np.array([v for _, v in self.history], dtype=np.float64))
        out: list[Optional[tuple[float, float]]] = []
        for q in range(len(QUANTITIES)):
            col = logs[:, q][np.isfinite(logs[:, q])]
            if len(col) < max(3, self.window // 2):
                out.append(None)
                continue
            m = float(np.median(col))
            s = ROBUST_SD * float(np.median(np.abs(col - m)))
            rise = max(self.threshold * s, math.log1p(self.min_rise))
            out.append((math.exp(m), math.exp(m + rise)))
        return out

    def observe(self, step: int, values: Sequence[float]) -> Optional[Crossing]:
        over = {}
        for q, (lim, x) in enumerate(zip(self.limits(), values)):
            if lim is not None and math.isfinite(x) and x > lim[1]:
                over[q] = (float(x), lim[0], lim[1])
        crossing = Crossing(step, over) if over else None
        if crossing is None or not crossing.is_spike:
            kept = tuple(float("nan") if q in over else float(x) for q, x in enumerate(values))
            self.history.append((step, kept))
        return crossing

    def forget_after(self, step: int) -> None:
        """Drop the window's iterations after ``step`` (a rollback to ``step``)."""
        while self.history and self.history[-1][0] > step:
            self.history.pop()

    def state(self) -> list[list[float]]:
        return [[s, *v] for s, v in self.history]


@dataclass
class SpikeState:
    """What the run keeps across checkpoints: the skipped ranges of global sample indices, the
    rollbacks so far, and the rule's window (``[step, L_MLM, L_RTD, grad norm]`` rows)."""

    skipped: list[tuple[int, int]] = field(default_factory=list)
    rollbacks: int = 0
    window: list[list[float]] = field(default_factory=list)

    @classmethod
    def from_client(cls, client: Optional[dict[str, Any]]) -> "SpikeState":
        """From a checkpoint's client state (an empty state when it has no :data:`CLIENT_KEY`,
        e.g. one saved before spikes were detected)."""
        got = (client or {}).get(CLIENT_KEY) or {}
        return cls(skipped=merge_ranges(got.get("skipped_samples", [])),
                   rollbacks=int(got.get("rollbacks", 0)),
                   window=[list(map(float, row)) for row in got.get("window", [])])

    def to_client(self) -> dict[str, Any]:
        # JSON-friendly (DeepSpeed pickles the client state; rtd_meta.json shows nothing of it)
        return {"skipped_samples": [[int(a), int(b)] for a, b in merge_ranges(self.skipped)],
                "rollbacks": int(self.rollbacks), "window": [list(r) for r in self.window]}


@dataclass(frozen=True)
class Spike:
    """A spike seen by ``SpikeMonitor.check``: its first and last iteration (with the
    gradient-norm crossings just before it), the samples they read ([start, end) global
    indices) and the crossings, for the log line."""

    first_step: int
    last_step: int
    samples: tuple[int, int]
    crossings: tuple[Crossing, ...]

    @property
    def ratio(self) -> float:
        """The largest loss over its window's median among the spike's iterations."""
        return max(x / m for c in self.crossings for q, (x, m, _) in c.over.items()
                   if q in TRIGGERS)

    def describe(self) -> str:
        steps = (f"iteration {self.first_step}" if self.first_step == self.last_step
                 else f"iterations {self.first_step}–{self.last_step}")
        return f"{steps} ({'; '.join(f'{c.step}: {c.describe()}' for c in self.crossings)})"


class SpikeMonitor:
    """Records each iteration on the device and applies the rule at ``check`` (module
    docstring). Collective at ``check``: every rank calls it at the same iterations.

    Args:
        rule: the rule, with the window to start from.
        device: where the buffer lives (the ranks' collective device).
        loss_rank: whether this rank's losses count (the last pipeline stage's first
            tensor-parallel rank, every data-parallel rank: their sum over micro-batches and
            ranks / their number is the iteration's loss, ``metrics.MetricAccumulator``).
        norm_rank: whether this rank adds its gradient norm: global rank 0 when the norm is
            global (DeepSpeed's), every rank of the first data-parallel replica when it is the
            rank's own (``NonFiniteSkippingAdamW``: squares summed over the model-parallel
            ranks, a parameter replicated over tensor-parallel ranks counted on each).
    """

    def __init__(self, rule: SpikeRule, device: torch.device, *, loss_rank: bool,
                 norm_rank: bool):
        self.rule, self.device = rule, device
        self.loss_rank, self.norm_rank = loss_rank, norm_rank
        self.rows = torch.zeros(16, 4, dtype=torch.float64, device=device)
        self.pending: list[tuple[int, int, int]] = []  # (step, first sample, one past the last)

    def record(self, step: int, outs: Sequence, grad_norm, samples: tuple[int, int]) -> None:
        """Iteration ``step``'s losses (``outs``: its RTDOutputs on this rank), gradient norm
        (a float, a 0-d tensor on any device, or None) and its samples' [start, end); no host
        sync."""
        i = len(self.pending)
        if i == len(self.rows):
            self.rows = torch.cat([self.rows, torch.zeros_like(self.rows)])
        row = self.rows[i]
        row.zero_()
        if self.loss_rank and outs:
            row[:2] = torch.stack([torch.stack([o.mlm_loss.detach() for o in outs]).sum(),
                                   torch.stack([o.rtd_loss.detach() for o in outs]).sum()]
                                  ).to(torch.float64)
            row[2] = float(len(outs))
        if self.norm_rank:
            if grad_norm is None:
                row[3] = float("nan")
            elif isinstance(grad_norm, torch.Tensor):
                row[3:4].copy_(grad_norm.detach().reshape(1).to(torch.float64).pow(2),
                               non_blocking=True)
            else:
                row[3] = float(grad_norm) ** 2
        self.pending.append((step, *samples))

    def check(self) -> list[Spike]:
        """Apply the rule to the iterations recorded since the last call (one all-reduce over
        every rank, one host read). Returns the spikes, oldest first: each a run of consecutive
        iterations that crossed a limit, from its first to its last loss spike
        (:func:`_spike_of`)."""
        n = len(self.pending)
        if n == 0:
            return []
        block = self.rows[:n].clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(block)
        values = block.tolist()
        pending, self.pending = self.pending, []
        spikes: list[Spike] = []
        run: list[tuple[Crossing, int, int]] = []  # consecutive crossings, with their samples
        for (step, start, end), (mlm, rtd, counted, norm_sq) in zip(pending, values):
            loss = (mlm / counted, rtd / counted) if counted > 0 else (math.nan, math.nan)
            norm = math.sqrt(norm_sq) if norm_sq >= 0 else math.nan
            crossing = self.rule.observe(step, (*loss, norm))
            if crossing is not None:
                run.append((crossing, start, end))
            else:
                spikes += _spike_of(run)
                run = []
        return spikes + _spike_of(run)

    def forget_after(self, step: int) -> None:
        """A rollback to ``step``: the window loses later iterations, nothing is pending."""
        self.rule.forget_after(step)
        self.pending = []


def _spike_of(run: Sequence[tuple[Crossing, int, int]]) -> list[Spike]:
    """The spike in a run of consecutive crossings (each with its samples' [start, end)), or
    none: from the run's first iteration — gradient-norm crossings before a loss spike belong
    to it — to its last loss spike (crossings after it are the damage, not its cause)."""
    last = max((i for i, (c, _, _) in enumerate(run) if c.is_spike), default=None)
    if last is None:
        return []
    kept = run[:last + 1]
    return [Spike(first_step=kept[0][0].step, last_step=kept[-1][0].step,
                  samples=(kept[0][1], kept[-1][2]), crossings=tuple(c for c, _, _ in kept))]
