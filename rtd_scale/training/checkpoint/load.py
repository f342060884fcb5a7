"""Reading a checkpoint back, through ``checks.CHECKS`` at every moment: ``take`` chooses it and
checks its files before anything is built, ``load_checked`` is DeepSpeed's load with the checks
around it (training's ``--load`` and the export alike), ``load`` is training's whole resume at
the checkpoint's own layout (at another: ``layout_free.load``)."""
from __future__ import annotations

import os
from typing import Any, Optional

from rtd_scale.training.checkpoint import checks
from rtd_scale.training.checkpoint.checks import Moment
from rtd_scale.training.checkpoint.choose import START_FRESH, Choice, choose
from rtd_scale.training.checkpoint.files import CheckpointReadError, rng_file, safe_load


def take(load: str, fresh: str = START_FRESH) -> Choice:
    """The checkpoint ``--load load`` takes (``choose.choose``: the CHOOSE checks), with the
    BEFORE_BUILD checks passed on its files. Needs no process group; every rank may call it.

    Raises:
        UserInputError: no complete checkpoint, or a file that is not plain data.
    """
    choice = choose(load, fresh)
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
    (``training/lr_schedule.py``) holds this run's values, as ``engine.resolve_resume_optimizer``
    left them."""
    sched = engine.lr_scheduler
    if sched is not None:
        sched.step(0)


def apply_hyperparameters(engine, optim) -> None:
    """After a load, this run's optimizer hyperparameters in every parameter group: AdamW's
    betas and eps from ``optim`` (torch's ``load_state_dict`` restores the checkpoint's), then
    the learning rate and weight decay from the schedule (:func:`refresh_learning_rate`). What
    differs from the checkpoint was accepted first (``engine.resolve_resume_optimizer``), so
    the optimizer runs with what ``config.json`` says."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for group in base.param_groups:
        group["betas"] = (optim.adam_beta1, optim.adam_beta2)
        group["eps"] = optim.adam_eps
    refresh_learning_rate(engine)


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch
    from megatron.core import tensor_parallel

    from rtd_scale import cpu_compat

    cpu_compat.install()
    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load(engine, load: str, *, rank: int, choice: Optional[Choice] = None) -> dict[str, Any]:
    """Load the checkpoint :func:`take` picks for ``--load load`` into ``engine`` (``choice``:
    that pick, made earlier by the caller), saved at this run's layout; returns its client
    state. The optimizer state takes the form this run's optimizer keeps
    (``layout_free.match_optimizer``: ZeRO-Offload on one side only), and the optimizer's
    learning rate and weight decay are this run's schedule's at the restored position
    (:func:`refresh_learning_rate`).

    Raises:
        UserInputError: no complete checkpoint, or one that fails ``checks.CHECKS``.
        CheckpointReadError: a file is unreadable or holds more than tensors (on the rank that
            reads it).
    """
    from rtd_scale.training.checkpoint import layout_free

    choice = choice or take(load)
    built = layout_free.group_settings(engine)
    client_state = load_checked(engine, choice.load_dir, choice.tag, flag=f"--load {load}")
    layout_free.match_optimizer(engine, built)
    refresh_learning_rate(engine)
    restore_rng(choice.path, rank)
    return client_state


def restore_rng(path: str, rank: int) -> None:
    """This rank's generator states (dropout) from the checkpoint directory ``path``.

    Raises:
        CheckpointReadError: its ``rng_rank*.pt`` is missing or unreadable.
    """
    rng_path = os.path.join(path, rng_file(rank))
    if not os.path.isfile(rng_path):
        raise CheckpointReadError(f"{rng_path}: missing; resume from another checkpoint "
                                  "(--load DIR/global_stepN)")
    _set_rng_state(safe_load(rng_path))
