"""The optimizer: AdamW's parameter groups and weight-decay rule, and which AdamW a run gets.

``optimizer_for_ds_config`` picks it from the resolved ds_config: ``NonFiniteSkippingAdamW`` at
ZeRO stage 0 in fp32 (DeepSpeed does not skip a non-finite step there), DeepSpeed's CPU Adam
under ZeRO-Offload (unless the file says ``"zero_force_ds_cpu_optimizer": false``), else
torch's AdamW (fused on GPU). ``training/engine.py`` hands it to ``deepspeed.initialize``;
``training/lr_schedule.py`` reads ``NonFiniteSkippingAdamW``'s device-side skip flag.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import OptimConfig
from rtd_scale.training.ds_config import offloads_optimizer


class NonFiniteSkippingAdamW(torch.optim.AdamW):
    """AdamW whose step is a no-op, decided on the device, when any gradient is inf or NaN.

    Used only where DeepSpeed hands the update to the client optimizer unchecked: ZeRO stage 0
    in fp32 (its ZeRO 1–3 optimizers and its bf16 wrappers check the gradient norm themselves
    and skip such a step). A skipped step leaves the parameters, both moments and the step
    count exactly as they were, like DeepSpeed's skip; no value reaches the host (no sync):
    every update is computed and then kept or dropped by ``torch.where``.

    The flag is the L2 norm of all of this rank's gradients (``torch._foreach_norm``), ANDed
    over ``model_parallel_group`` so that tensor-parallel peers agree; data-parallel peers hold
    the same reduced gradients at stage 0. ``skipped`` is the last step's flag, a bool tensor;
    ``grad_norm`` the L2 norm of this rank's gradients at that step, a float64 tensor (no sync).

    The update is AdamW's (arXiv 1711.05101; torch.optim.AdamW's single-tensor form, with the
    step count kept on the device), so it agrees with ``torch.optim.AdamW`` to rounding.
    """

    def __init__(self, params, *, model_parallel_group=None, **kwargs):
        super().__init__(params, foreach=False, **kwargs)
        self.model_parallel_group = model_parallel_group
        self.skipped: Optional[torch.Tensor] = None
        self.grad_norm: Optional[torch.Tensor] = None

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "closures are not supported"
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params:
            return None
        norms = torch.stack(torch._foreach_norm([p.grad for p in params]))
        self.grad_norm = norms.double().pow(2).sum().sqrt()  # this rank's (training/spikes.py)
        ok = torch.isfinite(norms.sum()).to(torch.int32)
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


def param_groups(model: torch.nn.Module, optim: OptimConfig) -> list[dict[str, Any]]:
    """Two AdamW groups: ``optim.weight_decay`` on the matrices, none on biases, norms and other
    1-D parameters; a parameter shared by two modules (ES's one table) appears once. A parameter
    built under DeepSpeed's ``zero.Init`` is judged by its whole shape ``ds_shape``: its own
    ``data`` is then an empty 1-D placeholder (DeepSpeed 0.19.8 ``partition_parameters.py``),
    which would put every matrix in the no-decay group
    (tests/multiproc/test_post_ln_zero.py::test_zero_init_build_trains_like_the_whole_build).
    An empty group is left out: DeepSpeed drops it from the optimizer (0.19.8 ``engine.py``
    ``_configure_optimizer``), and the scheduler pairs its weight-decay multipliers with the
    groups by position (``lr_schedule.MegatronLRScheduler``)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        ndim = len(getattr(p, "ds_shape", p.shape))
        (no_decay if ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, *, checked: bool = False,
                    model_parallel_group=None, cpu_adam: bool = False,
                    cpu_offload: bool = False, print_fn=None) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay, arXiv 1711.05101); no decay on biases, norms and 1-D
    parameters. Fused on GPU. ``checked``: a ``NonFiniteSkippingAdamW`` instead (ZeRO stage 0
    in fp32, where DeepSpeed does not skip non-finite steps itself). ``cpu_adam``: DeepSpeed's
    ``DeepSpeedCPUAdam`` in AdamW mode with the same hyper-parameters and groups (ZeRO-Offload,
    whose optimizer step runs on the CPU; a C++ op DeepSpeed compiles on first use).
    ``cpu_offload``: the step runs on the CPU with torch's AdamW (not fused). ``print_fn``: where
    the note about the CPU Adam op's first build goes, given to one rank only so that a run prints
    it once (tests/e2e/test_offload_fp16.py); None: not printed."""
    groups = param_groups(model, optim)
    betas = (optim.adam_beta1, optim.adam_beta2)
    if checked:
        return NonFiniteSkippingAdamW(groups, lr=optim.lr, betas=betas, eps=optim.adam_eps,
                                      model_parallel_group=model_parallel_group)
    if cpu_adam:
        import subprocess

        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # the first use compiles the op and prints nothing for minutes: say so
        if print_fn is not None:
            print_fn("rtd_scale: ZeRO-Offload uses DeepSpeed's CPU Adam op, compiled on first "
                     "use (minutes on 2 cores, then cached in ~/.cache/torch_extensions; a build "
                     "killed midway leaves a 'lock' file there that makes later runs wait: "
                     "delete it)")
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


def optimizer_for_ds_config(model: torch.nn.Module, optim: OptimConfig, ds_config: dict[str, Any],
                            *, model_parallel_group=None, print_fn=None) -> torch.optim.Optimizer:
    """``build_optimizer`` with the choice the resolved ``ds_config`` implies (module docstring):
    ``checked`` at ZeRO stage 0 without bf16 or fp16; DeepSpeed's CPU Adam, or torch's AdamW on
    the CPU, under ZeRO-Offload."""
    zero = ds_config.get("zero_optimization", {}).get("stage", 0)
    checked = zero == 0 and not (ds_config.get("bf16", {}).get("enabled", False)
                                 or ds_config.get("fp16", {}).get("enabled", False))
    offload = offloads_optimizer(ds_config)
    return build_optimizer(model, optim, checked=checked,
                           model_parallel_group=model_parallel_group,
                           cpu_adam=offload and ds_config.get("zero_force_ds_cpu_optimizer", True),
                           cpu_offload=offload, print_fn=print_fn)
