"""A checkpoint's files: their names and formats, reading them with ``weights_only=True`` and
writing them so that a failed write says why (``OSError``), and the checkpoint engine through
which DeepSpeed reads and writes its own."""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
import zipfile
from typing import Any, Optional

from rtd_scale.atomic import write_atomic
from rtd_scale.cli_errors import UserInputError

META_FILE = "rtd_meta.json"
RECORD_FILE = "rtd_complete.json"
RECORD_FORMAT = 1  # the completion record's format, also written into rtd_meta.json
_TAG_RE = re.compile(r"^global_step(\d+)$")


class CheckpointReadError(UserInputError):
    """A checkpoint file that cannot or must not be read (truncated, or not plain tensors).

    Raised on the rank that reads the file, which may not be rank 0, so the entry point prints
    it on every rank (``every_rank``)."""

    every_rank = True


def tag_for(step: int) -> str:
    return f"global_step{step}"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


def step_of(tag: str) -> Optional[int]:
    """N of ``global_step<N>``; None for any other name."""
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def list_tags(save_dir: str) -> list[str]:
    """The ``global_step<N>`` directories in ``save_dir``, newest (largest N) first."""
    if not os.path.isdir(save_dir):
        return []
    tags = [t for t in os.listdir(save_dir)
            if step_of(t) is not None and os.path.isdir(os.path.join(save_dir, t))]
    return sorted(tags, key=step_of, reverse=True)


def holds_run(save_dir: str) -> Optional[str]:
    """What makes ``save_dir`` an earlier run's directory (its newest checkpoint directory, or
    ``latest``), or None for a fresh directory."""
    tags = list_tags(save_dir)
    if tags:
        return tags[0]
    return "latest" if os.path.isfile(os.path.join(save_dir, "latest")) else None


def latest_tag(load_dir: str) -> Optional[str]:
    """The tag in ``<load_dir>/latest`` when that directory exists, else None (informative
    only: ``choose.choose`` decides what ``--load`` takes)."""
    path = os.path.join(load_dir, "latest")
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if tag and os.path.isdir(os.path.join(load_dir, tag)) else None


def read_json(path: str) -> Optional[dict[str, Any]]:
    """The JSON object in ``path``; None when absent, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_record(ckpt_dir: str) -> Optional[dict[str, Any]]:
    """The completion record of ``ckpt_dir``; None when absent or unreadable."""
    record = read_json(os.path.join(ckpt_dir, RECORD_FILE))
    ok = (record is not None and isinstance(record.get("files"), dict)
          and all(isinstance(v, int) for v in record["files"].values()))
    return record if ok else None


def read_meta(load_dir: str, tag: str) -> Optional[dict[str, Any]]:
    """The checkpoint's ``rtd_meta.json`` (step, consumed samples, layout, config), or None."""
    path = os.path.join(load_dir, tag, META_FILE)
    if not os.path.isfile(path):
        return None
    meta = read_json(path)
    if meta is None:
        raise CheckpointReadError(f"{path}: unreadable (not a JSON object); resume from "
                                  "another checkpoint (--load DIR/global_stepN)")
    return meta


# ------------------------------------------------------------------------------ reading ----

def deepspeed_safe_globals() -> list:
    """The classes DeepSpeed's own checkpoint files hold besides tensors and containers
    (found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO 0–3, fp32 and
    bf16, TP and PP checkpoints of DeepSpeed 0.19.8). Each is a plain record: unpickling builds
    it from its fields and runs none of its code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def refused(path: str, detail: str) -> CheckpointReadError:
    """The one line for a file that holds more than tensors and DeepSpeed's records."""
    return CheckpointReadError(
        f"{path}: refused to load: it holds Python objects other than tensors and DeepSpeed's "
        f"state ({detail}), which could run code when read; replace it with a trusted copy or "
        "resume from another checkpoint (--load DIR/global_stepN)")


def safe_load(path: str, map_location: Any = "cpu", *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's few record classes allowed;
    ``mmap``: tensors stay in the file until read (``torch.load``'s ``mmap``).

    Raises:
        CheckpointReadError: the file holds other Python objects (a crafted pickle: refused,
            nothing of it runs), or it is truncated or not a torch file.
    """
    import torch

    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as e:
            found = re.search(r"(GLOBAL [\w.]+|Unsupported operand \d+|[\w ]+ is not supported)",
                              str(e))
            raise refused(path, found.group(1) if found else "not plain data") from None
        except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointReadError(
                f"{path}: unreadable ({first}); resume from another checkpoint "
                "(--load DIR/global_stepN)") from None


# ------------------------------------------------------------------------------ writing ----

def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(obj: Any, path: str, **kwargs) -> None:
    """``torch.save(obj, path)``, except that a failed write raises its ``OSError`` (a full
    disk: ``ENOSPC``); torch's own file writer reports it as an opaque ``RuntimeError``
    ("unexpected pos …")."""
    import torch

    errors: list[OSError] = []
    with open(path, "wb") as f:
        class Writer:
            def write(self, data):
                try:
                    return f.write(data)
                except OSError as e:
                    errors.append(e)
                    raise

            def flush(self):
                f.flush()

        try:
            torch.save(obj, Writer(), **kwargs)
        except RuntimeError:
            if errors:
                raise errors[0] from None
            raise


def write_torch(path: str, obj: Any) -> None:
    """``obj`` into ``path`` through a temporary sibling: ``path`` is whole or absent."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        torch_save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_record(ckpt_dir: str, step: int) -> None:
    """The completion record: every file of ``ckpt_dir`` with its size; fsynced."""
    files = {}
    for root, _, names in os.walk(ckpt_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), ckpt_dir)
            if rel != RECORD_FILE:
                files[rel] = os.path.getsize(os.path.join(root, n))
    record = {"format": RECORD_FORMAT, "tag": os.path.basename(ckpt_dir), "step": step,
              "files": dict(sorted(files.items())), "bytes": sum(files.values())}
    path = os.path.join(ckpt_dir, RECORD_FILE)
    write_atomic(path, json.dumps(record, indent=1) + "\n")
    fsync(path)
    fsync(ckpt_dir)


def write_latest(save_dir: str, tag: str) -> None:
    path = os.path.join(save_dir, "latest")
    write_atomic(path, tag)
    fsync(path)
    fsync(save_dir)


# ------------------------------------------------------- DeepSpeed's checkpoint engine ----

class SafeCheckpointEngine:
    """Wraps the DeepSpeed engine's checkpoint engine: loads go through :func:`safe_load`
    (DeepSpeed's own engine unpickles with ``weights_only=False``) and are remembered (``read``:
    the check of finite weights names the damaged file among them); saves are remembered, so
    each rank can fsync what it wrote, and an ``OSError`` while writing (a full disk) is kept
    for ``save.save`` to report on every rank instead of leaving the other ranks waiting in
    DeepSpeed's barrier. Everything else is the wrapped engine's."""

    def __init__(self, inner):
        self.inner = inner
        self.written: list[str] = []
        self.read: list[str] = []
        self.failures: list[tuple[str, OSError]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save(self, state_dict, path: str):
        try:
            if type(self.inner).__name__ == "TorchCheckpointEngine":  # what it does, plus errno
                torch_save(state_dict, path, _use_new_zipfile_serialization=getattr(
                    self.inner, "zipfile_serialization", True))
            else:
                self.inner.save(state_dict, path)
            self.written.append(path)
        except OSError as e:
            self.failures.append((path, e))
        except RuntimeError as e:  # torch's writer hides the OSError of another engine's file
            self.failures.append((path, OSError(errno.EIO, str(e).strip().splitlines()[0])))

    def makedirs(self, path, exist_ok=False):
        try:
            self.inner.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self.failures.append((path, e))

    def load(self, path: str, map_location=None):
        self.read.append(path)
        return safe_load(path, map_location=map_location)


def install_safe_loading(engine) -> SafeCheckpointEngine:
    """Make every later ``engine.load_checkpoint`` read its files with ``weights_only=True``
    (and every ``engine.save_checkpoint`` report write errors to ``save.save``); idempotent."""
    ce = engine.checkpoint_engine
    if not isinstance(ce, SafeCheckpointEngine):
        ce = engine.checkpoint_engine = SafeCheckpointEngine(ce)
        copy_script = engine._copy_recovery_script  # rank 0 copies zero_to_fp32.py: may fail too

        def copy_recovery_script(save_path):
            try:
                copy_script(save_path)
            except OSError as e:
                ce.failures.append((save_path, e))

        engine._copy_recovery_script = copy_recovery_script
    return ce
