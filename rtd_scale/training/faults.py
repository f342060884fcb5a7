"""Test-only fault injection: a fault at a step and a rank, set by the environment.

``RTD_FAULTS`` holds comma-separated entries ``KIND@STEP[:RANK][!once]``:

- ``segv``: the rank dies of SIGSEGV (a native crash);
- ``kill``: SIGKILL (an out-of-memory kill, a lost node);
- ``exit=N``: ``os._exit(N)`` (a crash without a signal);
- ``stop``: SIGSTOP, the rank hangs (a stuck collective or driver) until it is continued or
  killed;
- ``sleep=SECONDS``: the rank sleeps that long before each of its steps from STEP on (a slow
  rank: a throttled GPU, a noisy neighbour);
- ``corrupt``: this rank's micro-batches of that step are replaced by a corrupted copy (every
  non-special token is mirrored in the vocabulary: text read with another tokenizer's ids,
  as a shard made with the wrong tokenizer would give);
- ``hold=SECONDS``: in the save after iteration STEP, the rank waits that long between its
  checkpoint files and the completion record (:func:`hold_in_save`): the moment a kill during
  a save hits, held open so that a test's kill lands in it however loaded the machine.

STEP is the 1-based iteration about to run (the one the log line will print); RANK a global
rank or ``*`` (every rank), rank 0 when left out. ``!once``: the fault fires the first time that
(step, rank) is reached and never again in the same ``--save`` directory (a marker file
``faults/fired-<entry>-rank<r>`` there), so a restarted run gets past it; without it a restart
from an earlier checkpoint meets it again (a crash loop).

Nothing happens when ``RTD_FAULTS`` is unset, which is every real run; the loop asks
:meth:`FaultPlan.before_step` once a step. The tests that inject faults:
tests/e2e/test_unattended.py and tests/unit/test_faults.py.
"""
from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

ENV = "RTD_FAULTS"
KINDS = ("segv", "kill", "exit", "stop", "sleep", "corrupt", "hold")
_WITH_ARG = ("exit", "sleep", "hold")
_ENTRY = re.compile(r"^(?P<kind>[a-z]+)(?:=(?P<arg>[0-9.]+))?@(?P<step>[0-9]+)"
                    r"(?::(?P<rank>[0-9]+|\*))?(?P<once>!once)?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # 1-based iteration
    rank: Optional[int]  # None: every rank
    arg: Optional[float] = None  # exit's status, sleep's seconds
    once: bool = False
    text: str = ""  # the entry as written (names the marker file)

    def hits(self, step: int, rank: int) -> bool:
        if self.rank is not None and self.rank != rank:
            return False
        return step >= self.step if self.kind == "sleep" else step == self.step


def parse(spec: str) -> list[Fault]:
    """The entries of ``spec`` (``RTD_FAULTS``'s value); a malformed entry raises ValueError
    naming it and the form."""
    faults = []
    for text in (s.strip() for s in spec.split(",")):
        if not text:
            continue
        m = _ENTRY.match(text)
        if not m or m["kind"] not in KINDS or (m["kind"] in _WITH_ARG) != bool(m["arg"]):
            raise ValueError(f"{ENV}: cannot read {text!r}; expected KIND@STEP[:RANK][!once] "
                             f"with KIND one of segv, kill, exit=N, stop, sleep=SECONDS, corrupt, "
                             "hold=SECONDS")
        rank = None if m["rank"] == "*" else int(m["rank"] or 0)
        faults.append(Fault(kind=m["kind"], step=int(m["step"]), rank=rank,
                            arg=float(m["arg"]) if m["arg"] else None, once=bool(m["once"]),
                            text=text))
    return faults


class FaultPlan:
    """The faults this rank will meet. ``marker_dir``: where ``!once`` faults record that they
    fired (the run's ``--save``; without one, ``!once`` faults fire every time)."""

    def __init__(self, faults: Sequence[Fault], rank: int, marker_dir: Optional[str] = None):
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.rank = rank
        self.marker_dir = os.path.join(marker_dir, "faults") if marker_dir else None

    @classmethod
    def from_env(cls, rank: int, marker_dir: Optional[str] = None,
                 environ: Optional[Mapping[str, str]] = None) -> "FaultPlan":
        spec = (os.environ if environ is None else environ).get(ENV, "")
        return cls(parse(spec) if spec else [], rank, marker_dir)

    @property
    def enabled(self) -> bool:
        return bool(self.faults)

    def _marker(self, fault: Fault) -> Optional[str]:
        if not (fault.once and self.marker_dir):
            return None
        name = re.sub(r"[^A-Za-z0-9=.@_-]", "_", fault.text)
        return os.path.join(self.marker_dir, f"fired-{name}-rank{self.rank}")

    def _due(self, fault: Fault, step: int) -> bool:
        if not fault.hits(step, self.rank):
            return False
        marker = self._marker(fault)
        if marker is None:
            return True
        if os.path.exists(marker):
            return False
        os.makedirs(self.marker_dir, exist_ok=True)
        with open(marker, "w") as f:  # written before the fault: a crash must not re-fire it
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def before_step(self, step: int, batches: list,
                    special_ids: Sequence[int] = (0, 1, 2, 3, 4)) -> list:
        """Fire what is due at iteration ``step`` (1-based) on this rank; returns the step's
        micro-batches, corrupted (:func:`corrupt`, keeping ``special_ids``) where a ``corrupt``
        fault says so."""
        for fault in self.faults:
            if fault.kind == "hold":  # in the save, not before a step (hold_in_save)
                continue
            if fault.kind == "sleep":
                if fault.hits(step, self.rank):
                    time.sleep(fault.arg)
                continue
            if not self._due(fault, step):
                continue
            print(f"[rtd-fault] rank {self.rank}: injecting {fault.text} at iteration {step}",
                  flush=True)
            if fault.kind == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            elif fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.kind == "exit":
                os._exit(int(fault.arg))
            elif fault.kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "corrupt":
                batches = [corrupt(mb, special_ids) for mb in batches]
        return batches


def hold_in_save(step: int, rank: int, environ: Optional[Mapping[str, str]] = None) -> None:
    """A ``hold`` fault of iteration ``step``'s save on this rank (module docstring): called by
    training/checkpoint/save.py after the checkpoint's files, before its completion record."""
    spec = (os.environ if environ is None else environ).get(ENV, "")
    for fault in parse(spec) if spec else []:
        if fault.kind == "hold" and fault.hits(step, rank):
            print(f"[rtd-fault] rank {rank}: injecting {fault.text} in the save of iteration "
                  f"{step}", flush=True)
            time.sleep(fault.arg)


def corrupt(mb, special_ids: Sequence[int] = (0, 1, 2, 3, 4)):
    """A copy of micro-batch ``mb`` whose every id outside ``special_ids`` (default: the [PAD]
    [CLS] [SEP] [UNK] [MASK] ids of tokenizers rtd_scale trains, ``data/tokenizer.py``) is
    mirrored within the range of such ids in it, lo + hi − id: the batch's text read with
    another vocabulary, as a shard made with the wrong tokenizer would give, with its shape,
    padding and sample indices. Frequent pieces (low ids: SentencePiece and BPE vocabularies
    are ordered by frequency) become rare ones, so the MLM loss jumps once the generator knows
    the unigram distribution. (One id repeated is no spike: a tied MLM head predicts the token
    its context is made of; uniform random ids barely beat ln V early in training.)"""
    import dataclasses

    import torch

    ids = mb.input_ids.clone()
    specials = torch.tensor(list(special_ids), dtype=ids.dtype)
    real = ~torch.isin(ids, specials)
    if real.any():
        lo, hi = int(ids[real].min()), int(ids[real].max())
        mirrored = lo + hi - ids[real]
        ids[real] = torch.where(torch.isin(mirrored, specials), hi, mirrored)  # specials stay
    return dataclasses.replace(mb, input_ids=ids, sample_index=mb.sample_index.clone())
