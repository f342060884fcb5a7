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
(docs/resume.md#resume-at-another-size). A ZeRO-3 checkpoint is read without engines: one
process per tensor-parallel rank maps its data-parallel ranks' partition files
(``zero3_files``), with the same checks on them, and merges as the engines would, to the bit;
an engine with its optimizer per rank was more memory than a large model's resume has beside
its waiting ranks (bench/rehearse.py).

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
from rtd_scale.training.checkpoint.choose import START_FRESH

DONE_FILE = "rtd_canonical_complete"
# What a worker imports, loaded once by the forkserver that run_world forks its workers from.
WORKER_MODULES = ("rtd_scale.training.checkpoint.convert", "rtd_scale.distributed",
                  "rtd_scale.data.tokenizer", "rtd_scale.model.build",
                  "rtd_scale.training.engine", "rtd_scale.training.checkpoint.load",
                  "rtd_scale.training.checkpoint.checks",
                  "rtd_scale.training.checkpoint.layout_free",
                  "rtd_scale.training.checkpoint.zero3_files", "deepspeed.utils.zero_to_fp32")


def read_run(run_dir: str, tag: Optional[str], note: Optional[Callable[[Any], None]] = None,
             fresh: str = START_FRESH) -> tuple[RunConfig, dict[str, Any], dict[str, Any], str]:
    """(config, layout, the ds_config it was saved with, tag) of a run directory's checkpoint:
    ``tag``, or the one ``--load run_dir`` would resume from (``load.take``: the newest complete
    checkpoint, its files checked as training's ``--load`` checks them). ``note(choice)`` is
    called with that choice (the export words its notes itself); ``fresh``: what a refusal
    offers besides restoring a checkpoint (``choose.choose``'s; the export's own words).

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
    if tag is not None and not os.path.isdir(os.path.join(run_dir, tag)):
        tags = files.list_tags(run_dir)
        raise UserInputError(f"--tag {tag}: {run_dir} has no such checkpoint; pass one of "
                             f"{', '.join(tags)}" if tags else
                             f"--tag {tag}: {run_dir} has no checkpoint")
    choice = load.take(os.path.join(run_dir, tag) if tag else run_dir, fresh)
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

def partition_files_dp(layout: dict[str, Any]) -> int:
    """The data-parallel size whose ZeRO-3 partition files :func:`run_world` reads without an
    engine (``zero3_files``), or 0 where it restarts the checkpoint's world with its engines
    (ZeRO 0–2: DeepSpeed's flat fragments and per-parameter copies differ by stage and
    precision, and their engines are the size of their model-states, which is small)."""
    if int(layout["zero_stage"]) == 3 and int(layout["pipeline_model_parallel_size"]) == 1:
        return int(layout["data_parallel_size"])
    return 0


def readers(layout: dict[str, Any]) -> str:
    """How many processes :func:`run_world` starts for a checkpoint at ``layout``, and what
    they do, in the words of the conversion's log line."""
    files = partition_files_dp(layout)
    n = int(layout["tensor_model_parallel_size"] if files else layout["world_size"])
    what = "reading its ZeRO-3 partition files" if files else "at its layout"
    return f"{n} {'processes' if n > 1 else 'process'} {what}"


def _from_partition_files(cfg: RunConfig, ctx, ckpt_dir: str, dp_size: int, out_dir: str,
                          what: str, flag: str, earlier: str) -> None:
    """One tensor-parallel rank's part of :func:`run_world` for a ZeRO-3 checkpoint: its
    parameters from the partition files (``zero3_files``), merged over tensor parallel by
    ``layout_free``'s rules on a model built on the meta device. The files' checks (present,
    plain data, of this model, finite) run on every process before any merge, and every
    process raises the lowest rank's refusal: none is left waiting in a collective."""
    import torch
    import torch.distributed as dist

    from rtd_scale.model import weights
    from rtd_scale.model.build import build_on_meta
    from rtd_scale.training.checkpoint import layout_free
    from rtd_scale.training.checkpoint.zero3_files import Zero3Partitions

    model = build_on_meta(cfg, ctx)
    names = {id(p): n for n, p in model.named_parameters()}
    parts, refusal = None, None
    try:
        parts = Zero3Partitions(ckpt_dir, ctx.tp_rank, dp_size, flag=flag, earlier=earlier)
        parts.check_fits({n: p.shape for n, p in model.named_parameters()})
        parts.check_finite()
    except UserInputError as e:
        refusal = str(e)
    refusals: list = [None] * dist.get_world_size()
    dist.all_gather_object(refusals, refusal)
    refusal = next((r for r in refusals if r), None)
    if refusal:
        raise UserInputError(refusal)

    def gather(key: str, keep: bool) -> dict[str, torch.Tensor]:
        return weights.full_state_dict(model, tp_group=ctx.tp_group,
                                       vocab_size=cfg.model.vocab_size, keep=keep,
                                       source=lambda p: parts.tensor(names[id(p)], key))

    if what == "training":
        layout_free.write_kinds(
            gather, layout_free.training_info(parts.adam_step(), parts.loss_scaler()),
            out_dir, ctx.rank)
    else:
        state = gather("fp32", ctx.rank == 0)
        if ctx.rank == 0:
            torch.save(state, os.path.join(out_dir, layout_free.STATE_FILE))


def _from_engines(cfg: RunConfig, ctx, run_dir: str, tag: str, ds_config: dict, out_dir: str,
                  what: str, earlier: str) -> None:
    """One rank's part of :func:`run_world` in the checkpoint's restarted world: the model and
    the DeepSpeed engine from the recorded config and ds_config, its own files loaded as
    training's ``--load`` at that layout loads them, then the gather (``layout_free``)."""
    import torch

    from rtd_scale import distributed
    from rtd_scale.data.tokenizer import Tokenizer
    from rtd_scale.model.build import build_model
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.checkpoint import layout_free, load

    model = build_model(cfg, ctx, Tokenizer(cfg.data.tokenizer_model))
    eng = engine_mod.build_engine(  # the CPU Adam note (ZeRO-Offload) from one worker
        model, cfg, ds_config, distributed.DeepSpeedMpu(),
        print_fn=functools.partial(print, file=sys.stderr, flush=True) if ctx.rank == 0
        else None)
    # the LOAD and AFTER_LOAD checks of training's --load: safe unpickling, the files found,
    # the weights finite (a checkpoint damaged in place is refused)
    load.load_checked(eng, run_dir, tag, flag=f"--load {run_dir}", earlier=earlier,
                      load_lr_scheduler_states=False)
    if what == "training":
        layout_free.write(eng, model, ctx, cfg.model.vocab_size, out_dir, ctx.rank)
    else:
        state = layout_free.gather_full_state(eng, model, ctx, cfg.model.vocab_size,
                                              keep=ctx.rank == 0)
        if ctx.rank == 0:
            torch.save(state, os.path.join(out_dir, layout_free.STATE_FILE))


def _worker(rank: int, world_size: int, port: int, run_dir: str, tag: str, cfg_dict: dict,
            ds_config: dict, out_dir: str, what: str, earlier: str, environ: dict,
            partition_dp: int) -> None:
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

        cfg = RunConfig.from_dict(cfg_dict)
        ctx = distributed.initialize(cfg.parallel, seed=cfg.train.seed)
        try:
            if partition_dp:
                _from_partition_files(cfg, ctx, os.path.join(run_dir, tag), partition_dp,
                                      out_dir, what, f"--load {run_dir}", earlier)
            else:
                _from_engines(cfg, ctx, run_dir, tag, ds_config, out_dir, what, earlier)
            result = ("ok", None)
        finally:
            distributed.teardown()
    except UserInputError as e:
        result = ("user", str(e))
    except BaseException:  # noqa: BLE001 — reported to the parent
        result = ("error", traceback.format_exc())
    _report(out_dir, rank, result)


def _report(out_dir: str, rank: int, result: tuple) -> None:
    """A worker's result for :func:`run_world`, with this process's peak resident size (Linux:
    kilobytes), what the conversion costs a rank."""
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump([*result, peak_gb], f)


def run_world(run_dir: str, tag: str, cfg: RunConfig, layout: dict[str, Any],
              ds_config: dict[str, Any], out_dir: str, *, what: str, earlier: str,
              timeout_s: float = 3600.0, engines: bool = False) -> float:
    """Start the checkpoint's world (``layout["world_size"]`` local gloo processes), each loading
    its own files into its engine — or, for a ZeRO-3 checkpoint, one process per
    tensor-parallel rank reading the partition files without one (:func:`partition_files_dp`);
    ``what``: "training" writes the layout-free state (``layout_free.write``), "weights" the
    canonical fp32 weights alone (``state.pt``), into ``out_dir``. ``earlier``: how a refusal
    tells the user to take another checkpoint. Returns the largest process's peak resident size
    in GB. Raises what any worker raised. ``engines``: restart the world with its engines for
    a ZeRO-3 checkpoint too (the route the partition files' reader is tested against)."""
    from rtd_scale.launch_env import free_port, start_forked_workers

    partition_dp = 0 if engines else partition_files_dp(layout)
    world = int(layout["tensor_model_parallel_size"] if partition_dp else layout["world_size"])
    procs = start_forked_workers(
        _worker, (world, free_port(), os.path.abspath(run_dir), tag, cfg.to_dict(), ds_config,
                  out_dir, what, earlier, dict(os.environ), partition_dp), world,
        WORKER_MODULES)
    deadline = time.monotonic() + timeout_s
    while not procs.join(max(1.0, deadline - time.monotonic())):  # returns as each ends
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            break
    results = []
    for r in range(world):  # every result file read and removed before any is raised
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                results.append(json.load(f))
            os.remove(path)
        else:
            results.append(["missing", None, 0.0])
    for r, (status, detail, _) in enumerate(results):
        if status == "user":
            raise UserInputError(detail)
        if status == "missing":
            raise RuntimeError(f"checkpoint worker {r} of {world} produced no result")
        if status != "ok":
            raise RuntimeError(f"checkpoint worker {r} failed:\n{detail}")
    return max(peak for _, _, peak in results)


def write_training_state(run_dir: str, tag: str, out_dir: str,
                         tokenizer_model: Optional[str] = None, *, engines: bool = False
                         ) -> float:
    """Write ``run_dir``'s checkpoint ``tag`` as one layout-free training state into
    ``out_dir``, read by restarting its recorded world (:func:`run_world`; ``engines`` as
    there). Returns the largest of its processes' peak resident size (GB).

    Raises:
        UserInputError: a missing or foreign checkpoint, a tokenizer that cannot be found, a
            state that cannot be read per parameter.
    """
    from rtd_scale.training.checkpoint.checks import RESUME_EARLIER

    cfg, layout, ds_config, tag = read_run_with_tokenizer(run_dir, tag, tokenizer_model)
    return run_world(run_dir, tag, cfg, layout, ds_config, out_dir, what="training",
                     earlier=RESUME_EARLIER, engines=engines)


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
