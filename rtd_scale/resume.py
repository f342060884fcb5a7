"""``--load``: the checkpoint :func:`prepare.prepare` chose (once per run) converted when it was
saved at another layout (:func:`convert_for_layout`, before the engine is built), then loaded
into the engine and the data position, step and notes taken from it (:func:`resume`).

The learning rate and weight decay after the load are this run's schedule's at the restored
position, set once (``checkpoint.load.refresh_learning_rate``, inside ``checkpoint.load.load`` and
``reshard.load_canonical``); at another global batch the scheduler restores the position moved
to the step the run reached (``MegatronLRScheduler.expect_checkpoint_batch``) before that.
The conversion reads ``hf/consolidate.py``'s layout-free state, so this module stays outside
``training/``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import RunConfig


@dataclass
class Converted:
    """Where the engine loads a checkpoint saved at another layout from: ``universal``, a
    DeepSpeed universal checkpoint's root (the ds_config then has ``checkpoint.load_universal``),
    or ``canonical``, rtd_scale's layout-free state; both None when no conversion was needed."""

    ds_config: dict[str, Any]
    universal: Optional[str] = None
    canonical: Optional[str] = None


@dataclass
class Resumed:
    """Where training continues: the last step done, the samples consumed (in this run's data
    order), the checkpoint directory it came from (None for a fresh run) and its record of
    loss spikes (the client state's ``training/spikes.py`` field; None when it has none)."""

    start_step: int = 0
    consumed: int = 0
    resumed_from: Optional[str] = None
    loss_spikes: Optional[dict] = None


def convert_if_needed(cfg: RunConfig, ctx, prep, print_fn) -> Converted:
    """A checkpoint saved at another layout, converted first (``training/reshard.py``): to
    DeepSpeed's universal checkpoint or to rtd_scale's layout-free state."""
    from rtd_scale.training.checkpoint import compat

    ds_config = prep.ds_config
    if not compat.needs_conversion(prep.meta, prep.layout):
        return Converted(ds_config)
    root, is_universal = convert_for_layout(prep.resume, ctx, prep.meta, prep.layout,
                                            print_fn if ctx.is_logging_rank else None,
                                            cfg.data.tokenizer_model)
    if not is_universal:
        return Converted(ds_config, canonical=root)
    ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}),
                                             "load_universal": True}}
    return Converted(ds_config, universal=root)


def convert_for_layout(choice, ctx, meta: dict, layout: dict, print_fn,
                       tokenizer_model: Optional[str] = None) -> tuple[str, bool]:
    """The conversion of ``choice`` (the checkpoint ``--load`` takes), saved at another layout:
    rank 0 writes it (or finds it) beside the checkpoint while the others wait; every rank
    raises the same one-line error when it fails. Returns (its root, whether it is DeepSpeed's
    universal checkpoint rather than rtd_scale's layout-free state; ``training/reshard.py``)."""
    import torch.distributed as dist

    from rtd_scale.training import reshard
    from rtd_scale.training.checkpoint import compat

    universal = reshard.uses_universal(meta["layout"], layout)
    result: list = [None]
    if ctx.rank == 0:
        try:
            if universal:
                root, seconds, fresh = reshard.convert(choice.load_dir, choice.tag)
                reshard.check_converted_safe(root, choice.tag)
            else:
                from rtd_scale.hf.consolidate import consolidate_training_state

                root, seconds, fresh = reshard.convert_canonical(
                    choice.load_dir, choice.tag,
                    lambda run, tag, out: consolidate_training_state(run, tag, out,
                                                                     tokenizer_model))
                reshard.check_canonical_safe(root)
            result = [(root, seconds, fresh, None)]
        except UserInputError as e:
            result = [(None, 0.0, False, str(e))]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    root, seconds, fresh, error = result[0]
    if error is not None:
        raise UserInputError(error)
    if print_fn:
        was = compat.describe_layout(meta["layout"])
        now = compat.describe_layout(layout)
        how = f"in {seconds:.1f} s" if fresh else "reusing the conversion made earlier"
        what = (f"DeepSpeed universal checkpoint {os.path.join(root, choice.tag)}" if universal
                else f"layout-free state {root}")
        print_fn(f"converted {choice.path} from {was} to {now} ({what}) {how}")
    return root, universal


def resume(cfg: RunConfig, ctx, eng, model, prep, converted: Converted, *,
           schedule_note: Optional[str], print_fn) -> Resumed:
    """Load the checkpoint ``prep.resume`` (chosen by ``prepare``) into ``eng``; its lr and
    weight decay are set from this run's resolved schedule. Returns where training continues
    (a fresh :class:`Resumed` without ``--load``); the logging rank prints what changed."""
    from rtd_scale import distributed
    from rtd_scale.training.checkpoint import choose, files, load as ckpt_load
    from rtd_scale.training.spikes import CLIENT_KEY

    if not cfg.train.load:
        return Resumed()
    # the schedule continues at the step it reached, not at the samples it read: told the
    # checkpoint's batch (rtd_meta.json) before the load, the scheduler restores the moved
    # position, and the load's one lr refresh reads it
    meta_batch = ((prep.meta or {}).get("config") or {}).get("train", {}).get("global_batch_size")
    if meta_batch is not None:
        eng.lr_scheduler.expect_checkpoint_batch(meta_batch, cfg.optim)
    if converted.canonical is not None:
        from rtd_scale.training import reshard

        client = reshard.load_canonical(eng, model, ctx, converted.canonical, prep.resume,
                                        flag=f"--load {cfg.train.load}")
    else:
        client = ckpt_load.load(eng, cfg.train.load, rank=ctx.rank,
                                universal_root=converted.universal, choice=prep.resume)
    start_step = int(client.get("step", 0))
    if converted.universal is not None or converted.canonical is not None:
        # dropout: a fresh stream per rank (training/reshard.py)
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
        for line in _resume_notes(cfg, saved, start_step, consumed, old_data, new_data,
                                  repacked_note, schedule_note, train_data):
            print_fn(line)
        if (loss_spikes or {}).get("skipped_samples"):
            ranges = ", ".join(f"{a}–{b - 1}" for a, b in loss_spikes["skipped_samples"])
            print_fn(f"note: global samples {ranges} are not read (loss-spike rollbacks: "
                     f"{loss_spikes.get('rollbacks', 0)}; --loss-spike-policy)")
        print_fn(f"learning rate of iteration {start_step + 1}: {eng.get_lr()[0]!r}")
    return Resumed(start_step, consumed, resumed_from, loss_spikes)


def _resume_notes(cfg: RunConfig, saved: dict, start_step: int, consumed: int, old_data,
                  new_data, repacked_note: Optional[str], schedule_note: Optional[str],
                  train_data) -> list[str]:
    """What a resume changes against the checkpoint's run (``saved``: its ``train`` section):
    the global batch, the training data, ``--train-iters``, the schedule, the seed."""
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
    elif old_data is not None and old_data != new_data:
        notes.append(f"note: the training data differ from the checkpoint's ({old_data} → "
                     f"{new_data}); the run continues at sample {consumed} of the new "
                     "data's order, not where the old order would have gone")
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
