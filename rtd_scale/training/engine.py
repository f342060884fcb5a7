"""The DeepSpeed engine: resolved ds_config, AdamW, the learning-rate schedule.

Ownership (STYLE rule 2): the ds_config file holds DeepSpeed's own knobs (``zero_optimization``
and the like); batch sizes, precision, gradient clipping, the optimizer and the schedule come from
rtd_scale's config. A value in the file that contradicts ours is an error, never a silent winner;
"auto" defers to ours.
"""
from __future__ import annotations

from rtd_scale.cli_errors import UserInputError

import json
import os
from typing import Any

import torch

from rtd_scale.config import OptimConfig, Precision, RunConfig

# ds_config keys that rtd_scale derives from its own config, and the flag that sets each.
_OWNED = {
    "train_batch_size": "--global-batch-size",
    "train_micro_batch_size_per_gpu": "--micro-batch-size",
    "gradient_accumulation_steps": "--global-batch-size / (--micro-batch-size × data-parallel size)",
    "gradient_clipping": "--clip-grad",
}


def load_ds_config(path: str) -> dict[str, Any]:
    """Read a DeepSpeed JSON config.

    Raises:
        ValueError: the file is missing, not JSON, or not a JSON object (message names the file).
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


def resolve_ds_config(user: dict[str, Any], cfg: RunConfig, *, data_parallel_size: int,
                      gradient_accumulation_steps: int, source: str = "ds_config") -> dict[str, Any]:
    """Merge a user's ds_config with the values rtd_scale owns.

    Raises:
        ValueError: a batch number, the clipping or the precision in the file contradicts the
            flags; or the file defines an optimizer or scheduler (rtd_scale builds them).
    """
    t = cfg.train
    ours: dict[str, Any] = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        # DeepSpeed 0.19.8 clips at 1.0 when this key is absent: always write ours.
        "gradient_clipping": cfg.optim.clip_grad,
    }
    for key, flag in _OWNED.items():
        if key in user and user[key] != "auto" and user[key] != ours[key]:
            raise UserInputError(
                f"{source}: {key}={user[key]} contradicts {flag} (which gives {ours[key]}); "
                f"remove {key!r} from the file or set it to \"auto\"")
    for section in ("optimizer", "scheduler"):
        if section in user:
            raise UserInputError(
                f"{source}: defines {section!r}, but rtd_scale builds AdamW and its schedule from "
                "--lr, --lr-warmup-iters and friends; remove that section")
    bf16 = t.precision is Precision.BF16
    for key, want in (("bf16", bf16), ("fp16", False)):
        enabled = user.get(key, {}).get("enabled", want)
        if enabled != "auto" and bool(enabled) != want:
            hint = "pass --bf16" if key == "bf16" and enabled else "remove the section"
            raise UserInputError(f"{source}: {key}.enabled={enabled} contradicts the precision "
                             f"({t.precision.value}); {hint}")
    zero = user.get("zero_optimization", {}).get("stage", 0)
    pp = cfg.parallel.pipeline_model_parallel_size
    if pp > 1:
        if zero != 1:
            raise UserInputError(
                f"{source}: ZeRO stage {zero} with --pipeline-model-parallel-size {pp} is not "
                "supported: with pipeline parallelism the optimizer state is sharded by ZeRO "
                "stage 1 only (stage 3 gathers parameters in module hooks that megatron-core's "
                "schedule bypasses; stage 2 partitions gradients before the tied embedding's "
                "gradients are summed); use ds_configs/zero1.json")
        # megatron-core's schedule accumulates the micro-batches' gradients in param.grad;
        # DeepSpeed sees one step of global_batch / dp samples per rank
        ours["train_micro_batch_size_per_gpu"] = t.global_batch_size // data_parallel_size
        ours["gradient_accumulation_steps"] = 1
    resolved = dict(user)
    resolved.update(ours)
    if pp > 1:
        resolved["managed_gradient_accumulation"] = False
    resolved["bf16"] = {**user.get("bf16", {}), "enabled": bf16}
    resolved.pop("fp16", None)
    resolved.setdefault("steps_per_print", 10**9)  # our own log lines replace DeepSpeed's
    resolved.setdefault("wall_clock_breakdown", False)
    resolved["zero_allow_untested_optimizer"] = True  # client torch.optim.AdamW
    if bf16 and zero in (1, 2, 3):
        resolved.setdefault("data_types", {}).setdefault("grad_accum_dtype", "fp32")
    return resolved


def lr_lambda(optim: OptimConfig, train_iters: int):
    """Learning-rate multiplier for LambdaLR: linear warm-up, then linear decay to min_lr.

    Counted in optimizer steps (case C18): update number u = e + 1 (LambdaLR's epoch e starts
    at 0) uses lr · u / warmup while u <= warmup — so update ``lr_warmup_iters`` is the first at
    the peak — then decays linearly to min_lr at update ``lr_decay_iters`` (default train_iters).
    """
    warm = optim.lr_warmup_iters
    decay = optim.lr_decay_iters or train_iters
    floor = optim.min_lr / optim.lr

    def f(e: int) -> float:
        u = e + 1
        if warm > 0 and u <= warm:
            return u / warm
        if decay <= warm or u >= decay:
            return floor if u >= decay else 1.0
        return floor + (1.0 - floor) * (decay - u) / (decay - warm)

    return f


def build_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, arXiv 1711.05101); no decay on biases, norms and 1-D
    parameters. Fused on GPU."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.adam_beta1, optim.adam_beta2),
                             eps=optim.adam_eps, **kwargs)


def build_engine(model, cfg: RunConfig, ds_config: dict[str, Any], mpu):
    """``deepspeed.initialize`` with our optimizer, schedule and groups.

    Under ZeRO-3, parameters read by a module that does not own them (the tied MLM output, the
    GDES base table) are registered as external parameters of the reading module.
    """
    import deepspeed

    optimizer = build_optimizer(model, cfg.optim)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(cfg.optim, cfg.train.train_iters))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=ds_config, mpu=mpu)
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        for module, param in model.foreign_parameters():
            deepspeed.zero.register_external_parameter(module, param)
    return engine

