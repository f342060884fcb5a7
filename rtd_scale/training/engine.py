"""The DeepSpeed engine: resolved ds_config, the optimizer (``training/optimizer.py``) and the
learning-rate schedule (``training/lr_schedule.py``), and the schedule's resume rule.

Ownership (STYLE rule 2): the ds_config file holds DeepSpeed's own knobs (``zero_optimization``
and the like); batch sizes, precision, gradient clipping, the optimizer and the schedule come from
rtd_scale's config. A value in the file that contradicts ours is an error, never a silent winner;
"auto" defers to ours.
"""
from __future__ import annotations

import enum
from typing import Any, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import OptimConfig, RunConfig

# The ds_config's checks and merge live in training/ds_config.py; re-exported here because
# tests and bench/ import them from the engine.
from rtd_scale.training.ds_config import load_ds_config, resolve_ds_config  # noqa: F401
from rtd_scale.training.optimizer import optimizer_for_ds_config


# The optimizer's fields a resumed run compares with its checkpoint's, and their flags: the
# schedule's (megatron-core's OptimizerParamScheduler) ...
SCHEDULE_FIELDS = {"lr": "--lr", "min_lr": "--min-lr", "lr_warmup_iters": "--lr-warmup-iters",
                   "lr_decay_iters": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                   "lr_warmup_fraction": "--lr-warmup-fraction",
                   "lr_warmup_samples": "--lr-warmup-samples",
                   "lr_decay_samples": "--lr-decay-samples", "lr_warmup_init": "--lr-warmup-init",
                   "lr_wsd_decay_style": "--lr-wsd-decay-style",
                   "lr_wsd_decay_iters": "--lr-wsd-decay-iters",
                   "lr_wsd_decay_samples": "--lr-wsd-decay-samples"}
# ... and AdamW's and the update's (Megatron-LM's OptimizerConfig): every field of
# config.OptimConfig but the two flags that decide (tests/unit/test_resume_optimizer.py)
OPTIMIZER_FIELDS = {"weight_decay": "--weight-decay", "adam_beta1": "--adam-beta1",
                    "adam_beta2": "--adam-beta2", "adam_eps": "--adam-eps",
                    "clip_grad": "--clip-grad"}
RESUME_FIELDS = {**SCHEDULE_FIELDS, **OPTIMIZER_FIELDS}


def resolve_resume_optimizer(optim: OptimConfig, saved: dict[str, Any], *, source: str,
                             saved_train_iters: Optional[int] = None) -> Optional[str]:
    """Decide the optimizer settings of a resumed run, one rule for all of them (Megatron-LM's
    rule for the schedule, ``OptimizerParamScheduler._check_and_set``, extended to AdamW's
    weight decay, betas and eps and to gradient clipping): when one of ``optim``'s
    ``RESUME_FIELDS`` differs from ``saved`` (the checkpoint's ``optim`` section; fields it lacks
    are not compared), the flags' values apply from the first resumed iteration with
    ``override_opt_param_scheduler``, and the checkpoint's are copied into ``optim`` with
    ``use_checkpoint_opt_param_scheduler`` — either way ``optim`` (so ``config.json``) holds
    what the optimizer then runs with (``checkpoint.load.apply_hyperparameters``; without it,
    torch's ``load_state_dict`` would keep the checkpoint's betas and eps while the schedule
    set the new weight decay). A changed ``--train-iters`` alone is no difference (the decay
    follows it when lr_decay_iters is unset). Returns a one-line note saying which values
    apply, or None when nothing differs.

    Raises:
        UserInputError: a difference and neither flag (naming both values of each field).
    """
    diffs = [name for name in RESUME_FIELDS
             if name in saved and saved[name] != getattr(optim, name)]
    if not diffs:
        return None

    def show(name: str, value: Any) -> str:
        if value is None:
            return "unset" + (f" (= --train-iters {saved_train_iters})"
                              if name == "lr_decay_iters" and saved_train_iters is not None
                              else "")
        if isinstance(value, enum.Enum):
            return str(value.value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    change = ", ".join(f"{RESUME_FIELDS[n]} {show(n, saved[n])} → {show(n, getattr(optim, n))}"
                       for n in diffs)
    what = ("the learning-rate schedule differs" if set(diffs) <= set(SCHEDULE_FIELDS)
            else "the optimizer settings differ")
    if optim.override_opt_param_scheduler:
        return (f"note: {what} from the checkpoint's ({change}); "
                "--override-opt_param-scheduler: the new values apply from the first resumed "
                "iteration")
    if optim.use_checkpoint_opt_param_scheduler:
        for name in diffs:
            setattr(optim, name, saved[name])  # typed as it is set (config._Section)
        optim.validate()
        return (f"note: {what} from the checkpoint's ({change}); "
                "--use-checkpoint-opt_param-scheduler: the checkpoint's values are kept")
    raise UserInputError(
        f"--load {source}: {what} from the checkpoint's ({change}); "
        "pass --override-opt_param-scheduler to use the new values from the first resumed "
        "iteration, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


def zero3_construction(ds_config: dict[str, Any], cfg: RunConfig, dp_group):
    """The context pretrain.py builds the model in (``run.set_up``): under
    ZeRO stage 3, DeepSpeed's ``zero.Init``, so that
    each module's parameters are partitioned over the data-parallel ranks as soon as the
    module is built and no rank holds the whole model (``model/weights.py`` writes each rank's
    partition of the initial values); otherwise, and when ``--pretrained-checkpoint`` writes
    whole weights into the built model before DeepSpeed starts, nothing
    (``contextlib.nullcontext``)."""
    import contextlib

    if (ds_config.get("zero_optimization", {}).get("stage", 0) != 3
            or cfg.train.pretrained_checkpoint):
        return contextlib.nullcontext()
    import deepspeed

    # the dtype comes from the resolved ds_config's bf16 / fp16 sections (DeepSpeed 0.19.8's
    # Init._set_dtype; an explicit dtype is ignored where the accelerator has no fp16, the
    # CPU's). F.linear is left as it is: the model computes as it does without zero.Init.
    # ``mpu``: the ds_config's batch arithmetic is checked over the data-parallel ranks, as
    # deepspeed.initialize checks it (a DeepSpeedConfig without one counts every rank of the
    # world, which refuses TP 2 × DP 2: tests/e2e/test_resume_layout.py)
    from rtd_scale.distributed import DeepSpeedMpu

    return deepspeed.zero.Init(data_parallel_group=dp_group, config_dict_or_path=ds_config,
                               mpu=DeepSpeedMpu(), mem_efficient_linear=False)


def build_engine(model, cfg: RunConfig, ds_config: dict[str, Any], mpu, print_fn=None):
    """``deepspeed.initialize`` with our optimizer, schedule and groups. ``print_fn``: the
    logging rank's print, for the optimizer's one note (None on the other ranks).

    Under ZeRO-3, parameters read by a module that does not own them (the tied MLM output, the
    GDES base table) are registered as external parameters of the reading module.
    """
    import deepspeed

    from rtd_scale.training.lr_schedule import build_scheduler  # megatron-core: imported on use

    # AdamW, CPU Adam under ZeRO-Offload, or the non-finite-skipping AdamW (training/optimizer.py)
    optimizer = optimizer_for_ds_config(model, cfg.optim, ds_config,
                                        model_parallel_group=mpu.get_model_parallel_group(),
                                        print_fn=print_fn)
    # megatron-core's schedule, stepped by DeepSpeed after each applied update (lr_schedule.py)
    scheduler = build_scheduler(optimizer, cfg.optim, train_iters=cfg.train.train_iters,
                                global_batch_size=cfg.train.global_batch_size)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=ds_config, mpu=mpu)
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        for module, param in model.foreign_parameters():
            deepspeed.zero.register_external_parameter(module, param)
    return engine

