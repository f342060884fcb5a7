"""Reading a checkpoint back, through ``checks.CHECKS`` at every moment: ``take`` chooses it and
checks its files before anything is built, ``load_checked`` is DeepSpeed's load with the checks
around it (training's ``--load`` and the export alike), ``load`` is training's whole resume at
the checkpoint's own layout (``training/reshard.py``: at another)."""
from __future__ import annotations

import os
from typing import Any, Optional

from rtd_scale.training.checkpoint import checks
from rtd_scale.training.checkpoint.checks import Moment
from rtd_scale.training.checkpoint.choose import Choice, choose
from rtd_scale.training.checkpoint.files import CheckpointReadError, rng_file, safe_load


def take(load: str) -> Choice:
    """The checkpoint ``--load load`` takes (``choose.choose``: the CHOOSE checks), with the
    BEFORE_BUILD checks passed on its files. Needs no process group; every rank may call it.

    Raises:
        UserInputError: no complete checkpoint, or a file that is not plain data.
    """
    choice = choose(load)
    checks.run(Moment.BEFORE_BUILD, ckpt_dir=choice.path)
    return choice


def load_checked(engine, load_dir: str, tag: str, *, flag: str,
                 earlier: str = checks.RESUME_EARLIER, **load_kwargs) -> dict[str, Any]:
    """DeepSpeed's ``engine.load_checkpoint(load_dir, tag)`` with the LOAD checks before it and
    the AFTER_LOAD checks after it (``checks.CHECKS``). ``flag`` names the checkpoint in the
    errors, ``earlier`` says how to take another one. Collective.

    Returns the checkpoint's client state ({} when none).
    """
    checks.run(Moment.LOAD, engine=engine)
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, **load_kwargs)
    checks.run(Moment.AFTER_LOAD, engine=engine, ckpt_dir=os.path.join(load_dir, tag),
               loaded=path, flag=flag, earlier=earlier)
    return client_state or {}


def refresh_learning_rate(engine) -> None:
    """After a load, set the optimizer's learning rate and weight decay from this run's
    schedule at the restored position: the checkpoint's optimizer state carries the previous
    run's last values, stale when the schedule or --train-iters changed. The scheduler
    (``training/lr_schedule.py``) holds this run's values, as ``engine.resolve_resume_schedule``
    left them."""
    sched = engine.lr_scheduler
    if sched is not None:
        sched.step(0)


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch
    from megatron.core import tensor_parallel

    from rtd_scale import cpu_compat

    cpu_compat.install()
    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load(engine, load: str, *, rank: int, universal_root: Optional[str] = None,
         choice: Optional[Choice] = None) -> dict[str, Any]:
    """Load the checkpoint :func:`take` picks for ``--load load`` into ``engine`` (``choice``:
    that pick, made earlier by the caller); returns its client state. The optimizer's learning
    rate and weight decay are then this run's schedule's at the restored position
    (:func:`refresh_learning_rate`).

    ``universal_root``: the checkpoint was saved at another layout and this is its universal
    conversion (``training/reshard.py``; the engine was built with ``load_universal``); the
    per-rank RNG files are not restored (the RNG policy there).

    Raises:
        UserInputError: no complete checkpoint, or one that fails ``checks.CHECKS``.
        CheckpointReadError: a file is unreadable or holds more than tensors (on the rank that
            reads it).
    """
    choice = choice or take(load)
    groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    # an engine built to load a universal conversion reloading a checkpoint saved at its own
    # layout (a loss-spike rollback, training/spikes.py): DeepSpeed reads the flag at each load
    config = getattr(engine, "_config", None)
    universal_engine = bool(getattr(config, "load_universal_checkpoint", False))
    if universal_engine and universal_root is None:
        config.load_universal_checkpoint = False
    try:
        client_state = load_checked(engine, universal_root or choice.load_dir, choice.tag,
                                    flag=f"--load {load}")
    finally:
        if universal_engine:
            config.load_universal_checkpoint = True
    if universal_root is not None:
        # ZeRO-3's universal load gives every group the first group's hyper-parameters
        # (stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3): the no-decay group
        # would get wd_mult 1. Keep each group's own; the schedule sets lr and decay below.
        for g, h in zip(groups, hyper):
            g.update(h)
        # ... and one step tensor to every group's state, which torch's AdamW then increments
        # in place once per group and step: each group gets its own copy.
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        for state in base.state.values():
            if hasattr(state.get("step"), "clone"):
                state["step"] = state["step"].clone()
    refresh_learning_rate(engine)
    if universal_root is not None:
        return client_state
    rng_path = os.path.join(choice.path, rng_file(rank))
    if not os.path.isfile(rng_path):
        raise CheckpointReadError(f"{rng_path}: missing; resume from another checkpoint "
                                  "(--load DIR/global_stepN)")
    _set_rng_state(safe_load(rng_path))
    return client_state
