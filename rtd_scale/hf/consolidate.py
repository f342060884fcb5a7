"""One canonical state from a DeepSpeed checkpoint of any TP × PP × ZeRO layout.

``gather_full_state``: the collective that gathers ZeRO-3 partitions (DeepSpeed's
``GatheredParameters``), tensor-parallel shards and pipeline stages (merged by their
stage-independent canonical names) into ``rtd_scale.model.weights.full_state_dict``'s form.

``consolidate_checkpoint``: how ``tools/export_hf.py`` reads a run directory. DeepSpeed's own
``zero_to_fp32`` does not merge tensor-parallel shards, so instead the checkpoint's recorded world
(``<tag>/rtd_meta.json``: world size, TP, PP, ZeRO stage) is started again as local processes
(torch.multiprocessing, gloo on CPU), each builds the model from the recorded config, builds the
DeepSpeed engine from ``<run>/ds_config.json`` and loads its own files exactly as ``--load``
would, through the same checks (``training/checkpoint/checks.py``'s ``CHECKS``: a checkpoint
damaged in place is refused, not exported); then they gather. Under ``--bf16`` (and
``--fp16``) the gathered weights are the optimizer's fp32 master copy, not the 16-bit compute
weights.

``consolidate_training_state``: the same restart, gathering also both AdamW moments of every
parameter and the optimizer's step into one layout-free file, which ``training/reshard.py``
loads into a run at another TP × PP × DP × ZeRO layout.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import rank_share


# The per-parameter optimizer state a layout change carries (torch.optim.AdamW's names), besides
# the fp32 master weights.
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
# How a refused export is told to take another checkpoint (tools/export_hf.py's flag).
EXPORT_EARLIER = "export an earlier checkpoint (--tag global_stepN)"


@torch.no_grad()
def gather_full_state(engine, model: torch.nn.Module, ctx, vocab_size: int,
                      state_key: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The whole model's canonical fp32 CPU state, on every rank. Collective: every rank of the
    world calls it (ZeRO-3 gathers over data parallel, TP shards over tensor parallel, stages
    over pipeline parallel).

    ``state_key``: instead of the weights, that AdamW state of every parameter (``exp_avg`` or
    ``exp_avg_sq``, one of ``ADAM_STATE_KEYS``), in the same canonical names and full shapes
    (the vocabulary's padding rows dropped like the weights')."""
    import deepspeed
    import torch.distributed as dist

    from rtd_scale.model import weights

    zero3 = engine is not None and engine.zero_optimization_stage() == 3
    params = list({id(p): p for p in model.parameters()}.values())
    gather = deepspeed.zero.GatheredParameters(params) if zero3 else contextlib.nullcontext()
    with gather, _master_weights(engine, params, state_key):
        state = weights.full_state_dict(model, tp_group=ctx.tp_group, vocab_size=vocab_size)
    if ctx.pp_size > 1:  # every stage's share, merged by canonical (stage-independent) names
        shares = [None] * ctx.pp_size
        dist.all_gather_object(shares, state, group=ctx.pp_group)
        state = {k: v for share in shares for k, v in share.items()}
    return state


@contextlib.contextmanager
def _master_weights(engine, params: list[torch.nn.Parameter], state_key: Optional[str] = None):
    """Under bf16 or fp16, let each parameter hold its fp32 master copy (DeepSpeed's
    ``safe_get_full_fp32_param``: the optimizer's high-precision weights, ZeRO partitions
    gathered over data parallel; collective, every rank calls it for the same parameters in the
    same order) while the state is read, then put the 16-bit compute weights back.

    ``state_key``: let each parameter hold that AdamW state instead, in any precision
    (``safe_get_full_optimizer_state`` at ZeRO 1–3 and under DeepSpeed's bf16 optimizer; at
    ZeRO-0 in fp32 the client optimizer's own ``state[p]``, zeros before its first step)."""
    if state_key is None and (engine is None
                              or not (engine.bfloat16_enabled() or engine.fp16_enabled())):
        yield
        return
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    saved = []
    for p in params:
        if state_key is None:
            master = safe_get_full_fp32_param(p)
        elif hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
            master = safe_get_full_optimizer_state(p, state_key)
        else:  # ZeRO-0: the client AdamW steps the model's own fp32 parameters
            if engine.fp16_enabled():
                raise UserInputError(
                    "the AdamW state of a ZeRO-0 --fp16 run lives in DeepSpeed's flat fp16 "
                    "optimizer and cannot be read per parameter; resume it at its own layout")
            master = base.state.get(p, {}).get(state_key)
            if master is None:
                master = torch.zeros_like(p)
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
    from rtd_scale.training.checkpoint.compat import scope_shapes_parameters

    cfg = preset(d.get("preset", "tiny"))
    m = d.get("model", {})
    if "sharing_scope" not in m and scope_shapes_parameters(m):
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
    the one ``--load run_dir`` would resume from (``training.checkpoint.load.take``: the newest
    complete checkpoint, its files checked as training's ``--load`` checks them). ``note``:
    told, in export words, which checkpoint is exported when that is not simply the newest one
    (``choose``'s own notes speak of resuming training).

    Raises:
        UserInputError: no such run or checkpoint, or a checkpoint without its metadata.
    """
    from rtd_scale.training.checkpoint import files, load

    if not os.path.isdir(run_dir):
        raise UserInputError(f"--load {run_dir}: no such directory; pass the --save directory "
                             "of a run")
    if tag is None and not files.list_tags(run_dir):
        raise UserInputError(f"--load {run_dir}: no checkpoint (no global_step* directory); "
                             "pass the --save directory of a run that saved one")
    # the checkpoint --load would take (the newest complete one, or exactly the named tag), its
    # files checked before any rank reads them: the CHOOSE and BEFORE_BUILD checks
    choice = load.take(os.path.join(run_dir, tag) if tag else run_dir)
    if note is not None:
        for line in _export_notes(run_dir, choice):
            note(line)
    tag = choice.tag
    meta = files.read_meta(run_dir, tag)
    if meta is None or not meta.get("layout") or not meta.get("config"):
        raise UserInputError(f"--load {run_dir}: {tag} has no {files.META_FILE} "
                             "(layout and config); it was not written by rtd_scale")
    ds_path = os.path.join(run_dir, "ds_config.json")
    if not os.path.isfile(ds_path):
        raise UserInputError(f"--load {run_dir}: no ds_config.json (the run's resolved DeepSpeed "
                             "config, written before its first step)")
    with open(ds_path, encoding="utf-8") as f:
        ds_config = json.load(f)
    return run_config_from_dict(meta["config"]), meta["layout"], ds_config, tag


def _export_notes(run_dir: str, choice) -> list[str]:
    """What ``choice`` (``checkpoint.choose.choose``) means for an export: newer checkpoints left
    out (named by --tag, or skipped as incomplete) and a checkpoint without completion record."""
    from rtd_scale.training.checkpoint.choose import newest_complete

    notes = []
    if choice.skipped:
        notes.append("note: skipped the incomplete " + "; ".join(
            f"{t} ({why})" for t, why in choice.skipped) + f"; exporting {choice.tag}")
    newest = newest_complete(run_dir)
    if newest is not None and newest != choice.tag and not choice.skipped:
        notes.append(f"note: {run_dir} has a newer complete checkpoint, {newest}; exporting "
                     f"{choice.tag} as --tag names")
    if choice.unverified:
        notes.append(f"warning: {choice.path} has no completion record (saved before rtd_scale "
                     "wrote them): its files' sizes could not be checked")
    return notes


# What a worker imports, loaded once by the forkserver that _run_world forks its workers from.
WORKER_MODULES = ("rtd_scale.hf.consolidate", "rtd_scale.distributed", "rtd_scale.data.tokenizer",
                  "rtd_scale.model.build", "rtd_scale.training.engine",
                  "rtd_scale.training.checkpoint.load", "rtd_scale.training.checkpoint.checks")


def _worker(rank: int, world_size: int, port: int, run_dir: str, tag: str, cfg_dict: dict,
            ds_config: dict, out_dir: str, what: str, environ: dict) -> None:
    os.environ.clear()  # the caller's environment at _run_world, as spawn would give it
    os.environ.update(environ)
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
            eng = engine_mod.build_engine(  # the CPU Adam note (ZeRO-Offload) from one worker
                model, cfg, ds_config, distributed.DeepSpeedMpu(),
                print_fn=functools.partial(print, file=sys.stderr, flush=True) if rank == 0 else None)
            from rtd_scale.training.checkpoint import checks, load

            # the LOAD and AFTER_LOAD checks of training's --load: safe unpickling, the files
            # found, the weights finite (a checkpoint damaged in place is refused, not exported)
            load.load_checked(eng, run_dir, tag, flag=f"--load {run_dir}",
                              earlier=checks.RESUME_EARLIER if what == "training"
                              else EXPORT_EARLIER, load_lr_scheduler_states=False)
            if what == "training":
                _save_training_state(eng, model, ctx, cfg, out_dir, rank)
            else:
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



def _read_run_with_tokenizer(run_dir: str, tag: Optional[str], tokenizer_model: Optional[str]):
    """``read_run``, with the tokenizer moved to ``tokenizer_model`` when given, and refused in
    one line when it is not there."""
    cfg, layout, ds_config, tag = read_run(run_dir, tag)
    if tokenizer_model:
        cfg.data.tokenizer_model = tokenizer_model
    if not cfg.data.tokenizer_model or not os.path.isfile(cfg.data.tokenizer_model):
        raise UserInputError(f"--load {run_dir}: the run's tokenizer {cfg.data.tokenizer_model!r} "
                             "is not there; pass --tokenizer-model PATH")
    return cfg, layout, ds_config, tag

def consolidate_checkpoint(run_dir: str, tag: Optional[str] = None,
                           tokenizer_model: Optional[str] = None, timeout_s: float = 3600.0):
    """(canonical state, RunConfig, tag) of ``run_dir``'s checkpoint ``tag`` (default: latest),
    read by restarting its recorded world as local gloo processes.

    Args:
        tokenizer_model: where the run's tokenizer is now, when it moved since training.
    Raises:
        UserInputError: a missing or foreign checkpoint, or a tokenizer that cannot be found.
    """
    cfg, layout, ds_config, tag = _read_run_with_tokenizer(run_dir, tag, tokenizer_model)
    with tempfile.TemporaryDirectory() as out_dir:
        _run_world(int(layout["world_size"]), run_dir, tag, cfg, ds_config, out_dir, "weights",
                   timeout_s)
        state = torch.load(os.path.join(out_dir, "state.pt"), weights_only=True)
    return state, cfg, tag


def _run_world(world: int, run_dir: str, tag: str, cfg, ds_config: dict, out_dir: str,
               what: str, timeout_s: float) -> None:
    """Start ``world`` local gloo processes of :func:`_worker`; raise what any of them raised."""
    from rtd_scale.launch_env import free_port, start_forked_workers

    procs = start_forked_workers(
        _worker, (world, free_port(), os.path.abspath(run_dir), tag, cfg.to_dict(), ds_config,
                  out_dir, what, dict(os.environ)), world, WORKER_MODULES)
    deadline = time.monotonic() + timeout_s
    while not procs.join(max(1.0, deadline - time.monotonic())):  # returns as each ends
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            break
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        if not os.path.isfile(path):
            raise RuntimeError(f"checkpoint worker {r} of {world} produced no result")
        with open(path, encoding="utf-8") as f:
            status, detail = json.load(f)
        os.remove(path)
        if status == "user":
            raise UserInputError(detail)
        if status != "ok":
            raise RuntimeError(f"checkpoint worker {r} failed:\n{detail}")


# ----------------------------------------------------------- the whole training state ----

def ds_config_for_layout(ds_config: dict[str, Any], cfg, layout: dict[str, Any]) -> dict[str, Any]:
    """``ds_config`` (a run directory's resolved ``ds_config.json``, written by the newest run
    there, perhaps at another layout) as the run that saved a checkpoint at ``layout`` had it:
    that ZeRO stage, and the batch numbers of that data-parallel and pipeline size
    (``training/ds_config.resolve_ds_config``'s rule)."""
    t = cfg.train
    per_rank, gas = rank_share(t.global_batch_size, t.micro_batch_size,
                               int(layout["data_parallel_size"]))
    out = {**ds_config, "zero_optimization": {**ds_config.get("zero_optimization", {}),
                                              "stage": int(layout["zero_stage"])}}
    if int(layout["pipeline_model_parallel_size"]) > 1:
        out.update(train_micro_batch_size_per_gpu=per_rank,
                   gradient_accumulation_steps=1, managed_gradient_accumulation=False)
    else:
        out.pop("managed_gradient_accumulation", None)
        out.update(train_micro_batch_size_per_gpu=t.micro_batch_size,
                   gradient_accumulation_steps=gas)
    out["train_batch_size"] = t.global_batch_size
    return out


def _adam_step(engine) -> float:
    """The AdamW step count the optimizer's state holds (every state agrees; 0 before the
    first step)."""
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    steps |= {float(g["step"]) for g in base.param_groups if "step" in g}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's states hold different step counts {sorted(steps)}")
    return steps.pop() if steps else 0.0


def _save_training_state(engine, model, ctx, cfg, out_dir: str, rank: int) -> None:
    """Rank 0 writes ``state.pt`` ({"fp32" | "exp_avg" | "exp_avg_sq": {canonical name: full
    fp32 tensor}}) and ``training_state.json`` (the AdamW step, the loss scaler's state)."""
    state = {"fp32": gather_full_state(engine, model, ctx, cfg.model.vocab_size)}
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    if base.state and hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO-1/2 and the bf16 optimizer link each parameter's view of the flat AdamW state at
        # their first step; a loaded state is not linked yet
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for key in ADAM_STATE_KEYS:
        state[key] = gather_full_state(engine, model, ctx, cfg.model.vocab_size, state_key=key)
    step = _adam_step(engine)
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    info = {"adam_step": step,
            "loss_scaler": {k: getattr(scaler, k) for k in
                            ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
                            if isinstance(getattr(scaler, k, None), (int, float))}}
    if rank == 0:
        from rtd_scale.training.checkpoint.files import torch_save
        from rtd_scale.training.reshard import INFO_FILE, STATE_FILE

        torch_save(state, os.path.join(out_dir, STATE_FILE))
        with open(os.path.join(out_dir, INFO_FILE), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1, sort_keys=True)


def consolidate_training_state(run_dir: str, tag: str, out_dir: str,
                               tokenizer_model: Optional[str] = None,
                               timeout_s: float = 3600.0) -> None:
    """Write ``run_dir``'s checkpoint ``tag`` as one layout-free training state into
    ``out_dir`` (``state.pt``: fp32 master weights and both AdamW moments under canonical
    names, ``training_state.json``: the AdamW step and loss scaler), read by restarting its
    recorded world as local gloo processes that load it exactly as ``--load`` at its own layout
    would (``training/reshard.py`` loads it at another layout).

    Raises:
        UserInputError: a missing or foreign checkpoint, a tokenizer that cannot be found, a
            state that cannot be read per parameter.
    """
    cfg, layout, ds_config, tag = _read_run_with_tokenizer(run_dir, tag, tokenizer_model)
    _run_world(int(layout["world_size"]), run_dir, tag, cfg,
               ds_config_for_layout(ds_config, cfg, layout), out_dir, "training", timeout_s)
