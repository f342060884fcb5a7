"""The RTD step at pipeline_model_parallel_size 1 (its pipeline-parallel counterpart:
``training/pipeline.py``).

One optimizer step over this rank's gradient-accumulation micro-batches:

0. every micro-batch is copied to the device (``micro_batch_kwargs``: no wait on the host) and
   masked, once (``RTDModel.mask``); the masked positions and non-pad tokens of the global batch
   are counted from those masks (``training/normalise.py``: this rank's micro-batches, one
   all-reduce over the data-parallel group), so that the update does not depend on micro-batch
   size × accumulation × DP;
1. per micro-batch, the engine's forward on its masks (``RTDModel.forward``: generator →
   sample → discriminator → L_MLM + rtd_lambda · L_RTD, normalised by those counts), then
   ``engine.backward`` and ``engine.step`` — DeepSpeed accumulates, and updates (stepping the
   learning-rate schedule) at the last micro-batch only.

``eval_step`` is step 0 and the forwards alone (validation), as ``pipeline_forward`` is for
the pipeline-parallel step.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from rtd_scale.data.packed import MicroBatch
from rtd_scale.distributed import ParallelContext
from rtd_scale.model.rtd import RTDOutput
from rtd_scale.phases import (PHASE_BACKWARD, PHASE_DATA_WAIT, PHASE_FORWARD, PHASE_MASK,
                              PHASE_OPTIMIZER_STEP)
from rtd_scale.training.normalise import global_counts
from rtd_scale.training.timers import NO_TIMERS, timed_parts


def micro_batch_kwargs(mb: MicroBatch, device: torch.device, pad_id: int) -> dict:
    """A host micro-batch as the model's keyword arguments on ``device``: copies that do not
    wait (from the loader's pinned memory on CUDA), and ``has_padding`` decided on the host, so
    that a micro-batch without [PAD] runs attention without a mask and nothing waits for the
    device. Its document ids go along under document-masked packing."""
    non_blocking = device.type == "cuda"
    kwargs = dict(input_ids=mb.input_ids.to(device, non_blocking=non_blocking),
                  sample_index=mb.sample_index.to(device, non_blocking=non_blocking),
                  has_padding=bool((mb.input_ids == pad_id).any()))
    if mb.document_ids is not None:
        kwargs["document_ids"] = mb.document_ids.to(device, non_blocking=non_blocking)
    return kwargs


def masked_micro_batches(engine, kwargs: Sequence[dict], ctx: ParallelContext,
                         timers=NO_TIMERS) -> tuple[list[dict], torch.Tensor]:
    """Step 0's second half: each micro-batch's masks, computed once (``RTDModel.mask``), and
    the global batch's counts taken from them. Returns the forward's keyword arguments with
    ``masks`` added, and the [2] counts (collective over ``ctx.dp_group``)."""
    model = engine.module
    with timers(PHASE_MASK):
        masks = [model.mask(k["input_ids"], k["sample_index"]) for k in kwargs]
    pairs = [(k["input_ids"], k["sample_index"]) for k in kwargs]
    counts = global_counts(model, pairs, ctx, masks=masks)
    return [dict(k, masks=m) for k, m in zip(kwargs, masks)], counts


def train_step(engine, micro_batches: Sequence[MicroBatch], *, step: int, ctx: ParallelContext,
               gate: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
               before_update: Optional[Callable[[], None]] = None,
               timers=NO_TIMERS) -> list[RTDOutput]:
    """One optimizer step at pipeline_model_parallel_size 1 (steps 0–1 above) over
    ``micro_batches`` (this rank's gradient-accumulation micro-batches of the step).

    ``gate``: applied to each loss before backward (``loop.NonFiniteGuard.gate``).
    ``before_update``: called after the last backward, before the step that updates (reads the
    gradients). ``timers``: the step's phases (``training/timers.py``), the forward's parts
    by hooks on the model for the step's length (``timed_parts``). Returns one RTDOutput per
    micro-batch.
    """
    # DeepSpeed divides each loss by its accumulation steps: the normaliser counts on it
    assert engine.gradient_accumulation_steps() == len(micro_batches), \
        (engine.gradient_accumulation_steps(), len(micro_batches))
    with timers(PHASE_DATA_WAIT):
        kwargs = [micro_batch_kwargs(mb, ctx.device, engine.module.pad_id)
                  for mb in micro_batches]
    with timers(PHASE_FORWARD):
        kwargs, counts = masked_micro_batches(engine, kwargs, ctx, timers)
    outs = []
    for j, kw in enumerate(kwargs):
        with timers(PHASE_FORWARD), timed_parts(engine.module, timers):
            out = engine(**kw, step=step, global_counts=counts,
                         num_micro_batches=len(kwargs) * ctx.dp_size)
        with timers(PHASE_BACKWARD):
            engine.backward(out.loss if gate is None else gate(out.loss))
        with timers(PHASE_OPTIMIZER_STEP):
            if before_update is not None and j == len(kwargs) - 1:
                before_update()
            engine.step()
        outs.append(out)
    return outs


def eval_step(engine, micro_batches: Sequence[MicroBatch], *, step: int,
              ctx: ParallelContext) -> list[RTDOutput]:
    """The forwards of ``train_step`` alone (validation; the caller sets eval mode and
    ``torch.no_grad``): one RTDOutput per micro-batch, normalised over the global batch."""
    kwargs = [micro_batch_kwargs(mb, ctx.device, engine.module.pad_id) for mb in micro_batches]
    kwargs, counts = masked_micro_batches(engine, kwargs, ctx)
    return [engine(**k, step=step, global_counts=counts,
                   num_micro_batches=len(kwargs) * ctx.dp_size) for k in kwargs]
