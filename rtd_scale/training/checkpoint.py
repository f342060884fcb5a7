"""Checkpoints through DeepSpeed, plus what a resumed run needs to continue exactly, and the
rules that decide which checkpoint ``--load`` takes.

Layout: ``<save>/global_step<N>/`` holds DeepSpeed's model and optimizer states (ZeRO partitions
included), one ``rng_rank<R>.pt`` per rank (that rank's generator states: dropout),
``rtd_meta.json`` (step, consumed samples, process layout, resolved config) and, written last,
the completion record ``rtd_complete.json``. ``<save>/latest`` names the newest tag for
DeepSpeed's own tools (``zero_to_fp32.py``); rtd_scale writes it after the record and never
trusts it on load.

Completeness. A checkpoint counts only when its record is there and every file it lists has the
listed size. The record is written by rank 0 after every rank has written and fsynced its files
(an all-reduce tells rank 0 they all did), and before ``latest``; a save that dies at any point
before it leaves a directory that ``--load`` skips. A checkpoint rewritten under the same tag
loses its record before its first file is touched. Sizes catch truncation and missing files, not
flipped bytes (no checksums: hashing a 100 GB checkpoint would cost minutes per save).

Safe loading. Every file is read with ``torch.load(weights_only=True)``: rtd_scale's own and
DeepSpeed's, through a checkpoint engine installed on the DeepSpeed engine, with only the few
DeepSpeed classes its optimizer states hold allow-listed (``_DEEPSPEED_SAFE_GLOBALS``). Before
anything is built, every ``.pt`` file of the chosen checkpoint is checked the same way (the
pickle's globals, without reading the tensors), so a crafted file is refused in one line on
every rank instead of on the one rank that happens to read it.
"""
from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from typing import Any, Optional

from rtd_scale.atomic import write_atomic
from rtd_scale.cli_errors import UserInputError

# torch, DeepSpeed and megatron-core are imported where used: choosing a checkpoint needs none
# of them (the Slurm launcher asks which one --load would take before it starts the ranks).

META_FILE = "rtd_meta.json"
RECORD_FILE = "rtd_complete.json"
RECORD_FORMAT = 1  # also written into rtd_meta.json: its absence marks a checkpoint made before
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


def _step_of(tag: str) -> Optional[int]:
    m = _TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def list_tags(save_dir: str) -> list[str]:
    """The ``global_step<N>`` directories in ``save_dir``, newest (largest N) first."""
    if not os.path.isdir(save_dir):
        return []
    tags = [t for t in os.listdir(save_dir)
            if _step_of(t) is not None and os.path.isdir(os.path.join(save_dir, t))]
    return sorted(tags, key=_step_of, reverse=True)


def holds_run(save_dir: str) -> Optional[str]:
    """What makes ``save_dir`` an earlier run's directory (its newest checkpoint directory, or
    ``latest``), or None for a fresh directory."""
    tags = list_tags(save_dir)
    if tags:
        return tags[0]
    return "latest" if os.path.isfile(os.path.join(save_dir, "latest")) else None


def latest_tag(load_dir: str) -> Optional[str]:
    """The tag in ``<load_dir>/latest`` when that directory exists, else None (informative
    only: :func:`choose` decides what ``--load`` takes)."""
    path = os.path.join(load_dir, "latest")
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return tag if tag and os.path.isdir(os.path.join(load_dir, tag)) else None


def read_record(ckpt_dir: str) -> Optional[dict[str, Any]]:
    """The completion record of ``ckpt_dir``; None when absent or unreadable."""
    try:
        with open(os.path.join(ckpt_dir, RECORD_FILE), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    ok = (isinstance(record, dict) and isinstance(record.get("files"), dict)
          and all(isinstance(v, int) for v in record["files"].values()))
    return record if ok else None


def _read_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def incomplete_reason(ckpt_dir: str) -> tuple[Optional[str], bool]:
    """Why ``ckpt_dir`` does not count as complete (None when it does), and whether it is a
    checkpoint from before completion records that looks intact (its ``rtd_meta.json`` and
    every rank's RNG file are there; its other files cannot be checked)."""
    if os.path.exists(os.path.join(ckpt_dir, RECORD_FILE)):
        record = read_record(ckpt_dir)
        if record is None:
            return "its completion record is unreadable", False
        for name, size in sorted(record["files"].items()):
            try:
                actual = os.path.getsize(os.path.join(ckpt_dir, name))
            except OSError:
                return f"{name} is missing", False
            if actual != size:
                return f"{name} has {actual} bytes, its completion record says {size}", False
        return None, False
    meta_path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.exists(meta_path):
        return "no completion record and no rtd_meta.json (the save did not finish)", False
    meta = _read_json(meta_path)
    if meta is None or "layout" not in meta:
        return f"no completion record, and {META_FILE} is unreadable", False
    if "record_format" in meta:
        return "no completion record (the save did not finish)", False
    world = int(meta["layout"].get("world_size", 1))
    missing = [rng_file(r) for r in range(world)
               if not os.path.isfile(os.path.join(ckpt_dir, rng_file(r)))]
    if missing:
        return f"no completion record, and {missing[0]} is missing", False
    if not any(n.endswith("_model_states.pt") for n in os.listdir(ckpt_dir)):
        return "no completion record, and no DeepSpeed model states", False
    return "no completion record (saved before rtd_scale wrote them)", True


@dataclass
class Choice:
    """The checkpoint ``--load`` takes, and what it passed over."""

    load_dir: str
    tag: str
    skipped: list[tuple[str, str]] = field(default_factory=list)  # newer (tag, reason)
    unverified: bool = False  # made before completion records: sizes could not be checked
    notes: list[str] = field(default_factory=list)  # one line each, for rank 0 to print

    @property
    def path(self) -> str:
        return os.path.join(self.load_dir, self.tag)


def split_load(load: str) -> tuple[str, Optional[str]]:
    """``--load DIR`` → (DIR, None); ``--load DIR/global_stepN`` (a checkpoint directory, as
    DeepSpeed names them) → (DIR, "global_stepN")."""
    path = os.path.normpath(load)
    base = os.path.basename(path)
    if _step_of(base) is not None and not list_tags(path):
        return os.path.dirname(path) or ".", base
    return load, None


def choose(load: str) -> Choice:
    """The checkpoint ``--load load`` resumes from: the newest complete one in the directory
    (whatever ``latest`` says), or exactly the named ``DIR/global_stepN``.

    Checkpoints from before completion records count only when no checkpoint there has a
    complete record, and then only if they look intact (see :func:`incomplete_reason`); a note
    says their files could not be verified.

    Raises:
        UserInputError: no such directory; no complete checkpoint (naming each one and why);
            the named checkpoint is incomplete.
    """
    load_dir, tag = split_load(load)
    if not os.path.isdir(load_dir):
        raise UserInputError(f"--load {load}: no such directory; point --load at a --save "
                             "directory of an earlier run, or drop --load to start fresh")
    tags = list_tags(load_dir)
    verdicts = {t: incomplete_reason(os.path.join(load_dir, t)) for t in tags}
    complete = [t for t in tags if verdicts[t][0] is None]
    fallback = complete or [t for t in tags if verdicts[t][1]]
    if tag is not None:
        reason, legacy = verdicts.get(tag, (None, False))
        more = f" and {len(fallback) - 3} older" if len(fallback) > 3 else ""
        better = (f"; complete ones there: {', '.join(fallback[:3])}{more} (--load {load_dir} "
                  f"takes {fallback[0]})" if fallback else "")
        if tag not in verdicts:
            raise UserInputError(f"--load {load}: checkpoint {tag} does not exist{better}")
        if reason is not None and not (legacy and not complete):
            raise UserInputError(f"--load {load}: checkpoint {tag} is incomplete ({reason})"
                                 f"{better}")
        choice = Choice(load_dir, tag, unverified=reason is not None)
        newer = [t for t in fallback if _step_of(t) > _step_of(tag)]
        if newer:
            choice.notes.append(
                f"note: resuming from {tag}; the newer {', '.join(newer)} stay in {load_dir}, "
                f"and a later --load {load_dir} takes the newest complete one")
    elif not tags:
        raise UserInputError(f"--load {load}: no checkpoint found (no global_step* directory); "
                             "drop --load to start fresh")
    elif not fallback:
        why = "; ".join(f"{t}: {verdicts[t][0]}" for t in tags[:4])
        raise UserInputError(f"--load {load}: no complete checkpoint ({why}); restore one from "
                             "a copy, or drop --load to start fresh")
    else:
        tag = fallback[0]
        choice = Choice(load_dir, tag, unverified=verdicts[tag][0] is not None)
        choice.skipped = [(t, verdicts[t][0]) for t in tags if _step_of(t) > _step_of(tag)]
        if choice.skipped:
            choice.notes.append(
                f"note: --load {load}: skipped " + "; ".join(
                    f"{t} ({why})" for t, why in choice.skipped) + f"; resuming from {tag}")
        named = latest_tag(load_dir)
        if named in complete and _step_of(named) < _step_of(tag):
            choice.notes.append(
                f"note: {load_dir}/latest names {named}, but {tag} is newer and complete: taking "
                f"{tag} (--load {os.path.join(load_dir, named)} would take {named})")
    if choice.unverified:
        choice.notes.append(
            f"warning: {choice.path} has no completion record (saved before rtd_scale wrote "
            "them): its files' sizes could not be checked")
    return choice


def newest_complete(save_dir: str) -> Optional[str]:
    """The tag ``--load save_dir`` would take, or None when it would refuse (the Slurm
    launcher's question before it decides to pass ``--load``)."""
    try:
        return choose(save_dir).tag
    except UserInputError:
        return None


# Model fields that change the shape of some parameter: a checkpoint only loads into the same.
# ``layernorm_position``: another layout has other parameters (and the same ones mean other things).
_SHAPE_FIELDS = ("vocab_size", "embedding_size", "max_position_embeddings", "sharing",
                 "layernorm_position", "attention_type", "position_buckets",
                 "make_vocab_size_divisible_by")
# What a checkpoint written before a model field existed holds (its config lacks the field).
_FIELDS_BEFORE_THEY_EXISTED = {"layernorm_position": "pre", "attention_type": "bert",
                               "position_buckets": 256, "make_vocab_size_divisible_by": 128}
# A checkpoint from before model.sharing_scope existed shared the token table only.
_SCOPE_BEFORE_IT_EXISTED = "tokens"
_ENCODER_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


def scope_shapes_parameters(model: dict[str, Any]) -> bool:
    """Whether ``model.sharing_scope`` changes the parameters of a recorded model config (its
    sharing mode shares something past the token table, ``model/embeddings.py``
    ``SharingRule.layer_components``; never under disentangled attention)."""
    from rtd_scale.config import AttentionType, ModelConfig, SharingScope
    from rtd_scale.model.embeddings import sharing_rule

    relative = AttentionType(model.get("attention_type", "bert")) is AttentionType.DISENTANGLED
    rule = sharing_rule(model.get("sharing", ModelConfig.sharing))  # the field's default
    return bool(rule.layer_components(SharingScope.EMBEDDINGS, relative))


def _sharing_scope(model: dict[str, Any]) -> str:
    """The sharing scope that shapes the parameters: "tokens" wherever the scope changes nothing
    (NES, disentangled attention: ``config.SharingScope``), so a checkpoint written before the
    field existed still resumes those models."""
    if not scope_shapes_parameters(model):
        return "tokens"
    return model.get("sharing_scope", _SCOPE_BEFORE_IT_EXISTED)


def read_meta(load_dir: str, tag: str) -> Optional[dict[str, Any]]:
    """The checkpoint's ``rtd_meta.json`` (step, consumed samples, layout, config), or None."""
    path = os.path.join(load_dir, tag, META_FILE)
    if not os.path.isfile(path):
        return None
    meta = _read_json(path)
    if meta is None:
        raise CheckpointReadError(f"{path}: unreadable (not a JSON object); resume from "
                                  "another checkpoint (--load DIR/global_stepN)")
    return meta


def describe_layout(layout: dict[str, Any]) -> str:
    """``TP 1 × PP 1 × DP 2, ZeRO-3``: how the log and the errors name a process layout."""
    return (f"TP {layout.get('tensor_model_parallel_size')} × PP "
            f"{layout.get('pipeline_model_parallel_size')} × DP {layout.get('data_parallel_size')}"
            f", ZeRO-{layout.get('zero_stage')}")


def needs_conversion(meta: Optional[dict[str, Any]], layout: dict[str, Any]) -> bool:
    """Whether the checkpoint of ``meta`` was saved at a process layout other than ``layout``."""
    return meta is not None and any((meta.get("layout") or {}).get(k) != v
                                    for k, v in layout.items())


def check_convertible(load_dir: str, tag: str, saved: dict[str, Any],
                      layout: dict[str, Any], *, saved_precision: Optional[str] = None,
                      precision: Optional[str] = None) -> None:
    """Refuse a layout change ``--load`` cannot honour, in one line naming both layouts and the
    fix. Every change of TP, PP, DP size and ZeRO stage 0–3 converts (``training/reshard.py``):
    DeepSpeed's universal checkpoint between TP 1 × PP 1 layouts at ZeRO 1–3, rtd_scale's
    layout-free state otherwise. Not ZeRO-0 under fp16 on either side: DeepSpeed keeps its
    AdamW state in one flat fp16 optimizer there, not per parameter.

    Raises:
        UserInputError: the change is not one of those.
    """
    if all(saved.get(k) == v for k, v in layout.items()):
        return
    was, now = describe_layout(saved), describe_layout(layout)
    head = f"--load {load_dir}: {tag} was saved at {was}, this run is {now}"
    for side, lay, prec in (("the checkpoint", saved, saved_precision),
                            ("this run", layout, precision)):
        if lay.get("zero_stage") == 0 and prec == "fp16":
            raise UserInputError(
                f"{head}: {side} is ZeRO-0 under --fp16, whose AdamW state DeepSpeed keeps in "
                "one flat fp16 optimizer that cannot be re-split; resume at the checkpoint's "
                "layout, or use a ds_configs/zero1.json-style file on both runs")


def check_compatible(load_dir: str, tag: str, config: dict[str, Any],
                     layout: dict[str, int]) -> Optional[dict[str, Any]]:
    """Refuse, before anything is built, a ``--load`` whose checkpoint cannot continue this run:
    a process layout :func:`check_convertible` refuses, or another model shape. Returns the checkpoint's metadata (None for a checkpoint without it).

    A checkpoint at another TP, PP, DP size or ZeRO stage passes: it is converted first
    (``training/reshard.py``).

    Raises:
        UserInputError: naming each difference and the fix.
    """
    meta = read_meta(load_dir, tag)
    if meta is None:
        return None
    check_convertible(load_dir, tag, meta.get("layout") or {}, layout,
                      saved_precision=(meta.get("config") or {}).get("train", {}).get("precision"),
                      precision=config.get("train", {}).get("precision"))
    old, new = meta["config"]["model"], config["model"]
    old = {**_FIELDS_BEFORE_THEY_EXISTED, **old}
    diffs = [f"model.{k} {old.get(k)} → {new.get(k)}" for k in _SHAPE_FIELDS
             if old.get(k) != new.get(k)]
    if not diffs and _sharing_scope(old) != _sharing_scope(new):
        diffs.append(f"model.sharing_scope {_sharing_scope(old)} → {_sharing_scope(new)}")
    for enc in ("generator", "discriminator"):
        diffs += [f"model.{enc}.{k} {old[enc].get(k)} → {new[enc].get(k)}"
                  for k in _ENCODER_FIELDS if old[enc].get(k) != new[enc].get(k)]
    if diffs:
        raise UserInputError(
            f"--load {load_dir}: {tag} holds another model ({', '.join(diffs)}); use the "
            f"preset and overrides it was trained with (see {load_dir}/config.json)")
    old_seed, seed = meta["config"].get("train", {}).get("seed"), config["train"]["seed"]
    if old_seed is not None and old_seed != seed and not config["train"].get("override_data_order"):
        # the order is a function of (seed, epoch) (data/blend.py): another seed reshuffles
        # the epoch the run is in, so its remaining samples are not the ones still unread
        raise UserInputError(
            f"--load {load_dir}: {tag} was trained with --seed {old_seed}, this run has --seed "
            f"{seed}, which would reshuffle the data mid-epoch (some samples read twice, others "
            f"never); pass --seed {old_seed}, or --override-data-order to start the new seed's "
            "order where the run resumes")
    return meta


def data_order_note(saved_seed: int, seed: int, consumed: int, data) -> str:
    """The note a resumed run prints when ``--override-data-order`` lets ``seed`` replace the
    checkpoint's ``saved_seed``: where the new order starts (``data``: the training split's
    ``BlendedDataset``; its global sample ``consumed`` is the first one read)."""
    import numpy as np

    d, j = data.schedule.locate(np.array([consumed], np.int64))
    ds = data.datasets[int(d[0])]
    epoch, position = divmod(int(j[0]), len(ds))
    return (f"note: --override-data-order: the data order follows --seed {seed} (the "
            f"checkpoint's was {saved_seed}) from sample {consumed} on: {ds.name} resumes in "
            f"epoch {epoch} at position {position} of its {len(ds)} (counted from 0) of the new "
            "order, so this epoch skips some unread samples and repeats some read ones; masks "
            "and sampling noise follow the new seed too")


# ------------------------------------------------------------------------- safe loading ----

def _deepspeed_safe_globals() -> list:
    """The classes DeepSpeed's own checkpoint files hold besides tensors and containers
    (found with ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO 0–3, fp32 and
    bf16, TP and PP checkpoints of DeepSpeed 0.19.8). Each is a plain record: unpickling builds
    it from its fields and runs none of its code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _refused(path: str, detail: str) -> CheckpointReadError:
    return CheckpointReadError(
        f"{path}: refused to load: it holds Python objects other than tensors and DeepSpeed's "
        f"state ({detail}), which could run code when read; replace it with a trusted copy or "
        "resume from another checkpoint (--load DIR/global_stepN)")


def safe_load(path: str, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's few record classes allowed.

    Raises:
        CheckpointReadError: the file holds other Python objects (a crafted pickle: refused,
            nothing of it runs), or it is truncated or not a torch file.
    """
    import torch

    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            found = re.search(r"(GLOBAL [\w.]+|Unsupported operand \d+|[\w ]+ is not supported)",
                              str(e))
            raise _refused(path, found.group(1) if found else "not plain data") from None
        except (RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointReadError(
                f"{path}: unreadable ({first}); resume from another checkpoint "
                "(--load DIR/global_stepN)") from None


def check_safe_to_load(ckpt_dir: str) -> None:
    """Refuse a checkpoint any of whose ``.pt`` files holds more than tensors and DeepSpeed's
    allow-listed records, before anything is loaded. Zip files (what ``torch.save`` writes) are
    checked by listing their pickle's globals, which reads no tensor data; other files are
    loaded with :func:`safe_load`.

    Raises:
        UserInputError: naming the file (every rank checks the same files and raises the same
            error, so rank 0 alone prints it).
    """
    try:
        _check_safe_to_load(ckpt_dir)
    except CheckpointReadError as e:
        raise UserInputError(str(e)) from None


def _check_safe_to_load(ckpt_dir: str) -> None:
    import torch

    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if not name.endswith(".pt") or not os.path.isfile(path):
            continue
        if not zipfile.is_zipfile(path):
            safe_load(path)
            continue
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            except (RuntimeError, ValueError, KeyError, zipfile.BadZipFile) as e:
                raise CheckpointReadError(f"{path}: unreadable ({str(e).splitlines()[0]}); "
                                          "resume from another checkpoint "
                                          "(--load DIR/global_stepN)") from None
        if unsafe:
            raise _refused(path, "GLOBAL " + ", ".join(sorted(unsafe)))


class SafeCheckpointEngine:
    """Wraps the DeepSpeed engine's checkpoint engine: loads go through :func:`safe_load`
    (DeepSpeed's own engine unpickles with ``weights_only=False``); saves are remembered, so
    each rank can fsync what it wrote, and an ``OSError`` while writing (a full disk) is kept
    for :func:`save` to report on every rank instead of leaving the other ranks waiting in
    DeepSpeed's barrier. Everything else is the wrapped engine's."""

    def __init__(self, inner):
        self.inner = inner
        self.written: list[str] = []
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
        return safe_load(path, map_location=map_location)


def install_safe_loading(engine) -> SafeCheckpointEngine:
    """Make every later ``engine.load_checkpoint`` read its files with ``weights_only=True``
    (and every ``engine.save_checkpoint`` report write errors to :func:`save`); idempotent.
    Call it before loading a checkpoint with a DeepSpeed engine outside :func:`load`."""
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


def refresh_learning_rate(engine, lr: Optional[float] = None) -> None:
    """After a load, set the optimizer's learning rate and weight decay from this run's
    schedule at the restored position: the checkpoint's optimizer state carries the previous
    run's last values, stale when the schedule or --train-iters changed. The scheduler
    (``training/lr_schedule.py``) holds this run's values, as ``engine.resolve_resume_schedule``
    left them; ``lr`` is accepted for callers of the earlier schedule and not needed."""
    sched = engine.lr_scheduler
    if sched is not None:
        sched.step(0)


def _rng_state() -> dict[str, Any]:
    import torch
    from megatron.core import tensor_parallel


    state = {"cpu": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch
    from megatron.core import tensor_parallel

    from rtd_scale import cpu_compat

    cpu_compat.install()
    torch.set_rng_state(state["cpu"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------------------- saving ----

def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoint_bytes(ckpt_dir: str) -> int:
    record = read_record(ckpt_dir)
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


def _save_failed(save_dir: str, tag: str, failure: tuple[str, int, str], rank: int,
                 needed: int) -> UserInputError:
    """One line for every rank to raise; rank 0 also removes the partial directory."""
    path, code, strerror = failure
    ckpt_dir = os.path.join(save_dir, tag)
    if rank == 0:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    previous = next((t for t in list_tags(save_dir)
                     if t != tag and incomplete_reason(os.path.join(save_dir, t))[0] is None),
                    None)
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
    for t in list_tags(save_dir):
        if t != tag and incomplete_reason(os.path.join(save_dir, t))[0] is None:
            return _checkpoint_bytes(os.path.join(save_dir, t))
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

    tag = tag_for(step)
    ckpt_dir = os.path.join(save_dir, tag)
    ce = install_safe_loading(engine)
    ce.written, ce.failures = [], []
    agree = _Agreement()
    if rank == 0 and os.path.exists(os.path.join(ckpt_dir, RECORD_FILE)):
        os.remove(os.path.join(ckpt_dir, RECORD_FILE))  # before any rank rewrites a file
        _fsync(ckpt_dir)
    if dist.is_initialized():
        dist.barrier()
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state, save_latest=False)
    agree.failures += ce.failures
    if not agree.failures:
        rng_path = os.path.join(ckpt_dir, rng_file(rank))
        agree.attempt(rng_path, _write_torch, rng_path, _rng_state())
        ce.written.append(rng_path)
        if rank == 0:
            meta = {"step": step, "consumed_samples": client_state.get("consumed_samples"),
                    "layout": layout or {}, "config": client_state.get("config", {}),
                    "record_format": RECORD_FORMAT}
            meta_path = os.path.join(ckpt_dir, META_FILE)
            agree.attempt(meta_path, write_atomic, meta_path,
                          json.dumps(meta, indent=2, sort_keys=True) + "\n")
            ce.written.append(meta_path)
        for path in ce.written:
            agree.attempt(path, _fsync, path)
    failure = agree.check()
    if failure is None and rank == 0:
        agree.attempt(os.path.join(ckpt_dir, RECORD_FILE), _write_record, ckpt_dir, step)
        agree.attempt(os.path.join(save_dir, "latest"), _write_latest, save_dir, tag)
    failure = failure or agree.check()
    if failure is not None:
        raise _save_failed(save_dir, tag, failure, rank, _needed_bytes(engine, save_dir, tag))
    return ckpt_dir


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


def _write_torch(path: str, obj: Any) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        torch_save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_record(ckpt_dir: str, step: int) -> None:
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
    _fsync(path)
    _fsync(ckpt_dir)


def _write_latest(save_dir: str, tag: str) -> None:
    path = os.path.join(save_dir, "latest")
    write_atomic(path, tag)
    _fsync(path)
    _fsync(save_dir)


# ------------------------------------------------------------------------------ loading ----

def check_finite_weights(engine, ckpt_dir: str) -> None:
    """Refuse a loaded checkpoint whose weights hold inf or NaN.

    The completion record checks every file's size, not its bytes: a file damaged in place (a
    bad disk block, a partial overwrite) loads, and the run then fails on its first step as if
    the learning rate were too high. Each rank counts the non-finite values of its own
    parameters (its ZeRO-3 partition), one all-reduce sums the counts: every rank raises the
    same error, before any step.

    Raises:
        UserInputError: naming the checkpoint, the count and the fix.
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
    if count:
        raise UserInputError(
            f"{ckpt_dir}: the loaded weights hold {count} inf/NaN value(s): a file of this "
            "checkpoint is damaged although its size matches the completion record; resume "
            "from an earlier checkpoint (--load DIR/global_stepN) or delete this one")


def load_checked(engine, load_dir: str, tag: str, *, flag: str, **load_kwargs) -> dict[str, Any]:
    """DeepSpeed's ``engine.load_checkpoint(load_dir, tag)`` with the checks every reader of a
    checkpoint runs — training's ``--load`` (:func:`load`) and the export's
    (``hf/consolidate.py``) alike — in this order:

    1. every file is read with ``weights_only=True`` (:func:`install_safe_loading`);
    2. DeepSpeed found the tag's files (else one line naming ``flag`` and the tag);
    3. the loaded weights are finite (:func:`check_finite_weights`: a file damaged in place
       keeps its size, so the completion record that :func:`choose` checks cannot see it).

    Returns the checkpoint's client state ({} when none).
    """
    install_safe_loading(engine)
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, **load_kwargs)
    if path is None:
        raise UserInputError(f"{flag}: DeepSpeed could not load {tag}")
    check_finite_weights(engine, os.path.join(load_dir, tag))
    return client_state or {}


def load(engine, load: str, *, rank: int, universal_root: Optional[str] = None,
         choice: Optional[Choice] = None) -> dict[str, Any]:
    """Load the checkpoint :func:`choose` picks for ``--load load`` into ``engine`` (``choice``:
    that pick, made earlier by the caller); returns its client state. Every file is read with
    ``weights_only=True``. The optimizer's learning rate and weight decay are then this run's
    schedule's at the restored position (:func:`refresh_learning_rate`).

    ``universal_root``: the checkpoint was saved at another layout and this is its universal
    conversion (``training/reshard.py``; the engine was built with ``load_universal``); the
    per-rank RNG files are not restored (the RNG policy there).

    Raises:
        UserInputError: no complete checkpoint (see :func:`choose`).
        CheckpointReadError: a file is unreadable or holds more than tensors (on the rank that
            reads it).
    """
    choice = choice or choose(load)
    groups = getattr(engine.optimizer, "optimizer", engine.optimizer).param_groups
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    client_state = load_checked(engine, universal_root or choice.load_dir, choice.tag,
                                flag=f"--load {load}")
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
    return client_state or {}
