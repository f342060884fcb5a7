"""Checkpoints through DeepSpeed, plus what a resumed run needs to continue exactly.

Layout (DeepSpeed's): ``<save>/global_step<N>/`` holds the engine's model and optimizer states
(ZeRO partitions included) and ``<save>/latest`` names the newest tag. rtd_scale adds the client
state (step, consumed samples, the resolved config) and one ``rng_rank<R>.pt`` per rank with that
rank's generator states (dropout), written atomically.
"""
from __future__ import annotations

from rtd_scale.cli_errors import UserInputError

import json
import os
from typing import Any, Optional

import torch

from rtd_scale import cpu_compat
from rtd_scale.atomic import write_atomic


def tag_for(step: int) -> str:
    return f"global_step{step}"


def latest_tag(load_dir: str) -> Optional[str]:
    """The tag in ``<load_dir>/latest``, or None when there is no checkpoint."""
    path = os.path.join(load_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        tag = f.read().strip()
    return tag if tag and os.path.isdir(os.path.join(load_dir, tag)) else None


def check_loadable(load_dir: str) -> str:
    """The tag ``--load`` will resume from.

    Raises:
        ValueError: no checkpoint there (message names the directory and the fix).
    """
    if not os.path.isdir(load_dir):
        raise UserInputError(f"--load {load_dir}: no such directory; point --load at a --save "
                         "directory of an earlier run, or drop --load to start fresh")
    tag = latest_tag(load_dir)
    if tag is None:
        raise UserInputError(f"--load {load_dir}: no checkpoint found (no 'latest' file naming a "
                         "global_step* directory); drop --load to start fresh")
    return tag


META_FILE = "rtd_meta.json"

# Model fields that change the shape of some parameter: a checkpoint only loads into the same.
# ``layernorm_position``: another layout has other parameters (and the same ones mean other things).
_SHAPE_FIELDS = ("vocab_size", "embedding_size", "max_position_embeddings", "sharing",
                 "layernorm_position")
_ENCODER_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


def read_meta(load_dir: str, tag: str) -> Optional[dict[str, Any]]:
    """The checkpoint's ``rtd_meta.json`` (step, consumed samples, layout, config), or None."""
    path = os.path.join(load_dir, tag, META_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_compatible(load_dir: str, tag: str, config: dict[str, Any],
                     layout: dict[str, int]) -> Optional[dict[str, Any]]:
    """Refuse, before anything is built, a ``--load`` whose checkpoint cannot continue this run:
    another process layout (DeepSpeed's ZeRO and model-parallel files are per rank) or another
    model shape. Returns the checkpoint's metadata (None for a checkpoint without it).

    Raises:
        UserInputError: naming each difference and the fix.
    """
    meta = read_meta(load_dir, tag)
    if meta is None:
        return None
    diffs = [f"{k} {meta['layout'].get(k)} → {v}" for k, v in layout.items()
             if meta["layout"].get(k) != v]
    if diffs:
        raise UserInputError(
            f"--load {load_dir}: {tag} was saved with another layout ({', '.join(diffs)}); "
            "resume with the same number of ranks, parallel sizes and ZeRO stage")
    old, new = meta["config"]["model"], config["model"]
    diffs = [f"model.{k} {old.get(k)} → {new.get(k)}" for k in _SHAPE_FIELDS
             if old.get(k) != new.get(k)]
    for enc in ("generator", "discriminator"):
        diffs += [f"model.{enc}.{k} {old[enc].get(k)} → {new[enc].get(k)}"
                  for k in _ENCODER_FIELDS if old[enc].get(k) != new[enc].get(k)]
    if diffs:
        raise UserInputError(
            f"--load {load_dir}: {tag} holds another model ({', '.join(diffs)}); use the "
            f"preset and overrides it was trained with (see {load_dir}/config.json)")
    return meta


def refresh_learning_rate(engine) -> None:
    """After a load, set the optimizer's learning rate from this run's schedule at the restored
    step: the checkpoint carries the previous run's last value, stale when --train-iters or
    --lr-decay-iters changed."""
    sched = engine.lr_scheduler
    if sched is None:
        return
    for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * fn(sched.last_epoch)


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    cpu_compat.install()
    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(engine, save_dir: str, *, step: int, client_state: dict[str, Any], rank: int,
         layout: Optional[dict[str, int]] = None) -> str:
    """Save after optimizer step ``step``; returns the checkpoint directory."""
    tag = tag_for(step)
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state)
    path = os.path.join(save_dir, tag, f"rng_rank{rank:05d}.pt")
    tmp = path + ".tmp"
    torch.save(_rng_state(), tmp)
    os.replace(tmp, path)
    if rank == 0:
        meta = {"step": step, "consumed_samples": client_state.get("consumed_samples"),
                "layout": layout or {}, "config": client_state.get("config", {})}
        write_atomic(os.path.join(save_dir, tag, META_FILE),
                     json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return os.path.join(save_dir, tag)


def load(engine, load_dir: str, *, rank: int) -> dict[str, Any]:
    """Load the latest checkpoint into ``engine``; returns its client state.

    Raises:
        ValueError: no checkpoint in ``load_dir``.
    """
    tag = check_loadable(load_dir)
    path, client_state = engine.load_checkpoint(load_dir, tag=tag)
    if path is None:
        raise UserInputError(f"--load {load_dir}: DeepSpeed could not load {tag}")
    refresh_learning_rate(engine)
    rng_path = os.path.join(load_dir, tag, f"rng_rank{rank:05d}.pt")
    if os.path.isfile(rng_path):
        _set_rng_state(torch.load(rng_path, weights_only=False))
    return client_state or {}
