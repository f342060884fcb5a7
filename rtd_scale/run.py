"""One pretraining run, in named phases (Megatron-LM's ``megatron/training/training.py``
``pretrain``): :func:`prepare.prepare` (every check on user input, no process group) →
:func:`check_before_start` → distributed start → :func:`set_up` (model, pretrained weights,
layout conversion, DeepSpeed engine) → :func:`resume.resume` (``--load``) →
:func:`write_run_files` → :func:`train_phase` → :func:`finish` (test split inside the loop,
exports, summary, curves).

``rtd_scale/pretrain.py`` parses the flags and calls :func:`run`. ``hf/`` is read here and in
``prepare.py``, ``resume.py`` and ``exports.py``, never from ``training/`` (DESIGN.md §2,
tests/unit/test_layering.py).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from rtd_scale import launch_env
from rtd_scale.atomic import write_atomic
from rtd_scale.config import RunConfig
from rtd_scale.prepare import Prepared, prepare
from rtd_scale.resume import Resumed, convert_if_needed, resume


def run(cfg: RunConfig, print_fn=print, stop=None, validated=None) -> dict:
    """Train; returns a summary dict (on every rank; history only on the logging rank).

    ``validated``: called once every check on user input has passed (``prepare`` and the
    schedule against ``--load``), before the process group starts; ``main`` shows the held
    configuration warnings then."""
    from rtd_scale import distributed
    from rtd_scale.training.loop import start_loaders

    launch = launch_env.read()  # the launcher's variables, a Slurm step's, or one process
    prep = prepare(cfg, launch.world_size, print_fn if launch.rank == 0 else None)
    if prep.meta is not None and prep.meta["step"] >= cfg.train.train_iters:
        if validated:
            validated()
        return nothing_to_do(cfg, prep.meta, launch.rank, print_fn)
    schedule_note = check_before_start(cfg, prep, launch.rank)
    if validated:
        validated()
    ctx = distributed.initialize(cfg.parallel, seed=cfg.train.seed)
    loaders = None
    try:
        # the loaders' workers are forked before the model exists (training/loop.py)
        loaders = start_loaders(cfg, ctx, prep.data)
        plan = memory_plan(cfg, ctx, prep, print_fn)
        model, eng, converted = set_up(cfg, ctx, prep, print_fn)
        resumed = resume(cfg, ctx, eng, model, prep, converted, schedule_note=schedule_note,
                         print_fn=print_fn)
        write_run_files(cfg, ctx, model, prep, prep.ds_config, print_fn)
        result = train_phase(cfg, ctx, eng, prep, resumed, prep.ds_config, loaders, stop,
                             print_fn,
                             reload=rollback_reload(cfg, ctx, eng, model, prep, converted,
                                                    resumed.resumed_from))
        return finish(cfg, ctx, eng, model, prep, result, resumed.start_step, print_fn,
                      plan=plan)
    finally:
        if loaders is not None:
            loaders.close()
        distributed.teardown()


def nothing_to_do(cfg: RunConfig, meta: dict, rank: int, print_fn) -> dict:
    """``--load`` of a checkpoint already at ``--train-iters``: one line, no process group."""
    if rank == 0:
        print_fn(f"nothing to do: {cfg.train.load} is at iteration {meta['step']}, and "
                 f"--train-iters is {cfg.train.train_iters}; raise --train-iters to continue")
    return {"history": [], "valid_history": [], "checkpoint_dir": None, "interrupted": False,
            "last_step": meta["step"], "tensorboard_dir": cfg.train.tensorboard_dir,
            "start_step": meta["step"]}


def check_before_start(cfg: RunConfig, prep: Prepared, rank: int) -> Optional[str]:
    """The last checks before anything is built: whole words or spans that overflow the MLM
    slots (one warning, rank 0), and the optimizer flags against the checkpoint's
    (``engine.resolve_resume_optimizer``; its note, or None)."""
    from rtd_scale.training import engine

    if rank == 0:  # whole words or spans that overflow the MLM slots: one line, at start
        from rtd_scale.objectives.unit_fit import warn_if_units_overflow
        warn_if_units_overflow(cfg.rtd, prep.data["train"], prep.tokenizer, seed=cfg.train.seed)
    if prep.meta is None:
        return None
    note = engine.resolve_resume_optimizer(
        cfg.optim, prep.meta["config"].get("optim", {}), source=cfg.train.load,
        saved_train_iters=prep.meta["config"].get("train", {}).get("train_iters"))
    # the ds_config was resolved from the flags; a kept --clip-grad is the checkpoint's
    prep.ds_config["gradient_clipping"] = cfg.optim.clip_grad
    return note


def pretrained_weights(cfg: RunConfig) -> tuple[Optional[str], Optional[str]]:
    """(the --pretrained-checkpoint to read, or None; a note for the log, or None).

    Megatron-LM's rule: a run being resumed (``--load``) continues from its own checkpoint, and
    the pretrained weights only start a run — so a requeued Slurm job may keep both flags.
    """
    path = cfg.train.pretrained_checkpoint
    if path and cfg.train.load:
        return None, (f"note: --load {cfg.train.load} resumes a run, so --pretrained-checkpoint "
                      f"{path} is not read (it only starts a run)")
    return path, None


def memory_plan(cfg: RunConfig, ctx, prep: Prepared, print_fn):
    """This rank's memory estimate (``rtd_scale/memory.py``), before the model is built: the
    parameters counted on the meta device, the layout from the resolved ds_config, and on the
    CPU the process's resident size now as the runtime's share. The logging rank prints its
    ``memory per rank:`` line. Returns the ``MemoryEstimate``."""
    from rtd_scale import memory

    device = ctx.device.type
    plan = memory.estimate(cfg, memory.config_parameter_counts(cfg, ctx),
                           memory.layout_of(cfg, prep.ds_config, dp=ctx.dp_size, device=device),
                           runtime_bytes=memory.resident_bytes() if device == "cpu" else 0.0)
    if ctx.is_logging_rank:
        print_fn(plan.line())
    return plan


def set_up(cfg: RunConfig, ctx, prep: Prepared, print_fn) -> tuple[Any, Any, Optional[str]]:
    """The model (with ``--pretrained-checkpoint``'s weights when it starts the run), the
    checkpoint's conversion when it was saved at another layout or precision, and the DeepSpeed
    engine. Returns (model, engine, the layout-free state's directory or None)."""
    from rtd_scale import distributed
    from rtd_scale.model.build import build_model
    from rtd_scale.training import engine

    tok = prep.tokenizer
    with engine.zero3_construction(prep.ds_config, cfg, ctx.dp_group):  # ZeRO-3: partitioned
        model = build_model(cfg, ctx, tok)
    pretrained, note = pretrained_weights(cfg)
    if note and ctx.is_logging_rank:
        print_fn(note)
    if pretrained:  # weights only, before DeepSpeed partitions them
        from rtd_scale.hf.pretrained import load_pretrained

        load_pretrained(model, cfg.train.pretrained_checkpoint, cfg.trained_model(),
                        pad_id=tok.pad_id,
                        tp_group=ctx.tp_group, tp_rank=ctx.tp_rank, pp_group=ctx.pp_group,
                        print_fn=print_fn if ctx.is_logging_rank else None)
    distributed.seed_after_build(ctx, cfg.train.seed)
    converted = convert_if_needed(cfg, ctx, prep, print_fn)
    eng = engine.build_engine(model, cfg, prep.ds_config, distributed.DeepSpeedMpu(),
                              print_fn=print_fn if ctx.is_logging_rank else None)
    return model, eng, converted


def write_run_files(cfg: RunConfig, ctx, model, prep: Prepared, ds_config: dict,
                    print_fn) -> None:
    """The resolved config and ds_config into ``--save`` (before step 1), then the run's
    start-up lines (``training/summary.py``), on the logging rank."""
    from rtd_scale.training.summary import start_lines

    if ctx.is_logging_rank and cfg.train.save:
        write_atomic(os.path.join(cfg.train.save, "config.json"), cfg.to_json() + "\n")
        write_atomic(os.path.join(cfg.train.save, "ds_config.json"),
                     json.dumps(ds_config, indent=2, sort_keys=True) + "\n")
    if ctx.is_logging_rank:
        for line in start_lines(cfg, ctx, model, ds_config, prep.data_parallel_size,
                                prep.gradient_accumulation_steps, prep.data):
            print_fn(line)


def rollback_reload(cfg: RunConfig, ctx, eng, model, prep: Prepared, converted: Optional[str],
                    resumed_from: Optional[str]):
    """How a loss-spike rollback (``training/loop.py``) loads a checkpoint: through
    :func:`resume.resume`, as ``--load`` would — the one this run resumed from with its own
    conversion ``converted`` (the layout-free state of another layout or precision, or None),
    one it saved itself at this run's layout. Returns ``reload(directory) -> (its step, its consumed samples)``. Collective."""
    import copy

    from rtd_scale.training.checkpoint import files, load as checkpoint_load

    def reload(path: str) -> tuple[int, int]:
        run_cfg, run_prep, run_converted = cfg, prep, converted
        if path != resumed_from:  # this run's own: its layout, batch and data
            run_cfg = copy.copy(cfg)
            run_cfg.train = copy.copy(cfg.train)
            run_cfg.train.load = path
            run_prep = copy.copy(prep)
            run_prep.resume = checkpoint_load.take(path)
            run_prep.meta = files.read_meta(run_prep.resume.load_dir, run_prep.resume.tag)
            run_converted = None
        again = resume(run_cfg, ctx, eng, model, run_prep, run_converted, schedule_note=None,
                       print_fn=lambda *_: None)
        return again.start_step, again.consumed

    return reload


def train_phase(cfg: RunConfig, ctx, eng, prep: Prepared, resumed: Resumed, ds_config: dict,
                loaders, stop, print_fn, reload=None):
    """The training loop (``training/loop.py``) with its TensorBoard, W&B and profiler sinks,
    the rank's heartbeat and the straggler meter, closed however it ends; a restarted run first
    writes its restart's event (``restarts.event``). ``reload``: how a loss-spike rollback loads
    a checkpoint (:func:`rollback_reload`). Returns the loop's result."""
    from rtd_scale.restarts import event
    from rtd_scale.training.checkpoint import choose
    from rtd_scale.training.heartbeat import Heartbeat
    from rtd_scale.training.loop import train
    from rtd_scale.training.metrics import MetricsLogger, TensorBoardLogger
    from rtd_scale.training.profiler import StepProfiler
    from rtd_scale.training.spikes import CLIENT_KEY, SpikeState
    from rtd_scale.training.stragglers import StragglerMeter

    start_step = resumed.start_step
    # a crashed run's events after its last checkpoint are hidden: one value per step
    tb = MetricsLogger(TensorBoardLogger(
        cfg.train.tensorboard_dir if ctx.is_logging_rank else None, purge_step=start_step + 1))
    profiler = None
    heartbeat = Heartbeat(cfg.fault_tolerance, rank=ctx.rank, world_size=ctx.world_size,
                          save=cfg.train.save).start(start_step)
    try:
        if ctx.is_logging_rank and cfg.monitor.uses_wandb:  # the same scalars as TensorBoard
            from rtd_scale.training.wandb_logger import WandbLogger

            ds_resolved = eng.config if isinstance(getattr(eng, "config", None), dict) else \
                ds_config
            tb.sinks.append(WandbLogger(
                cfg.monitor, config={**cfg.to_dict(), "ds_config": ds_resolved},
                save=cfg.train.save,
                resume_dir=choose.split_load(cfg.train.load)[0] if cfg.train.load
                else None))
        profiler = StepProfiler(cfg.monitor, rank=ctx.rank, device=ctx.device,
                                tensorboard_dir=cfg.train.tensorboard_dir,
                                first_step=start_step + 1, print_fn=print_fn)
        restart = event(cfg.train.save) if ctx.is_logging_rank else None
        if restart is not None:  # at the resumed step, with the restart's line as text
            tb.write(start_step, restart[0])
            tb.write_text("restarts/cause", restart[1], start_step)
        return train(cfg, ctx, eng, prep.data, loaders=loaders, start_step=start_step,
                     consumed_samples=resumed.consumed, tb=tb, print_fn=print_fn,
                     stop=stop, layout=prep.layout, resumed_from=resumed.resumed_from,
                     profiler=profiler, heartbeat=heartbeat,
                     stragglers=StragglerMeter(cfg.fault_tolerance.straggler_threshold,
                                               ctx.host_group),
                     reload=reload,
                     spike_state=SpikeState.from_client({CLIENT_KEY: resumed.loss_spikes}))
    finally:
        heartbeat.close()
        if profiler is not None:
            profiler.close()
        tb.close()


def finish(cfg: RunConfig, ctx, eng, model, prep: Prepared, result, start_step: int,
           print_fn, plan=None) -> dict:
    """After the last step (unless interrupted): ``--export`` and ``--export-hf``; then the
    summary (printed by the logging rank; with ``plan``, the ``memory_plan`` estimate beside
    the measured peak) and ``--save/curves.png``. Returns the summary."""
    import torch

    from rtd_scale.exports import export_consolidated, export_hf, export_hint
    from rtd_scale.training.throughput import peak_memory_gb

    if cfg.train.export and not result.interrupted:
        export_consolidated(eng, model, cfg, ctx, cfg.train.export)
        if ctx.is_logging_rank:
            print_fn(f"exported consolidated weights to {cfg.train.export}")
    if cfg.train.export_hf and not result.interrupted:
        export_hf(eng, model, cfg, ctx, prep.tokenizer, print_fn)
    summary = {"history": result.history, "valid_history": result.valid_history,
               "test": result.test,
               "checkpoint_dir": result.checkpoint_dir,
               "interrupted": result.interrupted, "last_step": result.last_step,
               "stragglers": result.stragglers,
               "tensorboard_dir": cfg.train.tensorboard_dir, "start_step": start_step,
               "export_hint": export_hint(cfg, exported=bool(cfg.train.export_hf)
                                          and not result.interrupted),
               "memory": {**peak_memory_gb(ctx.device),  # collective
                          "estimate_gb": (plan.measured_as(ctx.device.type) / 1e9
                                          if plan is not None else None),
                          "device": ctx.device.type}}
    if ctx.is_logging_rank and result.history:
        from rtd_scale.training.summary import summary_text

        print_fn(summary_text(summary))
        if cfg.train.save:  # draws --save/curves.png; a failure warns, never fails the run
            from rtd_scale.training.summary import write_curves

            print_fn(write_curves(cfg.train.save, cfg.train.tensorboard_dir,
                                  result.valid_history))
    torch.distributed.barrier()
    return summary
