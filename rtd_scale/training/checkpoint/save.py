"""The collective save: DeepSpeed's files, every rank's RNG file, ``rtd_meta.json``, then the
completion record and ``latest`` once every rank has written and fsynced (package docstring:
completeness); a failed write on any rank is one line on every rank."""
from __future__ import annotations

import errno
import json
import os
import shutil
from typing import Any, Optional

from rtd_scale.atomic import write_atomic
from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.checkpoint import files
from rtd_scale.training.checkpoint.checks import incomplete_reason
from rtd_scale.training.faults import hold_in_save


def _rng_state() -> dict[str, Any]:
    import torch
    from megatron.core import tensor_parallel

    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _checkpoint_bytes(ckpt_dir: str) -> int:
    record = files.read_record(ckpt_dir)
    if record is not None:
        return sum(record["files"].values())
    return sum(os.path.getsize(os.path.join(root, n))
               for root, _, names in os.walk(ckpt_dir) for n in names)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


class _Agreement:
    """Failures on any rank, made known to every rank at fixed points of the save (collective:
    every rank calls :meth:`check` the same number of times)."""

    def __init__(self):
        self.failures: list[tuple[str, OSError]] = []

    def attempt(self, path: str, fn, *args) -> None:
        try:
            fn(*args)
        except OSError as e:
            self.failures.append((path, e))

    def check(self) -> Optional[tuple[str, int, str]]:
        """The first failure of the lowest failing rank, (path, errno, strerror), or None."""
        import torch
        import torch.distributed as dist

        mine = None
        if self.failures:
            path, e = self.failures[0]
            mine = (path, e.errno or 0, e.strerror or str(e))
        if not (dist.is_available() and dist.is_initialized()):
            return mine
        flag = torch.tensor([1 if mine else 0], dtype=torch.int64,
                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return None
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return next(f for f in every if f is not None)


def _previous_complete(save_dir: str, tag: str) -> Optional[str]:
    return next((t for t in files.list_tags(save_dir)
                 if t != tag and incomplete_reason(os.path.join(save_dir, t)) is None), None)


def _save_failed(save_dir: str, tag: str, failure: tuple[str, int, str], rank: int,
                 needed: int) -> UserInputError:
    """One line for every rank to raise; rank 0 also removes the partial directory."""
    path, code, strerror = failure
    ckpt_dir = os.path.join(save_dir, tag)
    if rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    previous = _previous_complete(save_dir, tag)
    keep = (f"--load {save_dir} takes {previous}" if previous
            else "no complete checkpoint there yet")
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(save_dir).free
        what = (f"no space left on the device of {save_dir} while writing {path}: "
                f"{_human(free)} free, a checkpoint needs about {_human(needed)} "
                f"({'the size of ' + previous if previous else 'estimated from the parameters'})"
                f"; free at least {_human(max(needed - free, 0))}")
    else:
        what = f"cannot write {path} ({strerror})"
    return UserInputError(f"--save {save_dir}: {what}; the partial {tag} was removed and "
                          f"{keep}")


def _needed_bytes(engine, save_dir: str, tag: str) -> int:
    """About how much one checkpoint takes: the previous complete one's size, else fp32
    weights, fp32 master copy and two Adam moments per parameter (16 bytes)."""
    previous = _previous_complete(save_dir, tag)
    if previous is not None:
        return _checkpoint_bytes(os.path.join(save_dir, previous))
    params = {id(p): p for p in engine.module.parameters()}.values()
    return 16 * sum(getattr(p, "ds_numel", p.numel()) for p in params)


def save(engine, save_dir: str, *, step: int, client_state: dict[str, Any], rank: int,
         layout: Optional[dict[str, int]] = None) -> str:
    """Save after optimizer step ``step``; returns the checkpoint directory. Collective.

    Order: rank 0 removes an old record of the same tag; DeepSpeed writes its files (without
    ``latest``); each rank writes its RNG file and rank 0 ``rtd_meta.json``; each rank fsyncs
    what it wrote; all agree that every rank succeeded; rank 0 writes the completion record (each
    file's size), then ``latest``, each fsynced with its directory.

    Raises:
        UserInputError: on every rank, when any rank could not write (a full disk: naming the
            path, the free space and what a checkpoint needs); the partial directory is
            removed and the previous complete checkpoint stays the one ``--load`` takes.
    """
    import torch.distributed as dist

    tag = files.tag_for(step)
    ckpt_dir = os.path.join(save_dir, tag)
    ce = files.install_safe_loading(engine)
    ce.written, ce.failures = [], []
    agree = _Agreement()
    record_path = os.path.join(ckpt_dir, files.RECORD_FILE)
    if rank == 0 and os.path.exists(record_path):
        os.remove(record_path)  # before any rank rewrites a file
        files.fsync(ckpt_dir)
    if dist.is_initialized():
        dist.barrier()
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    agree.failures += ce.failures
    if not agree.failures:
        rng_path = os.path.join(ckpt_dir, files.rng_file(rank))
        agree.attempt(rng_path, files.write_torch, rng_path, _rng_state())
        ce.written.append(rng_path)
        if rank == 0:
            # what a resume reads before anything is built: the layout and precision it must
            # match or convert from (the ds_config restarts this layout, checkpoint/convert.py)
            # and the data it was trained on (compat.check_same_data)
            ds_config = getattr(engine, "config", None)
            meta = {"step": step, "consumed_samples": client_state.get("consumed_samples"),
                    "layout": layout or {}, "config": client_state.get("config", {}),
                    "data": client_state.get("data"),
                    "ds_config": ds_config if isinstance(ds_config, dict) else None,
                    "record_format": files.RECORD_FORMAT}
            meta_path = os.path.join(ckpt_dir, files.META_FILE)
            agree.attempt(meta_path, write_atomic, meta_path,
                          json.dumps(meta, indent=2, sort_keys=True) + "\n")
            ce.written.append(meta_path)
        for path in ce.written:
            agree.attempt(path, files.fsync, path)
    hold_in_save(step, rank)  # tests only: a kill during the save (training/faults.py)
    failure = agree.check()
    if failure is None and rank == 0:
        agree.attempt(record_path, files.write_record, ckpt_dir, step)
        agree.attempt(os.path.join(save_dir, "latest"), files.write_latest, save_dir, tag)
    failure = failure or agree.check()
    if failure is not None:
        raise _save_failed(save_dir, tag, failure, rank, _needed_bytes(engine, save_dir, tag))
    return ckpt_dir
