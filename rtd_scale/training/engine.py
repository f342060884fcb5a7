"""The DeepSpeed engine: resolved ds_config, AdamW, the learning-rate schedule.

Ownership (STYLE rule 2): the ds_config file holds DeepSpeed's own knobs (``zero_optimization``
and the like); batch sizes, precision, gradient clipping, the optimizer and the schedule come from
rtd_scale's config. A value in the file that contradicts ours is an error, never a silent winner;
"auto" defers to ours.
"""
from __future__ import annotations

from rtd_scale.cli_errors import UserInputError

import enum
import json
import os
import sys
from typing import Any, Optional

import torch

from rtd_scale.config import OptimConfig, Precision, RunConfig

# The ds_config's checks and merge live in training/ds_config.py; imported here by callers.
from rtd_scale.training.ds_config import (load_ds_config, offloads_optimizer,  # noqa: E402,F401
                                          resolve_ds_config)


# The schedule's fields a resumed run compares with its checkpoint's, and their flags.
SCHEDULE_FIELDS = {"lr": "--lr", "min_lr": "--min-lr", "lr_warmup_iters": "--lr-warmup-iters",
                   "lr_decay_iters": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
                   "lr_warmup_fraction": "--lr-warmup-fraction",
                   "lr_warmup_samples": "--lr-warmup-samples",
                   "lr_decay_samples": "--lr-decay-samples", "lr_warmup_init": "--lr-warmup-init",
                   "lr_wsd_decay_style": "--lr-wsd-decay-style",
                   "lr_wsd_decay_iters": "--lr-wsd-decay-iters",
                   "lr_wsd_decay_samples": "--lr-wsd-decay-samples"}


def resolve_resume_schedule(optim: OptimConfig, saved: dict[str, Any], *, source: str,
                            saved_train_iters: Optional[int] = None) -> Optional[str]:
    """Decide the learning-rate schedule of a resumed run (Megatron-LM's rule,
    ``OptimizerParamScheduler._check_and_set``): when one of ``optim``'s ``SCHEDULE_FIELDS``
    (peak, floor, warm-up and decay lengths, decay style) differs from ``saved`` (the
    checkpoint's ``optim`` section; fields it lacks are not compared), the flags'
    values apply from the first resumed iteration with ``override_opt_param_scheduler``, and
    the checkpoint's are copied into ``optim`` with ``use_checkpoint_opt_param_scheduler``.
    A changed ``--train-iters`` alone is no difference (the decay follows it when
    lr_decay_iters is unset). Returns a one-line note saying which schedule applies, or None
    when nothing differs.

    Raises:
        UserInputError: a difference and neither flag (naming both values of each field).
    """
    diffs = [name for name in SCHEDULE_FIELDS
             if name in saved and saved[name] != getattr(optim, name)]
    if not diffs:
        return None

    def show(name: str, value: Any) -> str:
        if value is None:
            return "unset" + (f" (= --train-iters {saved_train_iters})"
                              if name == "lr_decay_iters" and saved_train_iters is not None
                              else "")
        if isinstance(value, enum.Enum):
            return str(value.value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    change = ", ".join(f"{SCHEDULE_FIELDS[n]} {show(n, saved[n])} → {show(n, getattr(optim, n))}"
                       for n in diffs)
    if optim.override_opt_param_scheduler:
        return (f"note: the learning-rate schedule differs from the checkpoint's ({change}); "
                "--override-opt_param-scheduler: the new values apply from the first resumed "
                "iteration")
    if optim.use_checkpoint_opt_param_scheduler:
        for name in diffs:
            setattr(optim, name, saved[name])
        optim.validate()  # the saved strings back to their enums
        return (f"note: the learning-rate schedule differs from the checkpoint's ({change}); "
                "--use-checkpoint-opt_param-scheduler: the checkpoint's values are kept")
    raise UserInputError(
        f"--load {source}: the learning-rate schedule differs from the checkpoint's ({change}); "
        "pass --override-opt_param-scheduler to use the new values from the first resumed "
        "iteration, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


class NonFiniteSkippingAdamW(torch.optim.AdamW):
    """AdamW whose step is a no-op, decided on the device, when any gradient is inf or NaN.

    Used only where DeepSpeed hands the update to the client optimizer unchecked: ZeRO stage 0
    in fp32 (its ZeRO 1–3 optimizers and its bf16 wrappers check the gradient norm themselves
    and skip such a step). A skipped step leaves the parameters, both moments and the step
    count exactly as they were, like DeepSpeed's skip; no value reaches the host (no sync):
    every update is computed and then kept or dropped by ``torch.where``.

    The flag is the L2 norm of all of this rank's gradients (``torch._foreach_norm``), ANDed
    over ``model_parallel_group`` so that tensor-parallel peers agree; data-parallel peers hold
    the same reduced gradients at stage 0. ``skipped`` is the last step's flag, a bool tensor.

    The update is AdamW's (arXiv 1711.05101; torch.optim.AdamW's single-tensor form, with the
    step count kept on the device), so it agrees with ``torch.optim.AdamW`` to rounding.
    """

    def __init__(self, params, *, model_parallel_group=None, **kwargs):
        super().__init__(params, foreach=False, **kwargs)
        self.model_parallel_group = model_parallel_group
        self.skipped: Optional[torch.Tensor] = None

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "closures are not supported"
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return None
        norms = torch._foreach_norm([p.grad for p in params])
        ok = torch.isfinite(torch.stack(norms).sum()).to(torch.int32)
        if (torch.distributed.is_initialized() and self.model_parallel_group is not None
                and torch.distributed.get_world_size(self.model_parallel_group) > 1):
            torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN,
                                         group=self.model_parallel_group)
        ok = ok.bool()
        self.skipped = ~ok
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if state["step"].device != p.device:  # a checkpoint loaded onto another device
                    state["step"] = state["step"].to(p.device)
                step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                g = p.grad
                step.add_(ok.to(step.dtype))
                m_new = m.lerp(g, 1 - beta1)
                v_new = v.mul(beta2).addcmul_(g, g, value=1 - beta2)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2_sqrt = (1 - beta2 ** step).sqrt()
                denom = (v_new.sqrt() / bias_correction2_sqrt).add_(eps)
                p_new = p.mul(1 - lr * wd).sub_(m_new / denom * (lr / bias_correction1))
                m.copy_(torch.where(ok, m_new, m))
                v.copy_(torch.where(ok, v_new, v))
                p.copy_(torch.where(ok, p_new, p))
        return None


def _param_groups(model: torch.nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    return [{"params": decay, "weight_decay": optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, *, checked: bool = False,
                    model_parallel_group=None, cpu_adam: bool = False,
                    cpu_offload: bool = False) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, arXiv 1711.05101); no decay on biases, norms and 1-D
    parameters. Fused on GPU. ``checked``: a ``NonFiniteSkippingAdamW`` instead (ZeRO stage 0
    in fp32, where DeepSpeed does not skip non-finite steps itself). ``cpu_adam``: DeepSpeed's
    ``DeepSpeedCPUAdam`` in AdamW mode with the same hyper-parameters and groups (ZeRO-Offload,
    whose optimizer step runs on the CPU; a C++ op DeepSpeed compiles on first use).
    ``cpu_offload``: the step runs on the CPU with torch's AdamW (not fused)."""
    groups = _param_groups(model, optim)
    betas = (optim.adam_beta1, optim.adam_beta2)
    if checked:
        return NonFiniteSkippingAdamW(groups, lr=optim.lr, betas=betas, eps=optim.adam_eps,
                                      model_parallel_group=model_parallel_group)
    if cpu_adam:
        import subprocess

        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # the first use compiles the op and prints nothing for minutes: say so
        print("rtd_scale: ZeRO-Offload uses DeepSpeed's CPU Adam op, compiled on first use "
              "(minutes on 2 cores, then cached in ~/.cache/torch_extensions; a build killed "
              "midway leaves a 'lock' file there that makes later runs wait: delete it)",
              file=sys.stderr, flush=True)
        try:
            return DeepSpeedCPUAdam(groups, lr=optim.lr, betas=betas, eps=optim.adam_eps,
                                    adamw_mode=True)
        except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
            raise UserInputError(
                "zero_optimization.offload_optimizer: DeepSpeed's CPU Adam op could not be "
                f"built here ({' '.join(str(e).split())[:200]}); install a C++ compiler, or "
                "set \"zero_force_ds_cpu_optimizer\": false in the ds_config to run torch's "
                "AdamW on the CPU") from None
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available() and not cpu_offload:
        kwargs["fused"] = True
    return torch.optim.AdamW(groups, lr=optim.lr, betas=betas, eps=optim.adam_eps, **kwargs)


def build_engine(model, cfg: RunConfig, ds_config: dict[str, Any], mpu):
    """``deepspeed.initialize`` with our optimizer, schedule and groups.

    Under ZeRO-3, parameters read by a module that does not own them (the tied MLM output, the
    GDES base table) are registered as external parameters of the reading module.
    """
    import deepspeed

    from rtd_scale.training.lr_schedule import build_scheduler

    zero = ds_config.get("zero_optimization", {}).get("stage", 0)
    checked = zero == 0 and not (ds_config.get("bf16", {}).get("enabled", False)
                                 or ds_config.get("fp16", {}).get("enabled", False))
    # ZeRO-Offload: DeepSpeed's CPU Adam unless the file says zero_force_ds_cpu_optimizer=false
    offload = offloads_optimizer(ds_config)
    optimizer = build_optimizer(model, cfg.optim, checked=checked,
                                model_parallel_group=mpu.get_model_parallel_group(),
                                cpu_adam=offload and ds_config.get("zero_force_ds_cpu_optimizer",
                                                                   True),
                                cpu_offload=offload)
    # megatron-core's schedule, stepped by DeepSpeed after each applied update (lr_schedule.py)
    scheduler = build_scheduler(optimizer, cfg.optim, train_iters=cfg.train.train_iters,
                                global_batch_size=cfg.train.global_batch_size)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=ds_config, mpu=mpu)
    if ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        for module, param in model.foreign_parameters():
            deepspeed.zero.register_external_parameter(module, param)
    return engine

