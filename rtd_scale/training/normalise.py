"""Global-batch loss normalisation: the counts every micro-batch of a step divides its losses by
(DESIGN.md §3, "Losses are normalised over the global batch"; the rule itself:
``objectives/losses.py``).

The masks are a function of (seed, sample index), so a step knows, before any forward, how many
masked positions and non-pad tokens each of its micro-batches holds. ``global_counts`` sums them
over this rank's micro-batches and all-reduces the [2] sum once over the data-parallel group:
one small collective per step, kept on the device (no host sync). Every micro-batch then
divides its summed losses by count / (accumulation steps × DP size), which DeepSpeed's
accumulation and data-parallel averaging (or megatron-core's pipeline schedule and the same
averaging) undo exactly.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from rtd_scale.distributed import ParallelContext


def global_counts(model, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  ctx: ParallelContext) -> torch.Tensor:
    """(masked positions, non-pad tokens) of the global batch this rank's ``micro_batches`` are
    part of.

    Args:
        model: the ``RTDModel`` (its ``loss_counts`` masks as the forward will).
        micro_batches: this rank's micro-batches of the step, (input_ids [b, s],
            sample_index [b]) on ``ctx.device``.
        ctx: the parallel context; the sum runs over ``ctx.dp_group``. Collective over that
            group: every data-parallel peer calls it once per step.
    Returns:
        [2] int64 on ``ctx.device``, identical on every rank of the data-parallel group (and on
        tensor-parallel peers, which read the same samples).
    """
    counts = torch.stack([model.loss_counts(ids, idx) for ids, idx in micro_batches]).sum(0)
    if ctx.dp_size > 1:
        dist.all_reduce(counts, group=ctx.dp_group)
    return counts
