"""Throughput, MFU, memory and ETA for the training log line and TensorBoard (Megatron-LM's
``--log-throughput`` and memory report).

- TFLOP/s per device = the model FLOPs of the interval's steps / its seconds / world size, with
  one step's model FLOPs (:func:`step_model_flops`) = ``flops.rtd_flops_per_token(flops.dims_of(
  cfg))`` × global batch size × sequence length: every position of every packed sequence, as
  Megatron-LM's ``num_floating_point_operations`` counts batch × sequence (``rtd_scale/flops.py``
  says what a model FLOP is). MFU = that against the device's peak (``flops.mfu``'s ratio).
- The peak: ``--peak-tflops-per-device``, ``--device-peak NAME``, or the bf16 dense datasheet
  value of a GPU whose name is known (``DEVICE_PEAK_TFLOPS``); otherwise no MFU is logged. It is
  the bf16 figure whatever the run's precision (an fp32 run's MFU is against bf16's peak).
- Memory (CUDA only): allocated, reserved and peak allocated bytes of each rank, the maximum over
  all ranks (the rank nearest to running out), in GiB; one all-reduce at the log interval.
- Peak memory per rank (every device): the most any rank has held, in GB, the maximum over all
  ranks — CUDA's ``max_memory_allocated`` on a GPU, the process's peak resident size on the CPU
  (``rtd_scale/memory.py``'s ``peak_bytes``, what its estimate is checked against); one
  all-reduce at the log interval.
- ETA: the steps left × the mean seconds per step of this run's training so far (validation and
  checkpoint time excluded).
"""
from __future__ import annotations

import datetime
from typing import Optional

from rtd_scale import flops

# bf16 dense Tensor Core TFLOP/s: half the "with sparsity" figure of NVIDIA's datasheets
# (A100: 312; H100 SXM5 and H200 SXM: 1,979 sparse; H100 PCIe: 1,513 sparse).
DEVICE_PEAK_TFLOPS: dict[str, float] = {"a100": 312.0, "h100": 989.4, "h100-pcie": 756.5,
                                        "h200": 989.4}
# torch.cuda.get_device_name substrings, most specific first; None: a variant without a
# value here (NVL boards run at other clocks), so no MFU unless the user sets the peak
_GPU_NAMES: tuple[tuple[str, Optional[str]], ...] = (
    ("H100 PCIe", "h100-pcie"), ("H100 NVL", None), ("H200 NVL", None), ("H100", "h100"),
    ("H200", "h200"), ("A100", "a100"))


def peak_tflops(configured: Optional[float], device) -> Optional[float]:
    """The peak TFLOP/s of one device: ``configured`` when set, else the known value of the
    CUDA device's name, else None (MFU not logged)."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for pattern, key in _GPU_NAMES:
        if pattern in name:
            return DEVICE_PEAK_TFLOPS[key] if key else None
    return None


def step_model_flops(cfg) -> float:
    """Model FLOPs (forward + backward, all ranks) of one optimizer step of ``cfg`` (a
    ``RunConfig`` whose vocab_size is the tokenizer's)."""
    return (flops.rtd_flops_per_token(flops.dims_of(cfg)) * cfg.train.global_batch_size
            * cfg.data.seq_length)


class ThroughputMeter:
    """The log interval's TFLOP/s per device, MFU and the run's ETA (tags ``throughput/*``,
    ``time/eta_s``)."""

    def __init__(self, cfg, *, world_size: int, device):
        self.step_flops = step_model_flops(cfg)
        self.peak = peak_tflops(cfg.train.peak_tflops_per_device, device)
        self.world_size = world_size
        self.train_iters = cfg.train.train_iters
        self.seconds = 0.0
        self.steps = 0

    def scalars(self, *, steps: int, seconds: float, done: int) -> dict[str, float]:
        """``steps`` optimizer steps took ``seconds``; ``done`` steps of the run are done."""
        self.seconds += seconds
        self.steps += steps
        flops_per_s = self.step_flops * steps / seconds / self.world_size  # per device
        out = {"throughput/tflops_per_device": flops_per_s / 1e12}
        if self.peak is not None:
            out["throughput/mfu"] = flops_per_s / (self.peak * 1e12)  # as flops.mfu
        out["time/eta_s"] = (self.train_iters - done) * self.seconds / self.steps
        return out


def memory_gib(device) -> Optional[dict[str, float]]:
    """Allocated, reserved and peak allocated memory in GiB, each the maximum over all ranks;
    None off CUDA. Collective over the default group on CUDA: every rank must call it."""
    if device.type != "cuda":
        return None
    import torch
    import torch.distributed as dist

    t = torch.tensor([torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device),
                      torch.cuda.max_memory_allocated(device)], dtype=torch.float64,
                     device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    allocated, reserved, peak = (t / 2**30).tolist()
    return {"memory/allocated_gib": allocated, "memory/reserved_gib": reserved,
            "memory/peak_allocated_gib": peak}


def peak_memory_gb(device) -> dict[str, float]:
    """``{"memory/peak_gb": …}``: the largest measured peak of any rank
    (``memory.peak_bytes``), in GB. Collective over the default group: every rank must call
    it."""
    import torch
    import torch.distributed as dist

    from rtd_scale.memory import peak_bytes

    t = torch.tensor([peak_bytes(device)], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"memory/peak_gb": float(t.item()) / 1e9}


def loss_scale(engine) -> Optional[float]:
    """fp16's current dynamic loss scale from DeepSpeed's optimizer wrapper (``cur_scale`` of
    its FP16 optimizers, ``loss_scale`` of ZeRO's); None when the engine is not in fp16."""
    fp16 = getattr(engine, "fp16_enabled", None)
    if fp16 is None or not fp16():
        return None
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(engine.optimizer, attr, None)
        if value is not None:
            return float(value)
    return None


def format_eta(seconds: float) -> str:
    """``H:MM:SS`` (``D day(s), H:MM:SS`` past a day)."""
    return str(datetime.timedelta(seconds=round(seconds)))
