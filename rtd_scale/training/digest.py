"""``--data-digest FILE``: an audit log of what every optimizer step read and computed.

One JSON line per step (appended by the logging rank; every data-parallel rank of the last
pipeline stage at tensor rank 0 contributes through one ``all_gather_object`` over the
data-parallel group, so it costs a host sync per step — an audit tool, off by default):

    {"step": 7, "consumed_samples": 96,            # samples consumed before this step
     "sample_index": [96, …, 111],                 # global sample indices, global-batch order
     "samples": [[0, 417], …],                     # (dataset, packed sample) each index read
     "inputs_sha256": "…",                         # input_ids [G, s] int64, global-batch order
     "masks_sha256": "…",                          # the generator's masked positions [G, s] bool
     "losses": [["0x1.2p+3", "0x1.6p-1"], …]}      # float.hex of (L_MLM, L_RTD) per micro-batch

Two runs read the same samples with the same masks and losses iff their lines are equal; the
hex floats make loss equality bitwise (tests/e2e/test_pretrain_launcher.py compares a resumed
run's lines with an uninterrupted one's).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch.distributed as dist

if TYPE_CHECKING:
    from rtd_scale.data.packed import MicroBatch
    from rtd_scale.distributed import ParallelContext
    from rtd_scale.model.rtd import RTDOutput


class DataDigest:
    """Collects one step's micro-batches and outputs, then writes the step's line.

    Args:
        path: the jsonl file (``None``: do nothing).
        ctx: this rank's place; ranks other than the last stage's tensor rank 0 only watch.
    """

    def __init__(self, path: Optional[str], ctx: "ParallelContext"):
        self.ctx = ctx
        self.enabled = path is not None
        self.contributes = self.enabled and ctx.is_last_stage and ctx.tp_rank == 0
        self.path = path if self.enabled and ctx.is_logging_rank else None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._rows: list[tuple] = []

    def add(self, batches: Sequence["MicroBatch"], outputs: Sequence["RTDOutput"]) -> None:
        """This rank's micro-batches of the step and their outputs (in the same order)."""
        if not self.contributes:
            return
        for mb, out in zip(batches, outputs):
            self._rows.append((mb.sample_index.cpu().numpy(), mb.input_ids.cpu().numpy(),
                               out.masked.cpu().numpy(), float(out.mlm_loss.detach().float()),
                               float(out.rtd_loss.detach().float())))

    def write(self, step: int, consumed_before: int, locate) -> None:
        """Gather the step's rows over data-parallel ranks; the logging rank appends the line.
        ``locate(k)`` maps global sample indices to (dataset, sample) arrays."""
        if not self.contributes:
            return
        rows, self._rows = self._rows, []
        parts = [rows]
        if dist.is_initialized() and self.ctx.dp_size > 1:
            parts = [None] * self.ctx.dp_size
            dist.all_gather_object(parts, rows, group=self.ctx.dp_group)
        if not self.path:
            return
        rows = [r for part in parts for r in part]  # rank order = global-batch order
        k = np.concatenate([r[0] for r in rows])
        d, sample = locate(k)
        line = {
            "step": step, "consumed_samples": consumed_before,
            "sample_index": k.tolist(),
            "samples": np.stack([d, sample], axis=1).tolist(),
            "inputs_sha256": _sha(np.concatenate([r[1] for r in rows]).astype(np.int64)),
            "masks_sha256": _sha(np.packbits(np.concatenate([r[2] for r in rows]))),
            "losses": [[r[3].hex(), r[4].hex()] for r in rows],
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def read(path: str) -> dict[int, dict]:
    """The digest lines of ``path`` by step (tests, audits)."""
    with open(path, encoding="utf-8") as f:
        return {row["step"]: row for row in map(json.loads, f)}
