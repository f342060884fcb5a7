"""Stragglers named: each rank's own work per step against the median rank's, every log interval.

In synchronous training a slow rank makes every rank slow: the others wait for it inside the
step's collectives, so step times are equal and say nothing about who is late. What differs is
when each rank arrives at the step's first collective. The ranks leave the previous step's last
collective together (the stop-request all-reduce, ``signals.StopRequest.agreed``), then each
reads its micro-batches and does its host work alone; the meter takes the time from the top of
the step to the moment the rank is ready to compute (``ready``), ``arrive``. A rank that arrives
later than the latest of the others kept them waiting for the difference; a rank that arrives
earlier waited for the latest: its own work is the step time less that wait,

    own_r = step − (max_q arrive_q − arrive_r),   relative speed_r = median_{q≠r} own_q / own_r,

and a rank whose relative speed is below ``--straggler-threshold`` (0.7: Megatron-LM's
StragglerDetector and NVIDIA's resiliency extension report ranks below 0.7 of their peers) is
named in the log line (`` stragglers (< 0.70 of the median peer): rank 3 0.41 |``), in
TensorBoard (``stragglers/count``, ``stragglers/slowest_rank``,
``stragglers/slowest_relative_speed``, ``stragglers/max_data_wait_ms``) and in the end-of-run
summary. What it sees: a slow loader, a stalled host, a rank sleeping before its step (the fault
hook's ``sleep``). What it cannot see on its own: a device that computes slowly between
collectives (its lateness is spread over the step's collectives); NVIDIA's resiliency extension
times CUDA kernels with CUPTI for that.

Cost: three ``time.perf_counter`` reads a step on the host; at the log interval one all-gather
of two floats per rank (over the host group: gloo).
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

TAGS = ("stragglers/count", "stragglers/slowest_rank", "stragglers/slowest_relative_speed",
        "stragglers/max_data_wait_ms")


def relative_speeds(step_ms: float, arrive_ms: list[float]) -> list[float]:
    """Each rank's speed relative to the median of its peers (1: as fast; below: slower), from
    the interval's mean step time and each rank's mean arrival at its first collective."""
    latest = max(arrive_ms)
    own = [max(step_ms - (latest - a), 1e-6) for a in arrive_ms]
    if len(own) == 1:
        return [1.0]
    return [statistics.median(own[:r] + own[r + 1:]) / o for r, o in enumerate(own)]


def named(speeds: list[float], threshold: float) -> list[tuple[int, float]]:
    """(rank, speed) of the ranks below ``threshold``, slowest first."""
    if threshold <= 0:
        return []
    return sorted(((r, s) for r, s in enumerate(speeds) if s < threshold), key=lambda x: x[1])


def format_fields(slow: list[tuple[int, float]], threshold: float) -> str:
    """The log line's field ('' when no rank is named)."""
    if not slow:
        return ""
    shown = ", ".join(f"rank {r} {s:.2f}" for r, s in slow[:8])
    more = f" and {len(slow) - 8} more" if len(slow) > 8 else ""
    return f" stragglers (< {threshold:.2f} of the median peer): {shown}{more} |"


class StragglerMeter:
    """Marks each step on this rank (``step_start``, ``data_done``, ``ready``); ``gather`` at
    the log interval (collective over ``group``: every rank calls it) gives the scalars and
    the named ranks, and keeps a tally for the summary."""

    def __init__(self, threshold: float, group=None, clock=time.perf_counter):
        self.threshold, self.group, self.clock = threshold, group, clock
        self.tally: dict[int, list[float]] = {}  # rank → relative speeds when named
        self.intervals = 0
        self._reset()
        self._t0 = self._t_data = None

    def _reset(self) -> None:
        self.steps = 0
        self.arrive_s = 0.0
        self.data_s = 0.0

    def step_start(self) -> None:
        self._t0 = self.clock()

    def data_done(self) -> None:
        self._t_data = self.clock()

    def ready(self) -> None:
        now = self.clock()
        if self._t0 is None:
            return
        self.steps += 1
        self.arrive_s += now - self._t0
        self.data_s += (self._t_data or now) - self._t0

    def gather(self, step_ms: float, scalars: dict[str, float]) -> str:
        """Adds the interval's ``stragglers/*`` to ``scalars``; returns the log line's field
        (``format_fields``; '' when no rank is named). ``step_ms``: the interval's milliseconds
        per iteration. Collective: every rank calls it."""
        n = max(self.steps, 1)
        mine = torch.tensor([1000.0 * self.arrive_s / n, 1000.0 * self.data_s / n],
                            dtype=torch.float64)
        self._reset()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
            dist.all_gather(rows, mine, group=self.group)
        else:
            rows = [mine]
        arrive = [float(r[0]) for r in rows]
        data = [float(r[1]) for r in rows]
        speeds = relative_speeds(step_ms, arrive)
        slow = named(speeds, self.threshold)
        self.intervals += 1
        for r, s in slow:
            self.tally.setdefault(r, []).append(s)
        slowest = min(range(len(speeds)), key=speeds.__getitem__)
        scalars.update({"stragglers/count": float(len(slow)),
                        "stragglers/slowest_rank": float(slowest),
                        "stragglers/slowest_relative_speed": speeds[slowest],
                        "stragglers/max_data_wait_ms": max(data)})
        return format_fields(slow, self.threshold)

    def summary(self) -> Optional[dict]:
        """What the end-of-run summary says: the threshold, intervals and each named rank's
        count and lowest speed; None when nothing was measured."""
        if not self.intervals:
            return None
        return {"threshold": self.threshold, "intervals": self.intervals,
                "ranks": {r: (len(v), min(v)) for r, v in sorted(self.tally.items())}}


def summary_line(info: Optional[dict]) -> Optional[str]:
    """The end-of-run summary's line about stragglers."""
    if not info:
        return None
    head = f"  stragglers (own work below {info['threshold']:.2f} of the median peer's): "
    if not info["ranks"]:
        return head + f"none in {info['intervals']} log intervals"
    parts = [f"rank {r} in {n} of {info['intervals']} log intervals (lowest {low:.2f})"
             for r, (n, low) in list(info["ranks"].items())[:8]]
    return head + "; ".join(parts)
