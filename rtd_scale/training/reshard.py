"""Resume a checkpoint at another data-parallel size or ZeRO stage 1–3, at TP 1 and PP 1.

Choice: DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``, loaded with
the ds config ``"checkpoint": {"load_universal": true}``), not our own merge of the partitions.
In DeepSpeed 0.19.8 it covers every layout rtd_scale writes at TP 1 / PP 1: the ZeRO-1/2 path
merges the flat fp32 partitions per parameter, the ZeRO-3 path (``_extract_zero_shard_files_stage3``,
``_merge_zero3_slice_files``) does the same for ZeRO-3 partitions, and both write one folder per
parameter with its fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` (``zero/<name>/*.pt``),
plus the optimizer's global state (step, hyper-parameters, loss scaler) in
``zero/optimizer_state.pt``. On load, ``stage_1_and_2.py`` and ``stage3.py``
(``load_hp_checkpoint_state_from_checkpoint_dir*``) slice each parameter into the new engine's
own partition, so the AdamW step that follows is the one the old layout would have taken. The
data position, the learning-rate schedule and rtd_scale's client state come from the copied
``*model_states.pt`` files, as on any resume. A hand-written merge would repeat that code and
its flat-buffer padding rules; DeepSpeed's tests keep the universal one right as ZeRO changes.

Not yet: TP or PP changes, and DP changes at TP > 1 or PP > 1 (``checkpoint.check_convertible``
refuses them in one line). The converter would need per-parameter TP patterns
(``universal_checkpoint_info``: vocab-parallel rows and their 128 × TP padding, row-parallel
dim 1, per-head QKV) that rtd_scale's engine does not write.

Two gaps of DeepSpeed 0.19.8 are closed here and in ``checkpoint.load`` (each pinned by
tests/e2e/test_resume_layout.py): the ZeRO-1/2 and ZeRO-3 universal formats differ, so the
conversion is rewritten to carry both (:func:`_optimizer_state_for_every_stage`,
:func:`_model_states_for_every_stage`); and a ZeRO-3 universal load gives every parameter
group the first group's hyper-parameters and one shared step tensor (AdamW then counts each
step once per group).

What is written: ``<load>/<tag>_universal/<tag>/`` beside the checkpoint, built under
``<load>/.<tag>_universal.tmp-<pid>`` and renamed into place when complete (a marker file inside
says so), so an interrupted conversion never counts and the next ``--load`` converts again.
The original checkpoint is only read. A later resume at another layout reuses a complete
conversion. Converted files are checked like any checkpoint (``checkpoint.check_safe_to_load``).

RNG policy. Masks and sampling noise are functions of (seed, step, global sample index): they
continue exactly at any layout. Dropout streams are per rank (``rng_rank*.pt``) and cannot be
carried to another number of ranks: at a new layout each rank seeds dropout as a fresh run
would, from ``seed + step`` (``distributed.seed_after_build``), so it does not replay step 1's.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import shutil
import time

from rtd_scale.cli_errors import UserInputError

DONE_FILE = "rtd_universal_complete"


def universal_root(load_dir: str, tag: str) -> str:
    """The directory whose ``<tag>/`` holds the universal conversion of ``<load_dir>/<tag>``."""
    return os.path.join(load_dir, f"{tag}_universal")


def is_converted(load_dir: str, tag: str) -> bool:
    return os.path.isfile(os.path.join(universal_root(load_dir, tag), tag, DONE_FILE))


def convert(load_dir: str, tag: str) -> tuple[str, float, bool]:
    """Write (or reuse) the universal conversion of ``<load_dir>/<tag>``; one process only.

    Returns (the root to pass to ``engine.load_checkpoint`` with ``tag``, seconds spent,
    whether it was converted now rather than reused).

    Raises:
        UserInputError: the conversion failed or the directory is not writable; nothing is
            left under the final name.
    """
    final = universal_root(load_dir, tag)
    if is_converted(load_dir, tag):
        return final, 0.0, False
    start = time.perf_counter()
    tmp = os.path.join(load_dir, f".{tag}_universal.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        out = os.path.join(tmp, tag)
        try:
            _ds_to_universal(os.path.join(load_dir, tag), out)
            _model_states_for_every_stage(out)
            _optimizer_state_for_every_stage(out)
        except Exception as e:  # DeepSpeed's converter asserts on what it cannot read
            shutil.rmtree(tmp, ignore_errors=True)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserInputError(
                f"--load {load_dir}: DeepSpeed's universal conversion of {tag} failed ({first}); "
                "resume at the checkpoint's layout") from None
        with open(os.path.join(out, DONE_FILE), "w", encoding="utf-8") as f:
            f.write(f"{tag}\n")
        if os.path.exists(final):  # an incomplete earlier conversion (no marker)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserInputError(
            f"--load {load_dir}: cannot write the universal conversion of {tag} beside it "
            f"({e.strerror or e}); resume at the checkpoint's layout, or make {load_dir} "
            "writable") from None
    return final, time.perf_counter() - start, True


def _ds_to_universal(input_folder: str, output_folder: str) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=input_folder, output_folder=output_folder,
                              num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True,
                              # rtd_scale's engine does not write universal_checkpoint_info
                              inject_missing_state=True)
    real_torch = ds_to_universal.torch
    ds_to_universal.torch = _TorchSkippingExtraState(real_torch)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal.main(args)  # progress bars and banners: the caller prints one line
    finally:
        ds_to_universal.torch = real_torch


class _TorchSkippingExtraState:
    """``torch`` as ``ds_to_universal`` sees it, except that a loaded ``module`` state dict
    loses its non-tensor entries: megatron-core's layers hold ``*._extra_state = None``, which
    the converter's fp32 fall-back for parameters without optimizer state (ZeRO-1/2 path of
    ``ds_to_universal.main``) would call ``.float()`` on. They are not parameters and carry no
    state (tests/e2e/test_resume_layout.py resumes ZeRO-1 at ZeRO-3 through it)."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def load(self, *args, **kwargs):
        value = self._torch.load(*args, **kwargs)
        if isinstance(value, dict) and isinstance(value.get("module"), dict):
            value["module"] = {k: v for k, v in value["module"].items()
                               if self._torch.is_tensor(v)}
        return value


def _model_states_for_every_stage(folder: str) -> None:
    """Give the conversion the model-states file name of every ZeRO stage.

    A universal load reads the client state, schedule and step from ``mp_rank_00_model_states.pt``
    at ZeRO-1/2 and from ``zero_pp_rank_0_mp_rank_00_model_states.pt`` at ZeRO-3
    (``DeepSpeedEngine._get_all_ckpt_names``); the converter copies only the source's names."""
    for mp in sorted({os.path.basename(p).split("mp_rank_")[1][:2]
                      for p in glob.glob(os.path.join(folder, "*mp_rank_*_model_states.pt"))}):
        plain = os.path.join(folder, f"mp_rank_{mp}_model_states.pt")
        zero3 = os.path.join(folder, f"zero_pp_rank_0_mp_rank_{mp}_model_states.pt")
        if os.path.isfile(plain) and not os.path.isfile(zero3):
            shutil.copyfile(plain, zero3)
        elif os.path.isfile(zero3) and not os.path.isfile(plain):
            shutil.copyfile(zero3, plain)


def _optimizer_state_for_every_stage(folder: str) -> None:
    """Rewrite the conversion's optimizer state so both ZeRO-1/2 and ZeRO-3 load it.

    DeepSpeed 0.19.8 writes the two universal formats differently: from a ZeRO-1/2 checkpoint
    each ``zero/<name>/<key>.pt`` is ``{"param": tensor}``, the AdamW step is in ``step.pt`` and
    ``optimizer_state.pt`` holds ``ds_version`` and ``clip_grad``; from a ZeRO-3 one each file is
    the bare tensor and the step is in ``optimizer_state.pt["optimizer_state_dict"]``. The ZeRO-1/2
    loader (``runtime/base_optimizer.py`` ``load_hp_checkpoint_state_from_checkpoint_dir``) needs
    the former, the ZeRO-3 one (``stage3.py`` ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``)
    the latter's step; each reads the other's files when they carry both."""
    import deepspeed
    import torch

    zero = os.path.join(folder, "zero")
    state_path = os.path.join(zero, "optimizer_state.pt")
    sd = torch.load(state_path, map_location="cpu", weights_only=False)  # our own conversion
    names = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
    step = (sd.get("optimizer_state_dict") or {}).get("state", {}).get(0, {}).get("step")
    if step is None:
        steps = [os.path.join(zero, n, "step.pt") for n in names]
        step = next((torch.load(p, weights_only=False) for p in steps if os.path.isfile(p)), None)
    if step is None:
        raise ValueError(f"{state_path}: no AdamW step found in the conversion")
    out = {k: sd[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad",
                              "ds_version", "param_groups") if k in sd}
    out.setdefault("ds_version", deepspeed.__version__)
    out["optimizer_state_dict"] = {"state": {0: {"step": step}},
                                   "param_groups": sd["param_groups"]}
    torch.save(out, state_path)
    for name in names:
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            path = os.path.join(zero, name, f"{key}.pt")
            if not os.path.isfile(path):
                continue
            value = torch.load(path, map_location="cpu", weights_only=False)
            if torch.is_tensor(value):
                torch.save({"param": value}, path)
        step_path = os.path.join(zero, name, "step.pt")
        if not os.path.isfile(step_path):
            torch.save(step, step_path)


def check_converted_safe(root: str, tag: str) -> None:
    """Every ``.pt`` file of a conversion holds only tensors and DeepSpeed's records (a reused
    conversion could have been replaced), checked as ``checkpoint.check_safe_to_load`` does."""
    from rtd_scale.training import checkpoint

    folder = os.path.join(root, tag)
    checkpoint.check_safe_to_load(folder)
    zero = os.path.join(folder, "zero")
    checkpoint.check_safe_to_load(zero)
    for name in sorted(os.listdir(zero)):
        if os.path.isdir(os.path.join(zero, name)):
            checkpoint.check_safe_to_load(os.path.join(zero, name))
