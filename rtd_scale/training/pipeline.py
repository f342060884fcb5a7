"""The RTD step under pipeline parallelism (DESIGN.md §3, "Pipeline parallelism").

One optimizer step is two passes of megatron-core's non-interleaved 1F1B schedule over the same
micro-batches, then one optimizer step:

0. the first and the last stage mask each micro-batch, once (``RTDModel.mask``: stage 0 needs
   the generator's input, the last stage the masked positions); the last stage counts the
   masked positions and non-pad tokens of the global batch from those masks
   (``training/normalise.py``: its micro-batches' counts, one all-reduce over the data-parallel
   group), so each micro-batch's losses are its sums / (count / (num_microbatches × DP)) —
   the global-batch normalisation of ``objectives/losses.py``;
1. generator pass — stage 0 embeds its masked input, every stage runs its generator layers, the last
   stage computes L_MLM at the masked positions and samples the replacements (no gradient);
   the schedule back-propagates L_MLM / num_microbatches (megatron-core's two-value
   ``loss_func`` rule), and the data-parallel average divides by DP: together the gradient of
   the summed CE / the global batch's masked positions;
2. the corrupted ids of every micro-batch go from the last stage to stage 0 (one broadcast over
   the pipeline group, [num_microbatches, b, s] int64);
3. discriminator pass — stage 0 embeds the corrupted ids, the last stage computes the model's
   loss L_MLM + rtd_lambda · L_RTD with L_MLM detached (step 1 back-propagated it), so the
   schedule back-propagates rtd_lambda · L_RTD / num_microbatches;
4. the two copies of the generator's table (stage 0's input table, the last stage's MLM output
   weight) get the sum of their gradients through megatron-core's embedding group, so they stay
   equal (Megatron-LM's tied embeddings); under disentangled attention every stage's copy of
   each encoder's relative table (and its norm) gets the sum over the pipeline group, likewise;
   then ``engine.step()`` reduces over the data-parallel group (ZeRO-1) and steps.

The schedule is handed the raw modules (``engine.module``'s encoders), so DeepSpeed's
per-micro-batch hooks never run and gradients accumulate in ``param.grad`` (measured to match
PP = 1; see tests/multiproc/test_pipeline_parallel.py).

Under ``rtd.objective=mlm`` (``RTDModel.masked_lm_only``) the step is pass 1 alone, its loss
L_MLM (``RTDModel.masked_lm_head``): no sampling, no hand-over, no discriminator pass.

Validation (``pipeline_forward``) runs the same two passes with ``forward_only=True`` under
``torch.no_grad()``: no backward, no gradients, no optimizer step.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_without_interleaving,
)

from rtd_scale.data.packed import MicroBatch
from rtd_scale.distributed import ParallelContext
from rtd_scale.model.rtd import GeneratorResult, RTDModel, RTDOutput
from rtd_scale.objectives.losses import micro_batch_normaliser
from rtd_scale.objectives.masking import MaskedBatch
from rtd_scale.phases import (PHASE_MASK, PHASE_OPTIMIZER_STEP,
                              PHASE_PIPELINE_DISCRIMINATOR_PASS, PHASE_PIPELINE_GENERATOR_PASS,
                              PHASE_PIPELINE_ID_HANDOVER, PHASE_PIPELINE_TIED_GRADIENTS)
from rtd_scale.training.normalise import global_counts
from rtd_scale.training.timers import NO_TIMERS, timed_parts


def _attention_pad(mb: MicroBatch, pad: torch.Tensor, pad_id: int) -> Optional[torch.Tensor]:
    """``pad`` [b, s] for attention, or None when the micro-batch holds no [PAD] — decided on
    the host copy of the ids (no device sync), so SDPA runs unmasked (its flash kernel on GPU),
    as in the one-stage step (``RTDModel.forward``'s ``has_padding``)."""
    return pad if bool((mb.input_ids == pad_id).any()) else None


def _schedule(encoder, forward_step, micro_batches: Sequence[MicroBatch], seq_length: int,
              forward_only: bool):
    forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step, data_iterator=iter(enumerate(micro_batches)),
        model=[encoder], num_microbatches=len(micro_batches), seq_length=seq_length,
        micro_batch_size=micro_batches[0].input_ids.shape[0], forward_only=forward_only)


def pipeline_forward_backward(model: RTDModel, micro_batches: Sequence[MicroBatch], *,
                              step: int, ctx: ParallelContext,
                              forward_only: bool = False,
                              timers=NO_TIMERS) -> list[RTDOutput]:
    """Steps 0–3 above: the global batch's counts, both passes, forward and (unless
    ``forward_only``) backward, over ``micro_batches`` (this rank's micro-batches of the step;
    collective over the last stage's data-parallel group). ``timers``: the masking, each pass
    and the hand-over (``training/timers.py``), the model's parts by hooks for the passes'
    length (``timed_parts``).

    Returns one RTDOutput per micro-batch on the last stage (losses detached), [] elsewhere.
    """
    n = len(micro_batches)
    seq_length = micro_batches[0].input_ids.shape[1]
    dev = ctx.device
    gen_results: list[GeneratorResult | None] = [None] * n
    device_ids = [(mb.input_ids.to(dev), mb.sample_index.to(dev)) for mb in micro_batches]
    # document-masked packing: every stage masks attention, stage 0 also restarts positions
    documents = [None if mb.document_ids is None else mb.document_ids.to(dev)
                 for mb in micro_batches]
    masks: list[MaskedBatch | None] = [None] * n
    normaliser = None
    with timers(PHASE_PIPELINE_GENERATOR_PASS):  # 0. (a middle stage reads no mask)
        if model.pre_process or model.post_process:
            with timers(PHASE_MASK):
                masks = [model.mask(ids, idx) for ids, idx in device_ids]
        if ctx.is_last_stage:  # its data-parallel group is the last stage's ranks
            counts = global_counts(model, device_ids, ctx, masks=masks)
            normaliser = micro_batch_normaliser(counts, n * ctx.dp_size)

    def generator_step(data_iterator, encoder):
        j, mb = next(data_iterator)
        (ids, idx), m = device_ids[j], masks[j]
        pad = ids == model.pad_id
        hidden = encoder(None if m is None else m.generator_input,  # None: a later stage
                         _attention_pad(mb, pad, model.pad_id), documents[j])

        def loss_func(output):
            if model.masked_lm_only:
                out = model.masked_lm_head(output, ids, m.masked, pad, normaliser)
                outputs[j] = out._replace(loss=out.loss.detach(),
                                          mlm_loss=out.mlm_loss.detach())
                return out.loss.clone(), {}  # the schedule divides it in place
            gen = model.generator_head(output, ids, idx, m.masked, step, normaliser)
            gen_results[j] = gen
            return gen.mlm_loss.clone(), {}  # the schedule divides it in place

        return hidden, loss_func

    outputs: list[RTDOutput | None] = [None] * n
    with timers(PHASE_PIPELINE_GENERATOR_PASS), timed_parts(model, timers):
        _schedule(model.generator, generator_step, micro_batches, seq_length, forward_only)
    if model.masked_lm_only:
        return [o for o in outputs if o is not None]

    # 2. corrupted ids: last stage -> every stage of this pipeline (stage 0 needs them)
    with timers(PHASE_PIPELINE_ID_HANDOVER):
        corrupted = torch.empty(n, *micro_batches[0].input_ids.shape, dtype=torch.int64,
                                device=dev)
        if ctx.is_last_stage:
            corrupted.copy_(torch.stack([g.corrupted_ids for g in gen_results]))
        if ctx.pp_size > 1:
            dist.broadcast(corrupted, src=ctx.last_stage_global_rank, group=ctx.pp_group)

    def discriminator_step(data_iterator, encoder):
        j, mb = next(data_iterator)
        ids = device_ids[j][0]
        pad = ids == model.pad_id
        hidden = encoder(corrupted[j], _attention_pad(mb, pad, model.pad_id), documents[j])

        def loss_func(output):
            # the model's L_MLM + rtd_lambda · L_RTD, L_MLM detached: the generator pass
            # back-propagated it already, so this pass back-propagates rtd_lambda · L_RTD
            gen = gen_results[j]._replace(mlm_loss=gen_results[j].mlm_loss.detach())
            out = model.discriminator_head(output, gen, pad, normaliser)
            outputs[j] = out._replace(loss=out.loss.detach(), rtd_loss=out.rtd_loss.detach())
            return out.loss.clone(), {}  # the schedule divides it in place

        return hidden, loss_func

    with timers(PHASE_PIPELINE_DISCRIMINATOR_PASS), timed_parts(model, timers):
        _schedule(model.discriminator, discriminator_step, micro_batches, seq_length,
                  forward_only)
    return [o for o in outputs if o is not None]


@torch.no_grad()
def pipeline_forward(model: RTDModel, micro_batches: Sequence[MicroBatch], *, step: int,
                     ctx: ParallelContext) -> list[RTDOutput]:
    """Validation at pipeline_model_parallel_size > 1: passes 1–3 forward only. One RTDOutput per
    micro-batch on the last stage, [] elsewhere; no gradient is touched."""
    return pipeline_forward_backward(model, micro_batches, step=step, ctx=ctx, forward_only=True)


def all_reduce_tied_gradients(model: RTDModel, ctx: ParallelContext) -> None:
    """Step 4's first half: sum the gradients of the generator table's copies over the embedding
    group (first and last stage), as megatron-core's ``finalize_model_grads`` does, and those
    of the relative tables' per-stage copies over the pipeline group."""
    if ctx.pp_size > 1:
        # the relative tables of disentangled attention: one copy per stage, each trained by
        # that stage's layers
        for p in model.pipeline_replicated_parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=ctx.pp_group)
    if ctx.embedding_group is None:
        return
    for p in model.tied_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=ctx.embedding_group)


def pipeline_train_step(engine, micro_batches: Sequence[MicroBatch], *, step: int,
                        ctx: ParallelContext, timers=NO_TIMERS) -> list[RTDOutput]:
    """One optimizer step at pipeline_model_parallel_size > 1 (steps 1–4 above)."""
    model: RTDModel = engine.module
    outputs = pipeline_forward_backward(model, micro_batches, step=step, ctx=ctx, timers=timers)
    with timers(PHASE_PIPELINE_TIED_GRADIENTS):
        all_reduce_tied_gradients(model, ctx)
    with timers(PHASE_OPTIMIZER_STEP):
        if isinstance(engine.optimizer, BF16_Optimizer):
            # DeepSpeed's bf16 optimizer (its ZeRO-1 under --bf16) takes the gradients into its
            # fp32 buffers and reduces them over the data-parallel group in the backward
            # epilogue that engine.backward() would have run; its step() does neither.
            engine.optimizer.update_hp_grads(clear_lp_grads=True)
            engine.allreduce_gradients()
        engine.step()
    return outputs
