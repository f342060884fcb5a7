"""Resume a checkpoint at another process layout: TP, PP and DP size, ZeRO stage 0–3.

Two routes, chosen by :func:`uses_universal`:

1. TP 1 × PP 1 on both sides, ZeRO 1–3 on both sides (another DP size or ZeRO stage):
   DeepSpeed's universal checkpoint (``deepspeed.checkpoint.ds_to_universal``, loaded with the
   ds config ``"checkpoint": {"load_universal": true}``). In DeepSpeed 0.19.8 the ZeRO-1/2
   path merges the flat fp32 partitions per parameter, the ZeRO-3 path
   (``_extract_zero_shard_files_stage3``, ``_merge_zero3_slice_files``) does the same for ZeRO-3
   partitions, and both write one folder per parameter with its fp32 master weights,
   ``exp_avg`` and ``exp_avg_sq`` (``zero/<name>/*.pt``), plus the optimizer's global state in
   ``zero/optimizer_state.pt``. On load, ``stage_1_and_2.py`` and ``stage3.py``
   (``load_hp_checkpoint_state_from_checkpoint_dir*``) slice each parameter into the new
   engine's own partition. The data position, the learning-rate schedule and rtd_scale's client
   state come from the copied ``*model_states.pt`` files, as on any resume.

2. Everything else — another TP or PP size, ZeRO-0 on either side, another DP size at TP > 1 or
   PP > 1: rtd_scale's layout-free state (:func:`convert_canonical`, :func:`load_canonical`).
   The universal checkpoint does not cover these: its TP merge needs per-parameter patterns
   (``universal_checkpoint_info``) that rtd_scale's engine does not write, it names parameters
   by the names each pipeline stage uses, and rtd_scale's pipeline stages number their layers
   from 0 (stage-local names collide across stages); a ZeRO-0 engine does not load it at all
   (``DeepSpeedEngine.load_checkpoint`` restores weights from ``zero/`` only through a ZeRO
   optimizer). Instead the conversion reuses the export's merge (``hf/consolidate.py``): the
   checkpoint's own world is restarted as local gloo processes that load it exactly as
   ``--load`` at its layout would, then gather every parameter's fp32 master weights and both
   AdamW moments (DeepSpeed's ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
   over ZeRO; the client AdamW's ``state`` at ZeRO-0) over tensor and pipeline parallel into
   canonical names by the rules that initialise and export the model (``model/weights.py``):
   vocabulary-parallel rows gathered and their padding dropped (the padding is a multiple of
   ``make_vocab_size_divisible_by`` × TP and differs by TP size), column-parallel tensors
   (megatron-core's ``linear_qkv`` too: its rows are grouped per head, [q k v] per head, so the
   TP shards concatenated along dim 0 are the TP 1 layout) along dim 0, row-parallel ones
   along dim 1, replicated ones whole; layers by their global ``layer_number`` − 1, the last
   stage's copy of the tied MLM output table and every stage's copy of DeBERTa's relative
   table under the one name (their copies are kept equal, gradients summed). The new run
   slices each canonical tensor for its TP rank (``weights._local_slice``: vocabulary padded
   with zero rows for the new TP size) and writes it into its own engine's storage: the ZeRO-3
   partition, the ZeRO-1/2 (and bf16 optimizer) fragments of the flat fp32 state, or the
   parameter and ``state[p]`` of the client AdamW at ZeRO-0; the AdamW step count is set on
   every state. Choice: one merge for weights, export and optimizer state, in rules the
   model's own tests pin (tests/multiproc/test_vocab_padding.py, tests/e2e/test_hf_export.py),
   rather than a second set of TP rules in DeepSpeed's pattern language; the cost is a restart
   of the old world at conversion time (measured in the README).

Two gaps of DeepSpeed 0.19.8 in route 1 are closed here and in ``checkpoint/load.py`` (each
pinned by tests/e2e/test_resume_layout.py): the ZeRO-1/2 and ZeRO-3 universal formats differ,
so the conversion is rewritten to carry both (:func:`_optimizer_state_for_every_stage`,
:func:`_model_states_for_every_stage`); and a ZeRO-3 universal load gives every parameter
group the first group's hyper-parameters and one shared step tensor (AdamW then counts each
step once per group).

What is written, beside the checkpoint, which is only read: route 1
``<load>/<tag>_universal/<tag>/``, route 2 ``<load>/<tag>_canonical/`` (``state.pt``: fp32
weights and both moments, 12 bytes per parameter; ``training_state.json``: AdamW step, loss
scaler). Each is built under ``<load>/.<tag>_<kind>.tmp-<pid>`` and renamed into place when
complete (a marker file inside says so), so an interrupted conversion never counts and the
next ``--load`` converts again; a later resume at any other layout reuses a complete one.
Converted files pass the BEFORE_BUILD checks of ``checkpoint/checks.py``'s ``CHECKS`` as any
checkpoint's do, the layout-free state's load runs the LOAD and AFTER_LOAD checks as every other
load does, and it reads ``state.pt`` with ``files.safe_load`` as DeepSpeed's reads are.

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
from typing import Callable

from rtd_scale.cli_errors import UserInputError

DONE_FILE = "rtd_universal_complete"


def universal_root(load_dir: str, tag: str) -> str:
    """The directory whose ``<tag>/`` holds the universal conversion of ``<load_dir>/<tag>``."""
    return os.path.join(load_dir, f"{tag}_universal")


def is_converted(load_dir: str, tag: str) -> bool:
    """Whether ``<load_dir>/<tag>``'s universal conversion is complete (its marker written)."""
    return _is_complete(universal_root(load_dir, tag), os.path.join(tag, DONE_FILE))


def _is_complete(root: str, marker: str) -> bool:
    """Whether the conversion at ``root`` is complete: ``marker`` (relative to it) is written
    last, just before the conversion is renamed into place (:func:`_convert_beside`)."""
    return os.path.isfile(os.path.join(root, marker))


def convert(load_dir: str, tag: str) -> tuple[str, float, bool]:
    """Write (or reuse) the universal conversion of ``<load_dir>/<tag>``; one process only.

    Returns (the root to pass to ``engine.load_checkpoint`` with ``tag``, seconds spent,
    whether it was converted now rather than reused).

    Raises:
        UserInputError: the conversion failed or the directory is not writable; nothing is
            left under the final name.
    """
    def write(tmp: str) -> None:
        out = os.path.join(tmp, tag)
        _ds_to_universal(os.path.join(load_dir, tag), out)
        _model_states_for_every_stage(out)
        _optimizer_state_for_every_stage(out)

    # DeepSpeed's converter asserts on what it cannot read: its first line says what
    return _convert_beside(
        load_dir, tag, universal_root(load_dir, tag), write, os.path.join(tag, DONE_FILE),
        "the universal conversion",
        lambda e: f"DeepSpeed's universal conversion of {tag} failed ({_line(e, 0)})")


def _line(e: BaseException, index: int) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[index]


def _convert_beside(load_dir: str, tag: str, final: str, write: Callable[[str], None],
                    marker: str, what: str, failed: Callable[[Exception], str]
                    ) -> tuple[str, float, bool]:
    """Write (or reuse) ``final`` (``<load_dir>/<tag>_<kind>``): ``write(tmp)`` fills a
    temporary ``<load_dir>/.<tag>_<kind>.tmp-<pid>``, the ``marker`` file (relative to it) is
    written when it is complete, and then it is renamed into place, so an interrupted conversion
    never counts and the checkpoint itself is only read. A failure removes the temporary and is
    one ``UserInputError`` line: ``failed(e)`` for what ``write`` raised, "cannot write
    ``what``" for the directory."""
    if _is_complete(final, marker):
        return final, 0.0, False
    start = time.perf_counter()
    tmp = os.path.join(load_dir, f".{os.path.basename(final)}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        try:
            write(tmp)
        except UserInputError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise UserInputError(f"--load {load_dir}: {failed(e)}; resume at the checkpoint's "
                                 "layout") from None
        with open(os.path.join(tmp, marker), "w", encoding="utf-8") as f:
            f.write(f"{tag}\n")
        if os.path.exists(final):  # an incomplete earlier conversion (no marker)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserInputError(
            f"--load {load_dir}: cannot write {what} of {tag} beside it ({e.strerror or e}); "
            f"resume at the checkpoint's layout, or make {load_dir} writable") from None
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
    """The BEFORE_BUILD checks of ``checks.CHECKS`` on every folder of a conversion (a reused
    conversion could have been replaced), as ``load.take`` runs them on a checkpoint: its
    ``.pt`` files hold only tensors and DeepSpeed's records."""
    from rtd_scale.training.checkpoint import checks

    folder = os.path.join(root, tag)
    zero = os.path.join(folder, "zero")
    for path in (folder, zero, *(os.path.join(zero, name) for name in sorted(os.listdir(zero))
                                 if os.path.isdir(os.path.join(zero, name)))):
        checks.run(checks.Moment.BEFORE_BUILD, ckpt_dir=path)


# ------------------------------------------- tensor- and pipeline-parallel changes, ZeRO-0 ----

CANONICAL_DONE = "rtd_canonical_complete"
# The layout-free state's files: {"fp32" | "exp_avg" | "exp_avg_sq": {canonical name: tensor}},
# and {"adam_step": float, "loss_scaler": {...}} (written by hf/consolidate.py).
STATE_FILE = "state.pt"
INFO_FILE = "training_state.json"
# What DeepSpeed's model-states file holds besides rtd_scale's client state
# (``DeepSpeedEngine._save_checkpoint``, 0.19.8).
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "universal_checkpoint_info"})


def uses_universal(saved: dict, layout: dict) -> bool:
    """Whether DeepSpeed's universal checkpoint covers the change from layout ``saved`` to
    ``layout``: TP 1 × PP 1 and ZeRO 1–3 on both sides (the rest goes through
    :func:`convert_canonical`)."""
    return all(d.get("tensor_model_parallel_size") == 1 and d.get("pipeline_model_parallel_size")
               == 1 and d.get("zero_stage") in (1, 2, 3) for d in (saved, layout))


def canonical_root(load_dir: str, tag: str) -> str:
    """The directory holding the layout-free state of ``<load_dir>/<tag>``."""
    return os.path.join(load_dir, f"{tag}_canonical")


def is_canonical_converted(load_dir: str, tag: str) -> bool:
    """Whether ``<load_dir>/<tag>``'s layout-free state is complete (its marker written)."""
    return _is_complete(canonical_root(load_dir, tag), CANONICAL_DONE)


def convert_canonical(load_dir: str, tag: str, gather: Callable[[str, str, str], None]
                      ) -> tuple[str, float, bool]:
    """Write (or reuse) the layout-free training state of ``<load_dir>/<tag>``; one process
    only. ``gather(load_dir, tag, out_dir)`` writes it into ``out_dir``: the caller passes
    ``hf/consolidate.consolidate_training_state`` (the checkpoint's own world restarted as local
    gloo processes, every parameter's fp32 master weights and both AdamW moments gathered over
    ZeRO, tensor and pipeline parallel into canonical names; ``training/`` does not import
    ``hf/``, tests/unit/test_layering.py).

    Returns (its directory, seconds spent, whether it was converted now rather than reused).

    Raises:
        UserInputError: the conversion failed or the directory is not writable; nothing is
            left under the final name.
    """
    # a worker's traceback: its last line says what failed
    return _convert_beside(
        load_dir, tag, canonical_root(load_dir, tag), lambda tmp: gather(load_dir, tag, tmp),
        CANONICAL_DONE, "the layout-free state",
        lambda e: f"merging the shards of {tag} into one layout-free state failed ({_line(e, -1)})")


def check_canonical_safe(root: str) -> None:
    """The BEFORE_BUILD checks of ``checks.CHECKS`` on the conversion (a reused one could have
    been replaced), as ``load.take`` runs them on a checkpoint: its ``.pt`` files hold only
    tensors."""
    from rtd_scale.training.checkpoint import checks

    checks.run(checks.Moment.BEFORE_BUILD, ckpt_dir=root)


def _model_states(ckpt_dir: str) -> dict:
    """The checkpoint's model-states file of model-parallel rank 0 (the client state, schedule
    and step; every rank's file holds the same), read with ``weights_only=True``."""
    from rtd_scale.training.checkpoint.files import CheckpointReadError, safe_load

    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        path = os.path.join(ckpt_dir, name)
        if os.path.isfile(path):
            return safe_load(path)
    raise CheckpointReadError(
        f"{ckpt_dir}: no mp_rank_00 model states; resume from another checkpoint "
        "(--load DIR/global_stepN)")


def _step_value(base, group: dict, hp, step: float, old):
    """AdamW's step count in the form ``base`` keeps it (torch.optim.AdamW: a float32 CPU
    tensor, on the device when fused or capturable; rtd_scale's ``NonFiniteSkippingAdamW``: a
    float64 device tensor; DeepSpeed's CPU Adam: an int)."""
    import torch

    from rtd_scale.training.optimizer import NonFiniteSkippingAdamW

    if isinstance(base, NonFiniteSkippingAdamW):
        return torch.tensor(float(step), dtype=torch.float64, device=hp.device)
    if isinstance(base, torch.optim.Optimizer) and type(base).__module__.startswith("torch."):
        from torch.optim.optimizer import _get_scalar_dtype

        on_device = bool(group.get("fused") or group.get("capturable"))
        return torch.tensor(float(step), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                            device=hp.device if on_device else "cpu")
    if torch.is_tensor(old):
        return torch.full_like(old, step)
    return int(step)


def _init_adam_state(engine, step: float) -> None:
    """Give every tensor the AdamW steps its state (moments zero, the step count ``step``):
    DeepSpeed 0.19.8 and torch create it lazily at the first step, and the values below are
    copied into it. At ZeRO-1/2 and under DeepSpeed's bf16 optimizer the parameters' views of
    the flat state are then linked (``_lazy_init_hp_params_optimizer_state``)."""
    import torch

    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        # ZeRO-3 puts each flat sub-group into its parameter group only while stepping it
        # (stage3.py ``_optimizer_step``)
        pairs = [(base.param_groups[opt.sub_group_to_group_id[i]], hp)
                 for i, hp in enumerate(opt.fp32_partitioned_groups_flat)]
    else:
        pairs = [(group, hp) for group in base.param_groups for hp in group["params"]]
    for group, hp in pairs:
        state = base.state[hp]
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(hp, memory_format=torch.preserve_format)
        state["step"] = _step_value(base, group, hp, step, state.get("step"))
    for group in base.param_groups:
        if "step" in group:
            group["step"] = int(step)
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _set_parameter(engine, p, local: dict) -> None:
    """This rank's share of one parameter's fp32 weights and AdamW moments (``local``: this
    tensor-parallel rank's full slice of each), in every ZeRO stage's own storage."""
    import torch
    from deepspeed.utils import (safe_set_full_fp32_param, safe_set_full_optimizer_state,
                                 safe_set_local_fp32_param, safe_set_local_optimizer_state)

    opt = engine.optimizer
    if hasattr(p, "ds_id"):  # ZeRO-3: this data-parallel rank's partition (padded at the end)
        part = p.ds_tensor.numel()
        rank = opt._get_param_partition_rank(p)
        world = opt._get_param_partition_world_size(p)
        for key, value in local.items():
            flat = value.reshape(-1).float()
            if part * world > flat.numel():
                flat = torch.nn.functional.pad(flat, (0, part * world - flat.numel()))
            mine = flat.narrow(0, part * rank, part).to(p.ds_tensor.device)
            if key == "fp32":
                safe_set_local_fp32_param(p, mine)
                p.ds_tensor.data.copy_(mine.to(p.ds_tensor.dtype))
            else:
                safe_set_local_optimizer_state(p, mine, key)
    elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2, DeepSpeed's bf16 optimizer: the flat fragments
        device = p.device
        safe_set_full_fp32_param(p, local["fp32"].to(device))
        for key in ("exp_avg", "exp_avg_sq"):
            safe_set_full_optimizer_state(p, local[key].to(device), key)
    else:  # ZeRO-0 in fp32: the client AdamW steps the parameter itself
        base = getattr(opt, "optimizer", opt)
        p.data.copy_(local["fp32"].to(p.dtype))
        for key in ("exp_avg", "exp_avg_sq"):
            base.state[p][key].copy_(local[key])


class _WithShape:
    """A parameter as ``model.weights._local_slice`` reads it (its tensor-parallel attributes),
    with its unpartitioned shape (ZeRO-3 leaves an empty placeholder in ``p.shape``)."""

    def __init__(self, p, shape):
        self._p, self.shape = p, shape

    def __getattr__(self, name):
        return getattr(self._p, name)


def load_canonical(engine, model, ctx, root: str, choice, *, flag: str) -> dict:
    """Load the layout-free state ``root`` (:func:`convert_canonical` of ``choice``, the
    checkpoint ``--load`` takes) into ``engine``, built at this run's layout; returns the
    checkpoint's client state. Collective (ZeRO-1/2 gather the updated weights).

    Each parameter's canonical tensors are sliced for this tensor-parallel rank by the rules
    that initialise and export it (``model.weights._local_slice``: vocabulary rows padded for
    this TP size, column- and row-parallel splits along megatron-core's ``partition_dim``,
    replicated tensors whole), then for this data-parallel rank by DeepSpeed's own fragment
    maps. The schedule, the engine's step counters and the client state come from the
    checkpoint's model-states file; the learning rate is then this run's schedule's
    (``checkpoint.load.refresh_learning_rate``); the LOAD and AFTER_LOAD checks of
    ``checkpoint.checks.CHECKS`` run around it, as around every load.

    Raises:
        UserInputError: the state does not fit this model (another parameter set or shape).
    """
    import json

    import torch

    from rtd_scale.model import weights
    from rtd_scale.training.checkpoint import checks
    from rtd_scale.training.checkpoint.files import safe_load
    from rtd_scale.training.checkpoint.load import refresh_learning_rate

    checks.run(checks.Moment.LOAD, engine=engine)
    state = safe_load(os.path.join(root, STATE_FILE), mmap=True)
    with open(os.path.join(root, INFO_FILE), encoding="utf-8") as f:
        info = json.load(f)
    names = dict(weights._named_unique_parameters(model))
    missing, unexpected = sorted(set(names) - set(state["fp32"])), sorted(
        set(state["fp32"]) - set(names))
    if missing or unexpected:
        raise UserInputError(f"{flag}: the layout-free state {root} does not fit this model "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]}); resume at "
                             "the checkpoint's layout and model flags")
    _init_adam_state(engine, float(info["adam_step"]))
    with torch.no_grad():
        for name, p in names.items():
            shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3: p itself is a placeholder
            local = {k: weights._local_slice(state[k][name], _WithShape(p, shape), ctx.tp_rank)
                     for k in ("fp32", "exp_avg", "exp_avg_sq")}
            if tuple(local["fp32"].shape) != shape:
                raise UserInputError(
                    f"{flag}: {name} has shape {tuple(state['fp32'][name].shape)} in {root}, "
                    f"which does not fit {shape} on tensor-parallel rank {ctx.tp_rank}; resume "
                    "at the checkpoint's layout and model flags")
            _set_parameter(engine, p, local)
    if engine.zero_optimization_stage() != 3 and hasattr(engine.optimizer, "update_lp_params"):
        engine.optimizer.update_lp_params()  # the fp32 partitions into every rank's weights
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in (info.get("loss_scaler") or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)
    states = _model_states(choice.path)
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    engine.global_steps = states["global_steps"]
    engine.global_samples = states.get("global_samples",
                                       engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = states["skipped_steps"]
    checks.run(checks.Moment.AFTER_LOAD, engine=engine, ckpt_dir=choice.path, loaded=root,
               flag=flag)
    refresh_learning_rate(engine)
    return {k: v for k, v in states.items() if k not in _DEEPSPEED_KEYS}
