"""The user's DeepSpeed JSON: every key is honoured, mapped onto rtd_scale's config, or refused.

Ownership (STYLE rule 2): the file holds DeepSpeed's own knobs (``zero_optimization`` and the
like); batch sizes, precision, gradient clipping, the optimizer and the schedule come from
rtd_scale's flags. Each top-level key of the file falls in one class:

- ``HONOURED``: passed to DeepSpeed as written (ZeRO, its offload and I/O, communication,
  DeepSpeed's own logging and profiling);
- ``OWNED``: derived from our flags; the file may repeat the flag's value or say ``"auto"``,
  anything else is an error (never a silent winner). ``fp16`` / ``bf16``: ``enabled`` is the
  precision flag's, the other fields (the loss scaler's) are honoured;
- ``MAPPED``: ``activation_checkpointing`` turns on megatron-core's full-layer recompute in both
  models (``model.recompute_activations``, as ``--recompute-activations``); its fields that
  megatron-core's recompute cannot honour are refused;
- ``REFUSED``: keys DeepSpeed knows that rtd_scale does not wire up, each with what to use;
- anything else is not a DeepSpeed key: refused with the closest known key (``difflib``).

Nested sections are checked with DeepSpeed's own pydantic models (``DeepSpeedZeroConfig``,
``DeepSpeedFP16Config``, ``DeepSpeedBF16Config``; DeepSpeed 0.19.8), so a misspelled field is
found before any process group starts. DeepSpeed itself ignores an unknown top-level key without
a word and a stage-3 field at stage 1 or 2; here both are errors. Every problem of a file is
reported at once, in one ``UserInputError`` line.
"""
from __future__ import annotations

import difflib
import json
import os
from typing import Any, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.batch import rank_share
from rtd_scale.config import Precision, RunConfig

# Derived from our flags: the flag (or rule) that sets each.
OWNED = {
    "train_batch_size": "--global-batch-size",
    "train_micro_batch_size_per_gpu": "--micro-batch-size",
    "gradient_accumulation_steps": "--global-batch-size / (--micro-batch-size × data-parallel size)",
    "gradient_clipping": "--clip-grad",
    "bf16": "--bf16",
    "bfloat16": "--bf16",  # DeepSpeed's older name of the bf16 section
    "fp16": "--fp16",
    "zero_allow_untested_optimizer": "rtd_scale's AdamW (always true)",
    "managed_gradient_accumulation": "--pipeline-model-parallel-size",
}

# Passed to DeepSpeed as written.
HONOURED = {
    "zero_optimization": "ZeRO stage, buckets, offload (checked field by field)",
    "zero_force_ds_cpu_optimizer": "ZeRO-Offload's optimizer: true (default) DeepSpeedCPUAdam, "
                                   "false torch.optim.AdamW",
    "aio": "asynchronous I/O of NVMe offload",
    "communication_data_type": "dtype of gradient reduction",
    "prescale_gradients": "gradient reduction",
    "gradient_predivide_factor": "gradient reduction",
    "gradient_allreduce_op": "gradient reduction",
    "disable_allgather": "gradient reduction",
    "data_types": "DeepSpeed's dtypes (grad_accum_dtype defaults to fp32 under bf16)",
    "steps_per_print": "DeepSpeed's own progress lines (off unless set)",
    "wall_clock_breakdown": "DeepSpeed's timers",
    "memory_breakdown": "DeepSpeed's memory lines",
    "dump_state": "DeepSpeed's config dump",
    "log_level": "DeepSpeed's logger",
    "timers": "DeepSpeed's timers",
    "flops_profiler": "DeepSpeed's FLOPs profiler",
    "comms_logger": "DeepSpeed's communication logger",
    "csv_monitor": "DeepSpeed's monitor",
    "wandb": "DeepSpeed's monitor",
    "comet": "DeepSpeed's monitor",
    "disable_python_gc": "DeepSpeed's garbage-collection control",
    "checkpoint": "tag_validation only",
}

MAPPED = {"activation_checkpointing": "model.recompute_activations (megatron-core full-layer "
                                      "recompute in both models, as --recompute-activations)"}

# Keys DeepSpeed 0.19.8 reads that rtd_scale does not wire up, and what to use instead.
REFUSED = {
    "optimizer": "rtd_scale builds AdamW from --lr, --weight-decay, --adam-beta1/2, --adam-eps",
    "scheduler": "rtd_scale builds its schedule from --lr-warmup-iters, --lr-decay-style and "
                 "friends",
    "amp": "Apex AMP is not used; pass --bf16 or --fp16",
    "torch_autocast": "precision comes from --bf16 or --fp16",
    "elasticity": "batch sizes come from --global-batch-size and --micro-batch-size",
    "autotuning": "batch sizes come from --global-batch-size and --micro-batch-size",
    "pipeline": "pipeline parallelism is megatron-core's: --pipeline-model-parallel-size",
    "tensor_parallel": "tensor parallelism is megatron-core's: --tensor-model-parallel-size",
    "sequence_parallel_size": "DeepSpeed-Ulysses sequence parallelism is not supported",
    "seq_parallel_communication_data_type": "DeepSpeed-Ulysses sequence parallelism is not "
                                            "supported",
    "expert_parallel": "the encoders have no mixture-of-experts layers",
    "use_data_before_expert_parallelism": "the encoders have no mixture-of-experts layers",
    "hybrid_engine": "DeepSpeed-Chat's inference engine is not used in pretraining",
    "compression_training": "DeepSpeed's compression is not wired into the encoders",
    "quantize_training": "DeepSpeed's quantization is not wired into the encoders",
    "weight_quantization": "DeepSpeed's quantization is not wired into the encoders",
    "eigenvalue": "not wired into the encoders",
    "progressive_layer_drop": "not wired into the encoders",
    "sparse_attention": "the encoders use megatron-core's attention",
    "sparse_gradients": "the embeddings have dense gradients",
    "vocabulary_size": "the vocabulary comes from --tokenizer-model",
    "data_efficiency": "the data order is rtd_scale's sampler's (--data-path, --seed)",
    "curriculum_learning": "the data order is rtd_scale's sampler's (--data-path, --seed)",
    "dataloader_drop_last": "rtd_scale's loader, not DeepSpeed's, feeds the model",
    "compile": "use --compile-layers",
    "graph_harvesting": "not supported; use --compile-layers",
    "nebula": "checkpoints are written by --save (DeepSpeed's torch checkpoint engine)",
    "datastates_ckpt": "checkpoints are written by --save (DeepSpeed's torch checkpoint engine)",
    "tensorboard": "rtd_scale writes TensorBoard itself: --tensorboard-dir (default "
                   "<save>/tensorboard)",
}

SUPPORTED = sorted({*OWNED, *HONOURED, *MAPPED} - {"bfloat16", "managed_gradient_accumulation"})

# activation_checkpointing fields: the value megatron-core's full-layer recompute gives, and why
# another value cannot be honoured (DeepSpeed's deepspeed.checkpointing options, which act only
# on modules that call deepspeed.checkpointing.checkpoint).
_ACT_CKPT = {
    "partition_activations": (False, "megatron-core's full-layer recompute keeps each layer's "
                                     "input whole on every tensor-parallel rank"),
    "cpu_checkpointing": (False, "megatron-core's recompute keeps its checkpoints on the device; "
                                 "for memory use ZeRO-Offload (zero_optimization.offload_*)"),
    "contiguous_memory_optimization": (False, "it needs partition_activations"),
    "number_checkpoints": (None, "it sizes contiguous_memory_optimization's buffers"),
    "synchronize_checkpoint_boundary": (False, "megatron-core's recompute has no such "
                                               "synchronisation"),
    "profile": (False, "megatron-core's recompute has no profiler"),
}

# zero_optimization fields that act only at stage 3 (DeepSpeed 0.19.8's stage-3 optimizer and
# parameter partitioning); DeepSpeed ignores them at stages 0–2 without a word.
_STAGE3_ONLY = {"offload_param", "cpu_offload_param", "prefetch_bucket_size",
                "param_persistence_threshold", "model_persistence_threshold",
                "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
                "module_granularity_threshold", "use_all_reduce_for_fetch_params",
                "allgather_sequential", "zero_hpz_partition_size", "zero_quantized_weights",
                "zero_quantized_nontrainable_weights"}


def load_ds_config(path: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON config.

    Raises:
        UserInputError: the file is missing, not JSON, or not a JSON object (names the file).
    """
    if not os.path.isfile(path):
        raise UserInputError(f"--ds_config {path}: no such file; pass one of ds_configs/*.json")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise UserInputError(f"--ds_config {path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise UserInputError(f"--ds_config {path}: expected a JSON object at the top level")
    return data


def _closest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _model_keys(model) -> set[str]:
    """Field names and aliases a DeepSpeed pydantic config accepts."""
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        if info.alias:
            keys.add(info.alias)
    return keys


def _nested_model(model, loc: tuple) -> Any:
    """The pydantic model at ``loc`` (a path of field names) inside ``model``, or None."""
    import typing

    for part in loc:
        info = model.model_fields.get(part)
        if info is None:
            info = next((i for i in model.model_fields.values() if i.alias == part), None)
        if info is None:
            return None
        ann = info.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)] or [ann]
        model = next((a for a in args if hasattr(a, "model_fields")), None)
        if model is None:
            return None
    return model


def _validate_section(section: str, value: Any, model, problems: list[str]):
    """Build DeepSpeed's pydantic ``model`` from ``value``; one problem per invalid field."""
    from pydantic import ValidationError

    if not isinstance(value, dict):
        problems.append(f"{section}: expected a JSON object, got {json.dumps(value)}")
        return None
    try:
        return model(**value)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(str(p) for p in err["loc"])
            where = ".".join((section,) + loc)
            if err["type"] == "extra_forbidden":
                parent = _nested_model(model, loc[:-1])
                hint = _closest(loc[-1], sorted(_model_keys(parent))) if parent else ""
                problems.append(f"{where}: not a DeepSpeed field{hint}")
            else:
                problems.append(f"{where}={json.dumps(err.get('input'))}: {err['msg']}")
    except (ValueError, AssertionError) as e:  # DeepSpeed's own model validators
        problems.append(f"{section}: {' '.join(str(e).split())}")
    return None


def fp16_supported() -> bool:
    """Whether DeepSpeed's accelerator on this machine runs fp16 (a CUDA GPU; a CPU only with
    oneDNN fp16 kernels: AVX512-FP16 / AMX-FP16). DeepSpeed 0.19.8's engine refuses fp16
    otherwise (``_do_sanity_check``)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def _check_precision(user: dict[str, Any], precision: Precision, problems: list[str]) -> None:
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

    if "bf16" in user and "bfloat16" in user:
        problems.append("bf16 and bfloat16 are the same section; keep bf16")
    flags = {"bf16": "--bf16", "bfloat16": "--bf16", "fp16": "--fp16"}
    wanted = {"bf16": Precision.BF16, "bfloat16": Precision.BF16, "fp16": Precision.FP16}
    for key, model in (("bf16", DeepSpeedBF16Config), ("bfloat16", DeepSpeedBF16Config),
                       ("fp16", DeepSpeedFP16Config)):
        if key not in user:
            continue
        section = user[key]
        if _validate_section(key, section, model, problems) is None:
            continue
        want = precision is wanted[key]
        enabled = section.get("enabled", "auto")
        if enabled != "auto" and bool(enabled) != want:
            hint = (f"pass {flags[key]}" if enabled else "remove the section")
            problems.append(f"{key}.enabled={json.dumps(enabled)} contradicts the precision "
                            f"({precision.value}); {hint}")
            continue
        others = sorted(k for k, v in section.items() if k != "enabled" and v != "auto")
        if not want and others:
            problems.append(f"{key}.{others[0]} acts only under {flags[key]} (the precision is "
                            f"{precision.value}); pass {flags[key]} or remove the {key} section")
        if key == "fp16" and section.get("auto_cast"):
            problems.append("fp16.auto_cast=true casts floating-point inputs, and the inputs are "
                            "token ids; remove it")
        if want and key != "fp16" and section.get("check_grad_overflow", True) is False:
            # DeepSpeed's ZeRO 1/2 optimizer skips a step with a non-finite gradient norm under
            # bf16 only with this on (its stage 3 and bf16 optimizer always do): the NaN policy
            # (training/loop.py, NonFiniteGuard) relies on the skip
            problems.append(f"{key}.check_grad_overflow=false would let a step with a "
                            "non-finite gradient norm update the weights; remove it")


def _check_zero(user: dict[str, Any], cfg: RunConfig, problems: list[str]) -> Optional[Any]:
    """Validate ``zero_optimization``; returns DeepSpeed's parsed ``DeepSpeedZeroConfig``."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    raw = user.get("zero_optimization", {})
    stage = raw.get("stage", 0) if isinstance(raw, dict) else 0
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        problems.append(f"zero_optimization.stage is {json.dumps(raw['stage'])}; DeepSpeed's "
                        "stages are 0, 1, 2 and 3")
        _validate_section("zero_optimization", {k: v for k, v in raw.items() if k != "stage"},
                          DeepSpeedZeroConfig, problems)  # the other fields, all at once
        return None
    zero = _validate_section("zero_optimization", raw, DeepSpeedZeroConfig, problems)
    if not isinstance(raw, dict):
        return None
    # the checks on field names run even when a value is invalid: every problem at once
    stage = raw.get("stage", 0)
    aliases = {info.alias: name for name, info in DeepSpeedZeroConfig.model_fields.items()
               if info.alias}
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                     ("cpu_offload_use_pin_memory", "offload_*.pin_memory")):
        if old in raw:
            problems.append(f"zero_optimization.{old} is DeepSpeed's deprecated spelling; write "
                            f"{new} instead (e.g. \"offload_optimizer\": {{\"device\": "
                            "\"cpu\"}})")
    if stage in (0, 1, 2):
        for key in sorted(raw):
            if aliases.get(key, key) in _STAGE3_ONLY:
                problems.append(f"zero_optimization.{key} acts only at stage 3 (this file has "
                                f"stage {stage}); remove it or set stage 3")
    if zero is None:
        return None
    stage = int(zero.stage)
    offload_opt = zero.offload_optimizer is not None and zero.offload_optimizer.device != "none"
    offload_param = zero.offload_param is not None and zero.offload_param.device != "none"
    if offload_opt and stage == 0:
        problems.append("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (this "
                        "file has stage 0); set a stage")
    pp = cfg.parallel.pipeline_model_parallel_size
    if (offload_opt or offload_param) and pp > 1:
        problems.append(f"zero_optimization.offload_* with --pipeline-model-parallel-size {pp} "
                        "is not supported (the pipeline step drives DeepSpeed's optimizer "
                        "itself); remove the offload or use --pipeline-model-parallel-size 1")
    for name, sub in (("offload_optimizer", zero.offload_optimizer),
                      ("offload_param", zero.offload_param)):
        if sub is not None and sub.device == "nvme" and not _nvme_available():
            problems.append(f"zero_optimization.{name}.device=nvme needs DeepSpeed's async_io op "
                            "(libaio), which cannot be built here; use device cpu")
    if zero.zenflow is not None:
        problems.append("zero_optimization.zenflow needs DeepSpeed's own optimizer step; "
                        "remove it")
    if pp > 1 and stage != 1:
        problems.append(
            f"ZeRO stage {stage} with --pipeline-model-parallel-size {pp} is not supported: with "
            "pipeline parallelism the optimizer state is sharded by ZeRO stage 1 only (stage 3 "
            "gathers parameters in module hooks that megatron-core's schedule bypasses; stage 2 "
            "partitions gradients before the tied embedding's gradients are summed); use "
            "ds_configs/zero1.json")
    return zero


def _nvme_available() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # no builder for this accelerator
        return False


def _check_activation_checkpointing(section: Any, problems: list[str]) -> None:
    if not isinstance(section, dict):
        problems.append(f"activation_checkpointing: expected a JSON object, got "
                        f"{json.dumps(section)}")
        return
    for key in sorted(section):
        value = section[key]
        if key not in _ACT_CKPT:
            problems.append(f"activation_checkpointing.{key}: not a DeepSpeed field"
                            f"{_closest(key, sorted(_ACT_CKPT))}")
            continue
        ok, why = _ACT_CKPT[key]
        if value is not ok and value not in ("auto", None):
            problems.append(f"activation_checkpointing.{key}={json.dumps(value)} is not "
                            f"supported: {why}; remove it (the section turns on megatron-core's "
                            "full-layer recompute)")


def offloads_optimizer(ds_config: dict[str, Any]) -> bool:
    """Whether a resolved ds_config puts the optimizer step on the CPU (ZeRO-Offload, or
    ZeRO-Infinity's NVMe; DeepSpeed's ``zero_use_cpu_optimizer``)."""
    zero = ds_config.get("zero_optimization", {})
    device = (zero.get("offload_optimizer") or {}).get("device", "none")
    return zero.get("stage", 0) > 0 and device in ("cpu", "nvme")


def resolve_ds_config(user: dict[str, Any], cfg: RunConfig, *, data_parallel_size: int,
                      gradient_accumulation_steps: int, source: str = "ds_config",
                      fp16_ok: Optional[bool] = None) -> dict[str, Any]:
    """Check every key of a user's ds_config and merge it with the values rtd_scale owns.

    Maps ``activation_checkpointing`` onto ``cfg.model.recompute_activations`` (sets it True).
    A resolved ds_config resolves again to itself.
    ``fp16_ok``: whether this machine runs fp16 (``fp16_supported()`` when None); asked only
    under ``--fp16``.

    Returns the ds_config to hand to ``deepspeed.initialize`` (``zero_optimization`` as
    written, the batch numbers, clipping and precision from ``cfg``).

    Raises:
        UserInputError: one line listing every problem of the file: an unknown or refused key
            (with the closest supported key), a nested field DeepSpeed's own config models
            reject, a value contradicting a flag, a field with no effect in this configuration.
    """
    t = cfg.train
    problems: list[str] = []
    top_level_refused = False
    for key in user:
        if key in REFUSED:
            if key in ("optimizer", "scheduler"):
                problems.append(f"defines {key!r}, but {REFUSED[key]}; remove that section")
            else:
                problems.append(f"{key!r} is not supported: {REFUSED[key]}; remove it")
            top_level_refused = True
        elif key not in OWNED and key not in HONOURED and key not in MAPPED:
            hint = _closest(key, SUPPORTED) or _closest(key, sorted(REFUSED))
            problems.append(f"{key!r} is not a DeepSpeed key{hint}")
            top_level_refused = True

    ours: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        # DeepSpeed 0.19.8 clips at 1.0 when this key is absent: always write ours.
        "gradient_clipping": cfg.optim.clip_grad,
    }
    pp = cfg.parallel.pipeline_model_parallel_size
    also = {}  # under pipeline parallelism the resolved file holds these (below); both agree
    if pp > 1:
        per_rank, _ = rank_share(t.global_batch_size, t.micro_batch_size, data_parallel_size)
        also = {"train_micro_batch_size_per_gpu": per_rank,
                "gradient_accumulation_steps": 1}
    for key in ours:
        if key in user and user[key] not in ("auto", ours[key], also.get(key, ours[key])):
            problems.append(f"{key}={json.dumps(user[key])} contradicts {OWNED[key]} (which "
                            f"gives {ours[key]}); remove {key!r} from the file or set it to "
                            "\"auto\"")
    if user.get("zero_allow_untested_optimizer", True) is not True and \
            user.get("zero_allow_untested_optimizer") != "auto":
        problems.append("zero_allow_untested_optimizer=false would refuse rtd_scale's own AdamW; "
                        "remove it")
    managed = cfg.parallel.pipeline_model_parallel_size == 1  # what rtd_scale sets
    if user.get("managed_gradient_accumulation", managed) not in (managed, "auto"):
        problems.append(f"managed_gradient_accumulation="
                        f"{json.dumps(user['managed_gradient_accumulation'])} contradicts "
                        f"--pipeline-model-parallel-size (which gives {json.dumps(managed)}); "
                        "remove it")
    if "checkpoint" in user:
        ck = user["checkpoint"]
        extra = sorted(set(ck) - {"tag_validation"}) if isinstance(ck, dict) else ["(not an object)"]
        for key in extra:
            problems.append(f"checkpoint.{key} is not supported: rtd_scale's --save/--load use "
                            "DeepSpeed's standard checkpoint layout (only tag_validation is "
                            "honoured); remove it")

    _check_precision(user, t.precision, problems)
    zero = _check_zero(user, cfg, problems)
    if "activation_checkpointing" in user:
        _check_activation_checkpointing(user["activation_checkpointing"], problems)
    fp16 = t.precision is Precision.FP16
    if fp16 and cfg.parallel.pipeline_model_parallel_size > 1:
        problems.append(f"--fp16 with --pipeline-model-parallel-size "
                        f"{cfg.parallel.pipeline_model_parallel_size} is not supported (the "
                        "pipeline step has no loss scaler); use --bf16")
    if fp16 and not (fp16_supported() if fp16_ok is None else fp16_ok):
        problems.append("--fp16: DeepSpeed runs fp16 only where the accelerator supports it (a "
                        "CUDA GPU, or a CPU with oneDNN fp16 kernels), and this machine's does "
                        "not; use --bf16 (or fp32) here")
    if problems:
        listing = (f"; supported top-level keys: {', '.join(SUPPORTED)}"
                   if top_level_refused else "")
        if len(problems) == 1:
            raise UserInputError(f"{source}: {problems[0]}{listing}")
        raise UserInputError(f"{source}: {len(problems)} problems: "
                             + "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
                             + listing)

    if "activation_checkpointing" in user:
        cfg.model.recompute_activations = True
    stage = int(zero.stage) if zero is not None else 0
    # megatron-core's pipeline schedule accumulates the micro-batches' gradients in param.grad;
    # DeepSpeed sees one step of global_batch / dp samples per rank
    ours.update(also)
    # activation_checkpointing stays in the file (DeepSpeed reads it and does nothing with it):
    # passed again as --ds_config, the resolved file maps it again
    resolved = {k: v for k, v in user.items() if k != "bfloat16"}
    resolved.update(ours)
    if pp > 1:
        resolved["managed_gradient_accumulation"] = False
    bf16 = t.precision is Precision.BF16
    resolved["bf16"] = {**user.get("bf16", user.get("bfloat16", {})), "enabled": bf16}
    if bf16:
        resolved["bf16"]["check_grad_overflow"] = True
    if fp16:
        resolved["fp16"] = {**user.get("fp16", {}), "enabled": True}
    else:
        resolved.pop("fp16", None)
    resolved.setdefault("steps_per_print", 10**9)  # our own log lines replace DeepSpeed's
    resolved.setdefault("wall_clock_breakdown", False)
    resolved["zero_allow_untested_optimizer"] = True  # client optimizer (training/engine.py)
    if bf16 and stage in (1, 2, 3):
        resolved.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    return resolved
