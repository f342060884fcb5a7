"""``--load``: the checkpoint :func:`prepare.prepare` chose (once per run), converted to the
layout-free state when it was saved at another layout or precision (:func:`convert_for_layout`,
before the engine is built), then loaded into the engine and the data position, step and notes
taken from it (:func:`resume`).

After the load, the optimizer runs with this run's hyperparameters (``checkpoint.load.
apply_hyperparameters``: betas and eps, then the learning rate and weight decay of this run's
schedule at the restored position); at another global batch the scheduler restores the position
moved to the step the run reached (``MegatronLRScheduler.expect_checkpoint_batch``) before that.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import RunConfig


@dataclass
class Resumed:
    """Where training continues: the last step done, the samples consumed (in this run's data
    order), the checkpoint directory it came from (None for a fresh run) and its record of
    loss spikes (the client state's ``training/spikes.py`` field; None when it has none)."""

    start_step: int = 0
    consumed: int = 0
    resumed_from: Optional[str] = None
    loss_spikes: Optional[dict] = None


def convert_if_needed(cfg: RunConfig, ctx, prep, print_fn) -> Optional[str]:
    """The layout-free state of a checkpoint saved at another layout or precision
    (``training/checkpoint/convert.py``), or None when DeepSpeed loads it as it is."""
    from rtd_scale.training.checkpoint import compat

    if not compat.needs_conversion(prep.meta, prep.layout, cfg.train.precision.value):
        return None
    return convert_for_layout(prep.resume, ctx, prep.meta, prep.layout, cfg.train.precision.value,
                              print_fn if ctx.is_logging_rank else None, cfg.data.tokenizer_model)


def convert_for_layout(choice, ctx, meta: dict, layout: dict, precision: str, print_fn,
                       tokenizer_model: Optional[str] = None) -> str:
    """The layout-free state of ``choice`` (the checkpoint ``--load`` takes): rank 0 writes it
    (or finds it) beside the checkpoint while the others wait; every rank raises the same
    one-line error when it fails. Returns its directory."""
    import torch.distributed as dist

    from rtd_scale.training.checkpoint import compat, convert

    result: list = [None]
    if ctx.rank == 0:
        try:
            root, seconds, fresh, peak = convert.convert(choice.load_dir, choice.tag,
                                                         tokenizer_model)
            convert.check_safe(root)
            result = [(root, seconds, fresh, peak, None)]
        except UserInputError as e:
            result = [(None, 0.0, False, None, str(e))]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    root, seconds, fresh, peak, error = result[0]
    if error is not None:
        raise UserInputError(error)
    if print_fn:
        old = compat.precision_of(meta)
        changed = old != precision
        was = compat.describe_layout(meta["layout"], old if changed else None)
        now = compat.describe_layout(layout, precision if changed else None)
        how = "reusing the conversion made earlier"
        if fresh:
            how = f"in {seconds:.1f} s"
            if peak is not None:  # the restarted world's largest process (convert.run_world)
                how += (f", {convert.readers(meta['layout'])}, the largest {peak:.2f} GB "
                        "resident at its peak")
        print_fn(f"converted {choice.path} from {was} to {now} (layout-free state {root}) {how}")
    return root


def resume(cfg: RunConfig, ctx, eng, model, prep, converted: Optional[str], *,
           schedule_note: Optional[str], print_fn) -> Resumed:
    """Load the checkpoint ``prep.resume`` (chosen by ``prepare``) into ``eng`` (through its
    layout-free state ``converted`` when that is not None); the optimizer's hyperparameters are
    then this run's (``checkpoint.load.apply_hyperparameters``). Returns where training continues
    (a fresh :class:`Resumed` without ``--load``); the logging rank prints what changed."""
    from rtd_scale import distributed
    from rtd_scale.training.checkpoint import choose, compat, files, load as ckpt_load
    from rtd_scale.training.spikes import CLIENT_KEY

    if not cfg.train.load:
        return Resumed()
    # the schedule continues at the step it reached, not at the samples it read: told the
    # checkpoint's batch (rtd_meta.json) before the load, the scheduler restores the moved
    # position, and the load's one lr refresh reads it
    meta_batch = ((prep.meta or {}).get("config") or {}).get("train", {}).get("global_batch_size")
    if meta_batch is not None:
        eng.lr_scheduler.expect_checkpoint_batch(meta_batch, cfg.optim)
    if converted is not None:
        from rtd_scale.training.checkpoint import layout_free

        client = layout_free.load(eng, model, ctx, converted, prep.resume.path,
                                  flag=f"--load {cfg.train.load}")
    else:
        client = ckpt_load.load(eng, cfg.train.load, rank=ctx.rank, choice=prep.resume)
    ckpt_load.apply_hyperparameters(eng, cfg.optim)
    start_step = int(client.get("step", 0))
    if converted is not None and compat.same_ranks(prep.meta, prep.layout):
        ckpt_load.restore_rng(prep.resume.path, ctx.rank)  # the same ranks: dropout continues
    elif converted is not None:  # other ranks: a fresh stream each (layout_free's RNG policy)
        distributed.seed_after_build(ctx, cfg.train.seed + start_step)
    resumed_from = os.path.join(choose.split_load(cfg.train.load)[0],
                                files.tag_for(start_step))
    consumed = int(client.get("consumed_samples", start_step * cfg.train.global_batch_size))
    saved = (client.get("config") or {}).get("train", {})
    old_batch = saved.get("global_batch_size")
    if meta_batch is None and old_batch is not None and old_batch != cfg.train.global_batch_size:
        eng.lr_scheduler.keep_iterations(old_batch, cfg.optim)  # a checkpoint without metadata
    loss_spikes = client.get(CLIENT_KEY)
    train_data = prep.data["train"]
    old_data, new_data = client.get("data"), train_data.state()
    read, consumed, repacked_note = consumed, *train_data.continue_after(consumed, old_data)
    if ctx.is_logging_rank:
        print_fn(f"resumed from {cfg.train.load} at iteration {start_step} "
                 f"({read} samples consumed)")
        if prep.meta is not None and (context := compat.context_note(
                RunConfig.from_dict(prep.meta["config"]).model, cfg.model)):
            print_fn(context)  # the context extension (compat.check_positions allowed it)
        for line in _resume_notes(cfg, saved, start_step, consumed, old_data, new_data,
                                  repacked_note, schedule_note, train_data,
                                  (client.get("config") or {}).get("data", {})):
            print_fn(line)
        if (loss_spikes or {}).get("skipped_samples"):
            ranges = ", ".join(f"{a}–{b - 1}" for a, b in loss_spikes["skipped_samples"])
            print_fn(f"note: global samples {ranges} are not read (loss-spike rollbacks: "
                     f"{loss_spikes.get('rollbacks', 0)}; --loss-spike-policy)")
        print_fn(f"learning rate of iteration {start_step + 1}: {eng.get_lr()[0]!r}")
    return Resumed(start_step, consumed, resumed_from, loss_spikes)


def _resume_notes(cfg: RunConfig, saved: dict, start_step: int, consumed: int, old_data,
                  new_data, repacked_note: Optional[str], schedule_note: Optional[str],
                  train_data, saved_data: Optional[dict] = None) -> list[str]:
    """What a resume changes against the checkpoint's run (``saved``: its ``train`` section;
    ``saved_data``: its ``data`` section): the global batch, the training data, document
    masking, ``--train-iters``, the schedule, the seed."""
    from rtd_scale.training.checkpoint import compat

    notes = []
    old_batch = saved.get("global_batch_size")
    if old_batch is not None and old_batch != cfg.train.global_batch_size:
        notes.append(f"note: --global-batch-size {cfg.train.global_batch_size} (the "
                     f"checkpoint's {old_batch}): iterations from {start_step + 1} on "
                     f"read {cfg.train.global_batch_size} samples each; the optimizer "
                     "state, the step count and the schedule carry on")
    if repacked_note:
        notes.append(repacked_note)
    elif old_data is not None and (change := compat.data_change(old_data, new_data)):
        notes.append(compat.data_change_note(change, consumed, train_data))  # accepted: prepare
    # Document masking changes what the model attends to, not the data: the same samples,
    # order, MLM masks and sampling noise follow (data/packed.py), and no parameter changes
    # shape, so the run continues exactly where it was, as after another --mask-prob or
    # dropout (accepted unremarked); it says so, as a context extension's phase 2 would.
    was_masked = (saved_data or {}).get("document_masking", False)  # False: before the field
    if was_masked != cfg.data.document_masking:
        notes.append(f"note: document masking (--reset-attention-mask) is "
                     f"{'on' if cfg.data.document_masking else 'off'}, the checkpoint's run had "
                     f"it {'on' if was_masked else 'off'}: from iteration {start_step + 1} "
                     "attention " + ("stays within each document and positions restart at "
                                     "each" if cfg.data.document_masking else
                                     "spans the whole packed sample") +
                     "; the samples, their order and masks carry on")
    old_iters = saved.get("train_iters")
    if old_iters is not None and old_iters != cfg.train.train_iters:
        if cfg.optim.lr_decay_iters is None and cfg.optim.lr_decay_samples is None:
            follows = "the learning-rate schedule follows the new value from this step on"
        else:  # e.g. phase 2 of a two-phase run: the decay spans the whole run
            follows = ("the learning-rate schedule keeps its length, "
                       + (f"--lr-decay-iters {cfg.optim.lr_decay_iters}"
                          if cfg.optim.lr_decay_iters is not None else
                          f"--lr-decay-samples {cfg.optim.lr_decay_samples}"))
        notes.append(f"note: --train-iters changed from {old_iters} to "
                     f"{cfg.train.train_iters}; {follows}")
    if schedule_note:
        notes.append(schedule_note)
    saved_seed = saved.get("seed")
    if saved_seed is not None and saved_seed != cfg.train.seed:  # allowed: prepare
        notes.append(compat.data_order_note(saved_seed, cfg.train.seed, consumed, train_data))
    return notes
