"""The layout-free training state: every parameter's fp32 master weights and both AdamW moments
under canonical names, plus the AdamW step and the loss scaler — what a run at any TP × PP × DP
size, ZeRO stage 0–3, with or without ZeRO-Offload, in fp32, bf16 or fp16, is sliced from.

``gather_full_state`` (collective, on a live engine) gathers ZeRO partitions (DeepSpeed's
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, one parameter at a time), tensor-
parallel shards and pipeline stages into ``model.weights.full_state_dict``'s form: vocabulary-
parallel rows gathered and their padding dropped (a multiple of ``make_vocab_size_divisible_by``
× TP, so it differs by TP size), column-parallel tensors (megatron-core's ``linear_qkv`` too: its
rows are grouped per head, so the shards concatenated along dim 0 are the TP 1 layout) along dim
0, row-parallel ones along dim 1, replicated ones whole; layers by their global ``layer_number``
− 1, the last stage's copy of the tied MLM output table and every stage's copy of DeBERTa's
relative table under the one name (their copies are kept equal, gradients summed). The export
(``rtd_scale/exports.py``, ``hf/consolidate.py``) reads the weights; :func:`write` adds the moments.

:func:`load` is the inverse into an engine built at another layout: each canonical tensor is
sliced for this TP rank by the rules that initialise the model (``weights._local_slice``:
vocabulary padded with zero rows for this TP size), then written into this engine's own storage —
the ZeRO-3 partition, the ZeRO-1/2 (and bf16 optimizer) fragments of the flat fp32 state, or the
parameter and ``state[p]`` of the client AdamW at ZeRO-0 — and the AdamW step count is set on
every state in the form this run's optimizer keeps it (:func:`adam_step_value`). One merge for
weights, export and optimizer state, in rules the model's own tests pin
(tests/multiproc/test_vocab_padding.py, tests/multiproc/test_layout_free.py), rather than a second
set of TP rules in DeepSpeed's universal-checkpoint pattern language.

Files (written by ``checkpoint/convert.py`` beside the checkpoint): ``state.pt``
({"fp32" | "exp_avg" | "exp_avg_sq": {canonical name: full fp32 tensor}}, 12 bytes per parameter)
and ``training_state.json`` ({"adam_step": float, "loss_scaler": {...}}).

RNG policy. Masks and sampling noise are functions of (seed, step, global sample index): they
continue exactly at any layout. Dropout streams are per rank (``rng_rank*.pt``): the same ranks
in the same roles (TP × PP × DP sizes; another ZeRO stage, precision or offload) each continue
their own stream, as an unchanged resume does (``resume.resume``, ``compat.same_ranks``); at
another TP, PP or DP size a stream cannot be carried over, and each rank seeds dropout as a
fresh run would, from ``seed + step`` (``distributed.seed_after_build``).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

import torch

from rtd_scale.cli_errors import UserInputError

STATE_FILE = "state.pt"
INFO_FILE = "training_state.json"
# The per-parameter optimizer state a layout change carries (torch.optim.AdamW's names), besides
# the fp32 master weights.
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
# What DeepSpeed's model-states file holds besides rtd_scale's client state
# (``DeepSpeedEngine._save_checkpoint``, 0.19.8).
_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version", "universal_checkpoint_info"})


# ------------------------------------------------------------------------------ gather ----

@torch.no_grad()
def gather_full_state(engine, model: torch.nn.Module, ctx, vocab_size: int,
                      state_key: Optional[str] = None, keep: bool = True
                      ) -> dict[str, torch.Tensor]:
    """The whole model's canonical fp32 CPU state, on every rank (``keep=False``: this rank
    takes part and gets ``{}``). Collective: every rank of the world calls it (ZeRO-3 gathers
    over data parallel, TP shards over tensor parallel, stages over pipeline parallel). Under
    bf16 or fp16 the weights are the optimizer's fp32 masters.

    ``state_key``: instead of the weights, that AdamW state of every parameter (``exp_avg`` or
    ``exp_avg_sq``, one of ``ADAM_STATE_KEYS``), in the same canonical names and full shapes
    (the vocabulary's padding rows dropped like the weights')."""
    import torch.distributed as dist

    from rtd_scale.model import weights

    if engine is not None and engine.zero_optimization_stage() == 3:
        # one parameter at a time from the optimizer's fp32 partitions (its masters, in fp32
        # too): DeepSpeed's ``safe_get_*`` accessors gather a ZeRO-3 parameter's partitions
        # themselves, so no process holds more of the model than what it keeps plus one
        # parameter, where gathering the whole model first (``GatheredParameters``) held its
        # 16-bit weights and an fp32 copy on every process beside the engine (ZeRO-3 has no
        # pipeline parallelism: no stages to merge)
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        def source(p: torch.nn.Parameter) -> torch.Tensor:
            t = (safe_get_full_fp32_param(p) if state_key is None
                 else safe_get_full_optimizer_state(p, state_key))
            return torch.zeros(p.ds_shape) if t is None else t.reshape(p.ds_shape)

        return weights.full_state_dict(model, tp_group=ctx.tp_group, vocab_size=vocab_size,
                                       source=source, keep=keep)
    params = list({id(p): p for p in model.parameters()}.values())
    with _master_weights(engine, params, state_key):
        # every stage's share is merged on every rank below, so only PP 1 can drop it here
        state = weights.full_state_dict(model, tp_group=ctx.tp_group, vocab_size=vocab_size,
                                        keep=keep or ctx.pp_size > 1)
    if ctx.pp_size > 1:  # every stage's share, merged by canonical (stage-independent) names
        shares = [None] * ctx.pp_size
        dist.all_gather_object(shares, state, group=ctx.pp_group)
        state = {k: v for share in shares for k, v in share.items()}
    return state if keep else {}


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

    base = _base(engine)
    if state_key is not None and base.state and hasattr(
            engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
        # ZeRO-1/2 and the bf16 optimizer link each parameter's view of the flat AdamW state
        # once, after their first group's first step, when the later groups have no state yet
        # (DeepSpeed 0.19.8 ``_optimizer_step``), and not at all after a load: link them now
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    copies = _fp32_copies(engine)
    saved = []
    for p in params:
        if id(p) in copies:  # ZeRO-0 in bf16: DeepSpeed's fp32 copy of p, and its AdamW state
            copy = copies[id(p)]
            master = copy if state_key is None else base.state[copy][state_key]
        elif state_key is None:
            master = safe_get_full_fp32_param(p)
        elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2, bf16 (ZeRO-3 reads its own above)
            master = safe_get_full_optimizer_state(p, state_key)
        else:  # ZeRO-0 in fp32: the client AdamW steps the model's own fp32 parameters
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


def _fp32_copies(engine) -> dict[int, torch.Tensor]:
    """id(parameter) → the fp32 copy the optimizer steps, where DeepSpeed keeps one per
    parameter: ``FP16_UnfusedOptimizer``, its ZeRO-0 wrapper in bf16 (and fp16) around a client
    optimizer other than its own FusedAdam (``DeepSpeedEngine._configure_fp16_optimizer``,
    0.19.8). Empty for every other optimizer."""
    opt = getattr(engine, "optimizer", None)
    if not (hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups")) or hasattr(
            opt, "fp32_groups_flat"):  # FP16_Optimizer's one flat copy: not per parameter
        return {}
    return {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups)
            for lp, hp in zip(lps, hps)}


def _base(engine):
    """The torch optimizer that holds the AdamW state (inside DeepSpeed's ZeRO or bf16
    wrapper, or the client optimizer itself at ZeRO-0 in fp32)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _adam_step(engine) -> float:
    """The AdamW step count the optimizer's state holds (every state agrees; 0 before the
    first step)."""
    base = _base(engine)
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    steps |= {float(g["step"]) for g in base.param_groups if "step" in g}
    if len(steps) > 1:
        raise RuntimeError(f"the optimizer's states hold different step counts {sorted(steps)}")
    return steps.pop() if steps else 0.0


def write(engine, model, ctx, vocab_size: int, out_dir: str, rank: int) -> None:
    """Gather the layout-free state of a live engine (collective); rank 0 writes ``STATE_FILE``
    and ``INFO_FILE`` into ``out_dir`` (:func:`write_kinds`)."""
    def gather(key: str, keep: bool) -> dict[str, torch.Tensor]:
        return gather_full_state(engine, model, ctx, vocab_size,
                                 state_key=None if key == "fp32" else key, keep=keep)

    write_kinds(gather, training_info(_adam_step(engine),
                                      getattr(engine.optimizer, "loss_scaler", None)),
                out_dir, rank)


def training_info(adam_step: float, scaler) -> dict:
    """``INFO_FILE``'s content: the AdamW step and the loss scaler's numbers (DeepSpeed's
    ``LossScaler`` / ``DynamicLossScaler``, or None)."""
    return {"adam_step": adam_step,
            "loss_scaler": {k: getattr(scaler, k) for k in
                            ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
                            if isinstance(getattr(scaler, k, None), (int, float))}}


def write_kinds(gather, info: dict, out_dir: str, rank: int) -> None:
    """Rank 0 writes ``STATE_FILE`` (each kind from ``gather(key, keep)``: collective, the
    whole kind on rank 0, ``{}`` elsewhere) and ``INFO_FILE`` (``info``) into ``out_dir``.

    One kind at a time (the weights, then each moment): the other ranks drop it at once, rank 0
    writes it to a file in ``out_dir`` and maps it back (``torch.load(mmap=True)``: file pages
    the kernel can reclaim, not the heap), so no rank holds more than one whole kind (4 bytes a
    parameter) beside what it reads from, where all three (12) made a large model's conversion
    the largest memory of its resume."""
    from rtd_scale.training.checkpoint.files import safe_load, torch_save

    state, spilled = {}, []
    for key in ("fp32", *ADAM_STATE_KEYS):
        full = gather(key, rank == 0)
        if rank == 0:  # the others got nothing (keep=False)
            spilled.append(os.path.join(out_dir, f".{key}.pt"))
            torch_save(full, spilled[-1])
            del full  # before the next kind is gathered: rank 0 maps its copy back
            state[key] = safe_load(spilled[-1], mmap=True)
    if rank == 0:
        torch_save(state, os.path.join(out_dir, STATE_FILE))
        del state
        for path in spilled:
            os.remove(path)
        with open(os.path.join(out_dir, INFO_FILE), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1, sort_keys=True)


# -------------------------------------------------------------------------------- load ----

def adam_step_value(base, group: dict, param: torch.Tensor, step: float):
    """AdamW's step count in the form ``base`` (the optimizer) keeps it: torch.optim.AdamW a
    float32 CPU tensor (on the device when fused or capturable), rtd_scale's
    ``NonFiniteSkippingAdamW`` a float64 tensor on the parameter's device, DeepSpeed's CPU Adam
    (ZeRO-Offload) a Python int. A checkpoint of one optimizer holds its own form; torch's AdamW
    refuses an int at its first step ("'state_steps' argument must contain a list of singleton
    tensors")."""
    from rtd_scale.training.optimizer import NonFiniteSkippingAdamW

    if isinstance(base, NonFiniteSkippingAdamW):
        return torch.tensor(float(step), dtype=torch.float64, device=param.device)
    if isinstance(base, torch.optim.Optimizer) and type(base).__module__.startswith("torch."):
        from torch.optim.optimizer import _get_scalar_dtype

        on_device = bool(group.get("fused") or group.get("capturable"))
        return torch.tensor(float(step), dtype=_get_scalar_dtype(is_fused=group.get("fused")),
                            device=param.device if on_device else "cpu")
    return int(step)


def _state_pairs(engine) -> list[tuple[dict, torch.Tensor]]:
    """(parameter group, tensor the optimizer steps) of every tensor with AdamW state."""
    opt, base = engine.optimizer, _base(engine)
    if hasattr(opt, "fp32_partitioned_groups_flat"):
        # ZeRO-3 puts each flat sub-group into its parameter group only while stepping it
        # (stage3.py ``_optimizer_step``)
        return [(base.param_groups[opt.sub_group_to_group_id[i]], hp)
                for i, hp in enumerate(opt.fp32_partitioned_groups_flat)]
    return [(group, hp) for group in base.param_groups for hp in group["params"]]


def group_settings(engine) -> list[dict]:
    """Every parameter group's settings but its tensors, as this run's optimizer was built
    (for :func:`match_optimizer`)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in _base(engine).param_groups]


def match_optimizer(engine, built: list[dict]) -> None:
    """After DeepSpeed's own load, the loaded optimizer state in the form this run's optimizer
    keeps it, whichever optimizer saved it — ZeRO-Offload on one side only, at one layout:
    every AdamW step count (:func:`adam_step_value`), and the group settings the loaded groups
    lack taken from ``built`` (:func:`group_settings` before the load; DeepSpeed's CPU Adam
    reads ``bias_correction``, which torch's AdamW does not save)."""
    base = _base(engine)
    for group, settings in zip(base.param_groups, built):
        for key, value in settings.items():
            group.setdefault(key, value)
    for group, hp in _state_pairs(engine):
        state = base.state.get(hp)
        if state and "step" in state:
            state["step"] = adam_step_value(base, group, hp, float(state["step"]))


def _init_adam_state(engine, step: float) -> None:
    """Give every tensor the AdamW steps its state (moments zero, the step count ``step``):
    DeepSpeed 0.19.8 and torch create it lazily at the first step, and the values below are
    copied into it. At ZeRO-1/2 and under DeepSpeed's bf16 optimizer the parameters' views of
    the flat state are then linked (``_lazy_init_hp_params_optimizer_state``)."""
    opt, base = engine.optimizer, _base(engine)
    for group, hp in _state_pairs(engine):
        state = base.state[hp]
        for key in ADAM_STATE_KEYS:
            if key not in state:
                state[key] = torch.zeros_like(hp, memory_format=torch.preserve_format)
        state["step"] = adam_step_value(base, group, hp, step)
    for group in base.param_groups:
        if "step" in group:
            group["step"] = int(step)
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def _set_parameter(engine, p, local: dict, copies: dict[int, torch.Tensor]) -> None:
    """This rank's share of one parameter's fp32 weights and AdamW moments (``local``: this
    tensor-parallel rank's full slice of each), in every ZeRO stage's own storage (``copies``:
    :func:`_fp32_copies`)."""
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
        for key in ADAM_STATE_KEYS:
            safe_set_full_optimizer_state(p, local[key].to(device), key)
    else:  # ZeRO-0: the client AdamW steps the parameter itself, or its fp32 copy in bf16
        hp = copies.get(id(p), p)
        hp.data.copy_(local["fp32"])
        p.data.copy_(local["fp32"].to(p.dtype))
        for key in ADAM_STATE_KEYS:
            _base(engine).state[hp][key].copy_(local[key])


class _WithShape:
    """A parameter as ``model.weights._local_slice`` reads it (its tensor-parallel attributes),
    with its unpartitioned shape (ZeRO-3 leaves an empty placeholder in ``p.shape``)."""

    def __init__(self, p, shape):
        self._p, self.shape = p, shape

    def __getattr__(self, name):
        return getattr(self._p, name)


def model_states(ckpt_dir: str) -> dict:
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


def load_into(engine, model, ctx, root: str, *, flag: str) -> None:
    """Slice the layout-free state in ``root`` into ``engine``, built at this run's layout: fp32
    weights, both AdamW moments, the AdamW step and the loss scaler. Collective (ZeRO-1/2 gather
    the updated weights). Reads ``state.pt`` with ``files.safe_load``, as DeepSpeed's reads are.

    Raises:
        UserInputError: the state does not fit this model (another parameter set or shape).
    """
    from rtd_scale.model import weights
    from rtd_scale.training.checkpoint.files import safe_load

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
    copies = _fp32_copies(engine)
    with torch.no_grad():
        for name, p in names.items():
            shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3: p itself is a placeholder
            local = {k: weights._local_slice(state[k][name], _WithShape(p, shape), ctx.tp_rank)
                     for k in ("fp32", *ADAM_STATE_KEYS)}
            if tuple(local["fp32"].shape) != shape:
                raise UserInputError(
                    f"{flag}: {name} has shape {tuple(state['fp32'][name].shape)} in {root}, "
                    f"which does not fit {shape} on tensor-parallel rank {ctx.tp_rank}; resume "
                    "at the checkpoint's layout and model flags")
            _set_parameter(engine, p, local, copies)
    if engine.zero_optimization_stage() != 3 and hasattr(engine.optimizer, "update_lp_params"):
        engine.optimizer.update_lp_params()  # the fp32 partitions into every rank's weights
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in (info.get("loss_scaler") or {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)


def load(engine, model, ctx, root: str, ckpt_dir: str, *, flag: str) -> dict:
    """Training's load of ``ckpt_dir`` (the checkpoint ``--load`` takes) through its
    layout-free state ``root`` (``convert.convert``): :func:`load_into`, then the schedule, the
    engine's step counters and the client state from the checkpoint's model-states file, the
    LOAD and AFTER_LOAD checks of ``checks.CHECKS`` around it, as around every load. Returns
    the client state."""
    from rtd_scale.training.checkpoint import checks

    checks.run(checks.Moment.LOAD, engine=engine)
    load_into(engine, model, ctx, root, flag=flag)
    states = model_states(ckpt_dir)
    if engine.lr_scheduler is not None and states.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states["lr_scheduler"])
    engine.global_steps = states["global_steps"]
    engine.global_samples = states.get("global_samples",
                                       engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = states["skipped_steps"]
    checks.run(checks.Moment.AFTER_LOAD, engine=engine, ckpt_dir=ckpt_dir, loaded=root,
               flag=flag)
    return {k: v for k, v in states.items() if k not in _DEEPSPEED_KEYS}
