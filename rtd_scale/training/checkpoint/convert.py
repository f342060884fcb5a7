"""A checkpoint read at its own layout by a restarted world: the layout-free state ``--load``
slices into a run at another layout or precision (:func:`convert`), and the weights the export
reads (``hf/consolidate.py``).

DeepSpeed's own readers (``zero_to_fp32``, the universal checkpoint) do not merge tensor- or
pipeline-parallel shards by rtd_scale's rules, so the checkpoint's recorded world
(``<tag>/rtd_meta.json``: world size, TP, PP, ZeRO stage; its resolved ds_config) is started again
as local gloo processes (:func:`run_world`, forked from one server that imports torch,
megatron-core and DeepSpeed once). Each builds the model from the recorded config and the
DeepSpeed engine from the recorded ds_config, loads its own files exactly as ``--load`` at that
layout would, through the same checks (``checks.CHECKS``: a checkpoint damaged in place is
refused, not converted), and then they gather (``layout_free``). The cost is that restart
(docs/resume.md#resume-at-another-size).

What :func:`convert` writes, beside the checkpoint, which is only read: ``<load>/<tag>_canonical/``
(``layout_free.STATE_FILE``, ``layout_free.INFO_FILE``), built under
``<load>/.<tag>_canonical.tmp-<pid>`` and renamed into place when complete (a marker file inside
says so), so an interrupted conversion never counts and the next ``--load`` converts again; a
later resume at any other layout reuses a complete one. It passes the BEFORE_BUILD checks of
``checks.CHECKS`` as any checkpoint's files do (:func:`check_safe`).
"""
from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import sys
import time
import traceback
from typing import Any, Callable, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.batch import rank_share
from rtd_scale.config import Precision, RunConfig

DONE_FILE = "rtd_canonical_complete"
# What a worker imports, loaded once by the forkserver that run_world forks its workers from.
WORKER_MODULES = ("rtd_scale.training.checkpoint.convert", "rtd_scale.distributed",
                  "rtd_scale.data.tokenizer", "rtd_scale.model.build",
                  "rtd_scale.training.engine", "rtd_scale.training.checkpoint.load",
                  "rtd_scale.training.checkpoint.checks",
                  "rtd_scale.training.checkpoint.layout_free")


def read_run(run_dir: str, tag: Optional[str], note: Optional[Callable[[Any], None]] = None
             ) -> tuple[RunConfig, dict[str, Any], dict[str, Any], str]:
    """(config, layout, the ds_config it was saved with, tag) of a run directory's checkpoint:
    ``tag``, or the one ``--load run_dir`` would resume from (``load.take``: the newest complete
    checkpoint, its files checked as training's ``--load`` checks them). ``note(choice)`` is
    called with that choice (the export words its notes itself).

    Raises:
        UserInputError: no such run or checkpoint, or a checkpoint without its metadata.
    """
    from rtd_scale.training.checkpoint import compat, files, load

    if not os.path.isdir(run_dir):
        raise UserInputError(f"--load {run_dir}: no such directory; pass the --save directory "
                             "of a run")
    if tag is None and not files.list_tags(run_dir):
        raise UserInputError(f"--load {run_dir}: no checkpoint (no global_step* directory); "
                             "pass the --save directory of a run that saved one")
    if tag is not None and not os.path.isdir(os.path.join(run_dir, tag)):
        tags = files.list_tags(run_dir)
        raise UserInputError(f"--tag {tag}: {run_dir} has no such checkpoint; pass one of "
                             f"{', '.join(tags)}" if tags else
                             f"--tag {tag}: {run_dir} has no checkpoint")
    choice = load.take(os.path.join(run_dir, tag) if tag else run_dir)
    if note is not None:
        note(choice)
    tag = choice.tag
    meta = files.read_meta(run_dir, tag)
    if meta is None or not meta.get("layout") or not meta.get("config"):
        raise UserInputError(f"--load {run_dir}: {tag} has no {files.META_FILE} "
                             "(layout and config); it was not written by rtd_scale")
    cfg = RunConfig.from_dict(meta["config"])
    ds_config = meta.get("ds_config")
    if ds_config is None:  # recorded by every checkpoint since it was added to rtd_meta.json
        ds_path = os.path.join(run_dir, "ds_config.json")
        if not os.path.isfile(ds_path):
            raise UserInputError(f"--load {run_dir}: no ds_config.json (the run's resolved "
                                 "DeepSpeed config, written before its first step)")
        with open(ds_path, encoding="utf-8") as f:
            ds_config = ds_config_for_layout(json.load(f), cfg, meta["layout"])
    return cfg, meta["layout"], ds_config, tag


def ds_config_for_layout(ds_config: dict[str, Any], cfg: RunConfig,
                         layout: dict[str, Any]) -> dict[str, Any]:
    """``ds_config`` (a run directory's resolved ``ds_config.json``, written by the newest run
    there, perhaps at another layout or precision) as the run that saved a checkpoint at
    ``layout`` with config ``cfg`` had it: that ZeRO stage, precision and the batch numbers of
    that data-parallel and pipeline size (``training/ds_config.resolve_ds_config``'s rule)."""
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
    out["bf16"] = {**out.get("bf16", {}), "enabled": t.precision is Precision.BF16}
    if t.precision is Precision.FP16:
        out["fp16"] = {**out.get("fp16", {}), "enabled": True}
    else:
        out.pop("fp16", None)
    return out


def read_run_with_tokenizer(run_dir: str, tag: Optional[str], tokenizer_model: Optional[str],
                            note: Optional[Callable[[Any], None]] = None):
    """:func:`read_run`, with the tokenizer moved to ``tokenizer_model`` when given, and refused
    in one line when it is not there."""
    cfg, layout, ds_config, tag = read_run(run_dir, tag, note)
    if tokenizer_model:
        cfg.data.tokenizer_model = tokenizer_model
    if not cfg.data.tokenizer_model or not os.path.isfile(cfg.data.tokenizer_model):
        raise UserInputError(f"--load {run_dir}: the run's tokenizer {cfg.data.tokenizer_model!r} "
                             "is not there; pass --tokenizer-model PATH")
    return cfg, layout, ds_config, tag


# ------------------------------------------------------------------- the restarted world ----

def _worker(rank: int, world_size: int, port: int, run_dir: str, tag: str, cfg_dict: dict,
            ds_config: dict, out_dir: str, what: str, earlier: str, environ: dict) -> None:
    os.environ.clear()  # the caller's environment at run_world, as spawn would give it
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    result: Any = None
    try:
        from rtd_scale import distributed
        from rtd_scale.data.tokenizer import Tokenizer
        from rtd_scale.model.build import build_model
        from rtd_scale.training import engine as engine_mod
        from rtd_scale.training.checkpoint import layout_free, load

        cfg = RunConfig.from_dict(cfg_dict)
        tok = Tokenizer(cfg.data.tokenizer_model)
        ctx = distributed.initialize(cfg.parallel, seed=cfg.train.seed)
        try:
            model = build_model(cfg, ctx, tok)
            eng = engine_mod.build_engine(  # the CPU Adam note (ZeRO-Offload) from one worker
                model, cfg, ds_config, distributed.DeepSpeedMpu(),
                print_fn=functools.partial(print, file=sys.stderr, flush=True) if rank == 0
                else None)
            # the LOAD and AFTER_LOAD checks of training's --load: safe unpickling, the files
            # found, the weights finite (a checkpoint damaged in place is refused)
            load.load_checked(eng, run_dir, tag, flag=f"--load {run_dir}", earlier=earlier,
                              load_lr_scheduler_states=False)
            if what == "training":
                layout_free.write(eng, model, ctx, cfg.model.vocab_size, out_dir, rank)
            else:
                state = layout_free.gather_full_state(eng, model, ctx, cfg.model.vocab_size,
                                                      keep=rank == 0)
                if rank == 0:
                    torch.save(state, os.path.join(out_dir, layout_free.STATE_FILE))
            result = ("ok", None)
        finally:
            distributed.teardown()
    except UserInputError as e:
        result = ("user", str(e))
    except BaseException:  # noqa: BLE001 — reported to the parent
        result = ("error", traceback.format_exc())
    # this process's peak resident size (Linux: kilobytes), what the conversion costs a rank
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump([*result, peak_gb], f)


def run_world(run_dir: str, tag: str, cfg: RunConfig, layout: dict[str, Any],
              ds_config: dict[str, Any], out_dir: str, *, what: str, earlier: str,
              timeout_s: float = 3600.0) -> float:
    """Start the checkpoint's world (``layout["world_size"]`` local gloo processes), each loading
    its own files; ``what``: "training" writes the layout-free state (``layout_free.write``),
    "weights" the canonical fp32 weights alone (``state.pt``), into ``out_dir``. ``earlier``:
    how a refusal tells the user to take another checkpoint. Returns the largest process's peak
    resident size in GB. Raises what any worker raised."""
    from rtd_scale.launch_env import free_port, start_forked_workers

    world = int(layout["world_size"])
    procs = start_forked_workers(
        _worker, (world, free_port(), os.path.abspath(run_dir), tag, cfg.to_dict(), ds_config,
                  out_dir, what, earlier, dict(os.environ)), world, WORKER_MODULES)
    deadline = time.monotonic() + timeout_s
    while not procs.join(max(1.0, deadline - time.monotonic())):  # returns as each ends
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            break
    peak = 0.0
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        if not os.path.isfile(path):
            raise RuntimeError(f"checkpoint worker {r} of {world} produced no result")
        with open(path, encoding="utf-8") as f:
            status, detail, peak_gb = json.load(f)
        os.remove(path)
        if status == "user":
            raise UserInputError(detail)
        if status != "ok":
            raise RuntimeError(f"checkpoint worker {r} failed:\n{detail}")
        peak = max(peak, peak_gb)
    return peak


def write_training_state(run_dir: str, tag: str, out_dir: str,
                         tokenizer_model: Optional[str] = None) -> float:
    """Write ``run_dir``'s checkpoint ``tag`` as one layout-free training state into
    ``out_dir``, read by restarting its recorded world (:func:`run_world`). Returns the largest
    of its processes' peak resident size (GB).

    Raises:
        UserInputError: a missing or foreign checkpoint, a tokenizer that cannot be found, a
            state that cannot be read per parameter.
    """
    from rtd_scale.training.checkpoint.checks import RESUME_EARLIER

    cfg, layout, ds_config, tag = read_run_with_tokenizer(run_dir, tag, tokenizer_model)
    return run_world(run_dir, tag, cfg, layout, ds_config, out_dir, what="training",
                     earlier=RESUME_EARLIER)


# ------------------------------------------------------------- beside the checkpoint ----

def root(load_dir: str, tag: str) -> str:
    """The directory holding the layout-free state of ``<load_dir>/<tag>``."""
    return os.path.join(load_dir, f"{tag}_canonical")


def is_converted(load_dir: str, tag: str) -> bool:
    """Whether ``<load_dir>/<tag>``'s layout-free state is complete (its marker written last,
    just before it was renamed into place)."""
    return os.path.isfile(os.path.join(root(load_dir, tag), DONE_FILE))


def _line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[-1]


def convert(load_dir: str, tag: str, tokenizer_model: Optional[str] = None,
            write: Callable[..., Optional[float]] = write_training_state
            ) -> tuple[str, float, bool, Optional[float]]:
    """Write (or reuse) the layout-free training state of ``<load_dir>/<tag>``; one process
    only. Returns (its directory, seconds spent, whether it was converted now rather than
    reused, the largest converting process's peak resident size in GB or None).
    ``write(load_dir, tag, tmp, tokenizer_model)`` fills the temporary directory
    (:func:`write_training_state`) and returns that peak.

    Raises:
        UserInputError: the conversion failed or the directory is not writable; nothing is
            left under the final name.
    """
    final = root(load_dir, tag)
    if is_converted(load_dir, tag):
        return final, 0.0, False, None
    start = time.perf_counter()
    tmp = os.path.join(load_dir, f".{os.path.basename(final)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        try:
            peak = write(load_dir, tag, tmp, tokenizer_model)
        except UserInputError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as e:  # a worker's traceback: its last line says what failed
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserInputError(
                f"--load {load_dir}: merging the shards of {tag} into one layout-free state "
                f"failed ({_line(e)}); resume at the checkpoint's layout") from None
        with open(os.path.join(tmp, DONE_FILE), "w", encoding="utf-8") as f:
            f.write(f"{tag}\n")
        if os.path.exists(final):  # an incomplete earlier conversion (no marker)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserInputError(
            f"--load {load_dir}: cannot write the layout-free state of {tag} beside it "
            f"({e.strerror or e}); resume at the checkpoint's layout, or make {load_dir} "
            "writable") from None
    return final, time.perf_counter() - start, True, peak


def check_safe(converted: str) -> None:
    """The BEFORE_BUILD checks of ``checks.CHECKS`` on the conversion (a reused one could have
    been replaced), as ``load.take`` runs them on a checkpoint: its ``.pt`` files hold only
    tensors."""
    from rtd_scale.training.checkpoint import checks

    checks.run(checks.Moment.BEFORE_BUILD, ckpt_dir=converted)
