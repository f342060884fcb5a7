"""Global-batch loss normalisation: the counts every micro-batch of a step divides its losses by
(DESIGN.md §3, "Losses are normalised over the global batch"; the rule itself:
``objectives/losses.py``).

The masks are a function of (seed, sample index), so a step knows, before any forward, how many
masked positions and non-pad tokens each of its micro-batches holds: it masks each micro-batch
once, counts here, and hands the same masks to the forward. ``global_counts`` sums the counts
over this rank's micro-batches and all-reduces the [2] sum once over the data-parallel group:
one small collective per step, kept on the device (no host sync). Every micro-batch then
divides its summed losses by count / (accumulation steps × DP size), which DeepSpeed's
accumulation and data-parallel averaging (or megatron-core's pipeline schedule and the same
averaging) undo exactly.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from rtd_scale.distributed import ParallelContext
from rtd_scale.objectives.masking import MaskedBatch


def global_counts(model, micro_batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  ctx: ParallelContext,
                  masks: Optional[Sequence[MaskedBatch]] = None) -> torch.Tensor:
    """(masked positions, non-pad tokens) of the global batch this rank's ``micro_batches`` are
    part of.

    Args:
        model: the ``RTDModel`` (its ``loss_counts``).
        micro_batches: this rank's micro-batches of the step, (input_ids [b, s],
            sample_index [b]) on ``ctx.device``.
        masks: their masks, as the step computed them for the forward (``RTDModel.mask``);
            None: masked here as the forward will.
        ctx: the parallel context; the sum runs over ``ctx.dp_group``. Collective over that
            group: every data-parallel peer calls it once per step.
    Returns:
        [2] int64 on ``ctx.device``, identical on every rank of the data-parallel group (and on
        tensor-parallel peers, which read the same samples).
    """
    masks = masks if masks is not None else [None] * len(micro_batches)
    counts = torch.stack([model.loss_counts(ids, idx, m)
                          for (ids, idx), m in zip(micro_batches, masks)]).sum(0)
    if ctx.dp_size > 1:
        dist.all_reduce(counts, group=ctx.dp_group)
    return counts
