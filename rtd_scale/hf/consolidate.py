"""One canonical state from a DeepSpeed checkpoint of any TP × PP × ZeRO layout.

``gather_full_state``: the collective that gathers ZeRO-3 partitions (DeepSpeed's
``GatheredParameters``), tensor-parallel shards and pipeline stages (merged by their
stage-independent canonical names) into ``rtd_scale.model.weights.full_state_dict``'s form.

``consolidate_checkpoint``: how ``tools/export_hf.py`` reads a run directory. DeepSpeed's own
``zero_to_fp32`` does not merge tensor-parallel shards, so instead the checkpoint's recorded world
(``<tag>/rtd_meta.json``: world size, TP, PP, ZeRO stage) is started again as local processes
(torch.multiprocessing, gloo on CPU), each builds the model from the recorded config, builds the
DeepSpeed engine from ``<run>/ds_config.json`` and loads its own files through
``engine.load_checkpoint`` exactly as ``--load`` would; then they gather. Under ``--bf16`` (and
``--fp16``) the gathered weights are the optimizer's fp32 master copy, not the 16-bit compute
weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch

from rtd_scale.cli_errors import UserInputError


@torch.no_grad()
def gather_full_state(engine, model: torch.nn.Module, ctx, vocab_size: int
                      ) -> dict[str, torch.Tensor]:
    """The whole model's canonical fp32 CPU state, on every rank. Collective: every rank of the
    world calls it (ZeRO-3 gathers over data parallel, TP shards over tensor parallel, stages
    over pipeline parallel)."""
    import deepspeed
    import torch.distributed as dist

    from rtd_scale.model import weights

    zero3 = engine is not None and engine.zero_optimization_stage() == 3
    params = list({id(p): p for p in model.parameters()}.values())
    gather = deepspeed.zero.GatheredParameters(params) if zero3 else contextlib.nullcontext()
    with gather, _master_weights(engine, params):
        state = weights.full_state_dict(model, tp_group=ctx.tp_group, vocab_size=vocab_size)
    if ctx.pp_size > 1:  # every stage's share, merged by canonical (stage-independent) names
        shares = [None] * ctx.pp_size
        dist.all_gather_object(shares, state, group=ctx.pp_group)
        state = {k: v for share in shares for k, v in share.items()}
    return state


@contextlib.contextmanager
def _master_weights(engine, params: list[torch.nn.Parameter]):
    """Under bf16 or fp16, let each parameter hold its fp32 master copy (DeepSpeed's
    ``safe_get_full_fp32_param``: the optimizer's high-precision weights, ZeRO partitions
    gathered over data parallel; collective, every rank calls it for the same parameters in the
    same order) while the state is read, then put the 16-bit compute weights back."""
    if engine is None or not (engine.bfloat16_enabled() or engine.fp16_enabled()):
        yield
        return
    from deepspeed.utils import safe_get_full_fp32_param

    saved = []
    for p in params:
        master = safe_get_full_fp32_param(p)
        if master is not None:
            saved.append((p, p.data))
            p.data = master.reshape(p.data.shape)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def run_config_from_dict(d: dict[str, Any]):
    """The ``RunConfig`` a run recorded (``config.json`` / ``rtd_meta.json``): its preset, then
    every recorded field (fields this version does not know are ignored)."""
    from rtd_scale.config import preset
    from rtd_scale.training import checkpoint

    cfg = preset(d.get("preset", "tiny"))
    m = d.get("model", {})
    if "sharing_scope" not in m and checkpoint.scope_shapes_parameters(m):
        # recorded before model.sharing_scope existed: ES / GDES shared the token table only
        # (elsewhere the scope changes nothing, config.SharingScope)
        d = {**d, "model": {**m, "sharing_scope": "tokens"}}

    def fill(obj, values: dict[str, Any]) -> None:
        for f in dataclasses.fields(obj):
            if f.name not in values:
                continue
            current, value = getattr(obj, f.name), values[f.name]
            if dataclasses.is_dataclass(current) and isinstance(value, dict):
                fill(current, value)
            elif isinstance(current, enum.Enum):
                setattr(obj, f.name, type(current)(value))
            else:
                setattr(obj, f.name, value)

    fill(cfg, d)
    cfg.validate()
    return cfg


def read_run(run_dir: str, tag: Optional[str], note: Optional[Callable[[str], None]] = None
             ) -> tuple[Any, dict[str, Any], dict[str, Any], str]:
    """(config, layout, resolved ds_config, tag) of a run directory's checkpoint: ``tag``, or
    the one ``--load run_dir`` would resume from (``training.checkpoint.choose``: the newest
    complete checkpoint). ``note``: told, in export words, which checkpoint is exported when
    that is not simply the newest one (``choose``'s own notes speak of resuming training).

    Raises:
        UserInputError: no such run or checkpoint, or a checkpoint without its metadata.
    """
    from rtd_scale.training import checkpoint

    if not os.path.isdir(run_dir):
        raise UserInputError(f"--load {run_dir}: no such directory; pass the --save directory "
                             "of a run")
    if tag is None and not checkpoint.list_tags(run_dir):
        raise UserInputError(f"--load {run_dir}: no checkpoint (no global_step* directory); "
                             "pass the --save directory of a run that saved one")
    # the checkpoint --load would take: the newest complete one, or exactly the named tag
    choice = checkpoint.choose(os.path.join(run_dir, tag) if tag else run_dir)
    if note is not None:
        for line in _export_notes(run_dir, choice):
            note(line)
    tag = choice.tag
    checkpoint.check_safe_to_load(choice.path)  # refuse a crafted pickle before any rank reads it
    meta = checkpoint.read_meta(run_dir, tag)
    if meta is None or not meta.get("layout") or not meta.get("config"):
        raise UserInputError(f"--load {run_dir}: {tag} has no {checkpoint.META_FILE} "
                             "(layout and config); it was not written by rtd_scale")
    ds_path = os.path.join(run_dir, "ds_config.json")
    if not os.path.isfile(ds_path):
        raise UserInputError(f"--load {run_dir}: no ds_config.json (the run's resolved DeepSpeed "
                             "config, written before its first step)")
    with open(ds_path, encoding="utf-8") as f:
        ds_config = json.load(f)
    return run_config_from_dict(meta["config"]), meta["layout"], ds_config, tag


def _export_notes(run_dir: str, choice) -> list[str]:
    """What ``choice`` (``checkpoint.choose``) means for an export: newer checkpoints left out
    (named by --tag, or skipped as incomplete) and a checkpoint without completion record."""
    from rtd_scale.training import checkpoint

    notes = []
    if choice.skipped:
        notes.append("note: skipped the incomplete " + "; ".join(
            f"{t} ({why})" for t, why in choice.skipped) + f"; exporting {choice.tag}")
    newest = checkpoint.newest_complete(run_dir)
    if newest is not None and newest != choice.tag and not choice.skipped:
        notes.append(f"note: {run_dir} has a newer complete checkpoint, {newest}; exporting "
                     f"{choice.tag} as --tag names")
    if choice.unverified:
        notes.append(f"warning: {choice.path} has no completion record (saved before rtd_scale "
                     "wrote them): its files' sizes could not be checked")
    return notes


def _worker(rank: int, world_size: int, port: int, run_dir: str, tag: str, cfg_dict: dict,
            ds_config: dict, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    result: Any = None
    try:
        from rtd_scale import distributed
        from rtd_scale.data.tokenizer import Tokenizer
        from rtd_scale.model.build import build_model
        from rtd_scale.training import engine as engine_mod

        cfg = run_config_from_dict(cfg_dict)
        tok = Tokenizer(cfg.data.tokenizer_model)
        ctx = distributed.initialize(cfg.parallel, seed=cfg.train.seed)
        try:
            model = build_model(cfg, ctx, tok)
            eng = engine_mod.build_engine(model, cfg, ds_config, distributed.DeepSpeedMpu())
            from rtd_scale.training import checkpoint

            # the same checks as training's --load: safe unpickling, the files found, the
            # weights finite (a checkpoint damaged in place is refused, not exported)
            checkpoint.load_checked(eng, run_dir, tag, flag=f"--load {run_dir}",
                                    load_lr_scheduler_states=False)
            state = gather_full_state(eng, model, ctx, cfg.model.vocab_size)
            if rank == 0:
                torch.save(state, os.path.join(out_dir, "state.pt"))
            result = ("ok", None)
        finally:
            distributed.teardown()
    except UserInputError as e:
        result = ("user", str(e))
    except BaseException:  # noqa: BLE001 — reported to the parent
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)


def consolidate_checkpoint(run_dir: str, tag: Optional[str] = None,
                           tokenizer_model: Optional[str] = None, timeout_s: float = 3600.0):
    """(canonical state, RunConfig, tag) of ``run_dir``'s checkpoint ``tag`` (default: latest),
    read by restarting its recorded world as local gloo processes.

    Args:
        tokenizer_model: where the run's tokenizer is now, when it moved since training.
    Raises:
        UserInputError: a missing or foreign checkpoint, or a tokenizer that cannot be found.
    """
    import torch.multiprocessing as mp

    from rtd_scale.launch_env import free_port

    cfg, layout, ds_config, tag = read_run(run_dir, tag)
    if tokenizer_model:
        cfg.data.tokenizer_model = tokenizer_model
    if not cfg.data.tokenizer_model or not os.path.isfile(cfg.data.tokenizer_model):
        raise UserInputError(f"--load {run_dir}: the run's tokenizer {cfg.data.tokenizer_model!r} "
                             "is not there; pass --tokenizer-model PATH")
    world = int(layout["world_size"])
    with tempfile.TemporaryDirectory() as out_dir:
        procs = mp.start_processes(
            _worker, args=(world, free_port(), os.path.abspath(run_dir), tag, cfg.to_dict(),
                           ds_config, out_dir),
            nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not procs.join(max(1.0, deadline - time.monotonic())):  # returns as each ends
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                break
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            if not os.path.isfile(path):
                raise RuntimeError(f"export worker {r} of {world} produced no result")
            with open(path, encoding="utf-8") as f:
                status, detail = json.load(f)
            if status == "user":
                raise UserInputError(detail)
            if status != "ok":
                raise RuntimeError(f"export worker {r} failed:\n{detail}")
        state = torch.load(os.path.join(out_dir, "state.pt"), weights_only=True)
    return state, cfg, tag
