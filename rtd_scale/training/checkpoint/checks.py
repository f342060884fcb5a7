"""The checks a checkpoint passes before its weights are used: one list, ``CHECKS``, that every
reader runs — training's ``--load`` at its own layout (``load.load``) and at another
(``convert.py``, ``layout_free.py``), and the export (``hf/consolidate.py``) — each check at its
moment:

==================  ============  ==========================================================
check               moment        refuses
==================  ============  ==========================================================
``complete``        CHOOSE        a checkpoint without its completion record, or a file of it
                                  missing or of another size than the record lists (truncated);
                                  ``choose.choose`` passes over it for an older complete one
``safe_pickles``    BEFORE_BUILD  a ``.pt`` file whose pickle holds more than tensors and
                                  DeepSpeed's allow-listed records (a crafted file: refused in
                                  one line on every rank, nothing of it runs)
``weights_only``    LOAD          any file DeepSpeed then reads that is not plain data or is
                                  unreadable (its reads go through ``files.safe_load``)
``files_found``     AFTER_LOAD    a tag DeepSpeed found no files for
``finite_weights``  AFTER_LOAD    loaded weights holding inf or NaN: a file damaged in place
                                  keeps its size, so ``complete`` cannot see it
==================  ============  ==========================================================

Moments: CHOOSE while the checkpoint is picked (no torch needed: the Slurm launcher asks too);
BEFORE_BUILD on the chosen directory, before any process group, model or engine exists; LOAD
on the DeepSpeed engine, before it reads a file; AFTER_LOAD on the loaded engine, before the
first step (training) or gather (export). ``load.take`` runs CHOOSE and BEFORE_BUILD,
``load.load_checked`` LOAD and AFTER_LOAD around DeepSpeed's load; a conversion to another
layout runs BEFORE_BUILD on what it wrote (``convert.check_safe``), and the layout-free load
(``layout_free.load``) LOAD and AFTER_LOAD around its own.

Not in the list: whether a checkpoint fits this run's flags (``compat.check_compatible``:
layout, model shape, seed) — that compares it with a run config, which only training has.
"""
from __future__ import annotations

import enum
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.checkpoint import files

# How a reader's refusal tells the user to take another checkpoint (training's; the export
# passes its own words).
RESUME_EARLIER = "resume from an earlier checkpoint (--load DIR/global_stepN)"


class Moment(enum.Enum):
    CHOOSE = "choose"
    BEFORE_BUILD = "before_build"
    LOAD = "load"
    AFTER_LOAD = "after_load"


# ------------------------------------------------------------------------------ CHOOSE ----

def incomplete_reason(ckpt_dir: str) -> Optional[str]:
    """Why ``ckpt_dir`` does not count as complete, or None when it does: its completion record
    is missing or unreadable (the save did not finish), or a file it lists is missing or of
    another size."""
    if not os.path.exists(os.path.join(ckpt_dir, files.RECORD_FILE)):
        return "no completion record (the save did not finish)"
    record = files.read_record(ckpt_dir)
    if record is None:
        return "its completion record is unreadable"
    for name, size in sorted(record["files"].items()):
        try:
            actual = os.path.getsize(os.path.join(ckpt_dir, name))
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, its completion record says {size}"
    return None


# ------------------------------------------------------------------------ BEFORE_BUILD ----

def check_safe_to_load(ckpt_dir: str) -> None:
    """Refuse a checkpoint any of whose ``.pt`` files holds more than tensors and DeepSpeed's
    allow-listed records, before anything is loaded. Zip files (what ``torch.save`` writes) are
    checked by listing their pickle's globals, which reads no tensor data; other files are
    loaded with ``files.safe_load``.

    Raises:
        UserInputError: naming the file (every rank checks the same files and raises the same
            error, so rank 0 alone prints it).
    """
    try:
        _check_safe_to_load(ckpt_dir)
    except files.CheckpointReadError as e:
        raise UserInputError(str(e)) from None


def _check_safe_to_load(ckpt_dir: str) -> None:
    import torch

    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        if not zipfile.is_zipfile(path):
            files.safe_load(path)
            continue
        with torch.serialization.safe_globals(files.deepspeed_safe_globals()):
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except (RuntimeError, ValueError, KeyError, zipfile.BadZipFile) as e:
                raise files.CheckpointReadError(
                    f"{path}: unreadable ({str(e).splitlines()[0]}); resume from another "
                    "checkpoint (--load DIR/global_stepN)") from None
        if unsafe:
            raise files.refused(path, "GLOBAL " + ", ".join(sorted(unsafe)))


# -------------------------------------------------------------------------------- LOAD ----

def read_weights_only(engine) -> None:
    """Every file ``engine.load_checkpoint`` reads from now on goes through
    ``files.safe_load`` (``files.install_safe_loading``)."""
    files.install_safe_loading(engine)


# -------------------------------------------------------------------------- AFTER_LOAD ----

def check_files_found(engine, ckpt_dir: str, loaded: Optional[str], flag: str,
                      earlier: str = RESUME_EARLIER) -> None:
    """Refuse a load that found nothing: DeepSpeed's ``load_checkpoint`` returns no path then.

    Raises:
        UserInputError: naming ``flag`` and the tag.
    """
    if loaded is None:
        raise UserInputError(f"{flag}: DeepSpeed could not load {os.path.basename(ckpt_dir)}")


def check_finite_weights(engine, ckpt_dir: str, loaded: Optional[str] = None,
                         flag: str = "--load", earlier: str = RESUME_EARLIER) -> None:
    """Refuse a loaded checkpoint whose weights hold inf or NaN.

    The completion record checks every file's size, not its bytes: a file damaged in place (a
    bad disk block, a partial overwrite) loads, and the run then fails on its first step as if
    the learning rate were too high. Each rank counts the non-finite values of its own
    parameters (its ZeRO-3 partition), one all-reduce sums the counts: every rank raises the
    same error, before any step. Only then, to name the damaged file, each rank counts the
    non-finite values of the files it read (:func:`_damaged_file`).

    Raises:
        UserInputError: naming the damaged file (or the checkpoint, when no file it read holds
            the values), the counts and the fix (``earlier``, then deleting the checkpoint).
    """
    import torch
    import torch.distributed as dist

    bad = torch.zeros((), dtype=torch.int64, device=engine.device)
    for p in engine.module.parameters():
        local = getattr(p, "ds_tensor", None)  # ZeRO-3 keeps this rank's partition there
        t = local if local is not None else p.data
        if t.numel():
            bad += (~torch.isfinite(t)).sum()
    if dist.is_initialized():
        dist.all_reduce(bad)
    count = int(bad.item())  # once, at load: not in the step
    if not count:
        return
    damaged = _damaged_file(engine)
    fix = f"{earlier} or delete {ckpt_dir}"
    if damaged is None:
        raise UserInputError(
            f"{ckpt_dir}: the loaded weights hold {count} inf/NaN value(s): a file of this "
            f"checkpoint is damaged although its size matches the completion record; {fix}")
    path, in_file = damaged
    raise UserInputError(
        f"{path}: damaged: it holds {in_file} inf/NaN value(s) although its size matches the "
        f"completion record (the loaded weights hold {count}); {fix}")


def non_finite(value: Any) -> int:
    """The inf and NaN values of every floating tensor in ``value`` (nested dicts, lists),
    each storage counted once: tensors sharing one (tied parameters, views) are one copy in
    the file (``torch.save`` writes each storage once)."""
    import torch

    storages: dict[int, Any] = {}

    def walk(v: Any) -> None:
        if torch.is_tensor(v):
            if v.is_floating_point():
                storages.setdefault(v.untyped_storage().data_ptr(), v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    return sum(int((~torch.isfinite(torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())))
                   .sum()) for t in storages.values())


def _damaged_file(engine) -> Optional[tuple[str, int]]:
    """(path, non-finite count) of the first file holding inf or NaN among those the ranks read
    through ``files.SafeCheckpointEngine`` (lowest rank first), or None. Collective."""
    import torch.distributed as dist

    ce = getattr(engine, "checkpoint_engine", None)
    mine = None
    for path in getattr(ce, "read", []):
        n = non_finite(files.safe_load(path))
        if n:
            mine = (path, n)
            break
    if not dist.is_initialized():
        return mine
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return next((f for f in every if f is not None), None)


# -------------------------------------------------------------------------------- list ----

@dataclass(frozen=True)
class Check:
    """One check: its name, its moment and the function that runs it. The function's arguments
    are its moment's: CHOOSE ``(ckpt_dir)`` → the reason it fails, or None; BEFORE_BUILD ``(ckpt_dir)``; LOAD ``(engine)``; AFTER_LOAD ``(engine, ckpt_dir,
    loaded, flag, earlier)`` (``loaded``: the path DeepSpeed returned, or None). All but CHOOSE
    raise ``UserInputError``."""

    name: str
    moment: Moment
    run: Callable[..., Any]


CHECKS: tuple[Check, ...] = (
    Check("complete", Moment.CHOOSE, incomplete_reason),
    Check("safe_pickles", Moment.BEFORE_BUILD, check_safe_to_load),
    Check("weights_only", Moment.LOAD, read_weights_only),
    Check("files_found", Moment.AFTER_LOAD, check_files_found),
    Check("finite_weights", Moment.AFTER_LOAD, check_finite_weights),
)


def verdict(ckpt_dir: str) -> Optional[str]:
    """The CHOOSE checks of ``ckpt_dir``: the first failing one's reason, or None when all
    pass."""
    for check in CHECKS:
        if check.moment is Moment.CHOOSE:
            reason = check.run(ckpt_dir)
            if reason is not None:
                return reason
    return None


def run(moment: Moment, **args: Any) -> None:
    """Run every check of ``moment`` (not CHOOSE: :func:`verdict`) with that moment's arguments,
    in ``CHECKS``' order; the first refusal raises."""
    assert moment is not Moment.CHOOSE, "CHOOSE checks give a verdict: checks.verdict"
    for check in CHECKS:
        if check.moment is moment:
            check.run(**args)
