#!/usr/bin/env python
"""One RTD training step on one GPU: Hugging Face transformers as users write it vs rtd_scale.

In one run (≤ 8 minutes on one H200) this prints, side by side:

1. the bf16 matmul ceiling (8192³ ``torch.mm`` timed with CUDA events), the MFU denominator;
2. per workload (ELECTRA-large, ELECTRA-base, DeBERTaV3-large dimensions): the RTD step written
   the way a transformers user writes it (generator ``*ForMaskedLM`` + discriminator sharing the
   generator's token table, 15% masking, sampling from the softmax, λ = 50, fused AdamW, bf16
   autocast), also under ``torch.compile`` for ELECTRA-large, and rtd_scale's step
   (``RTDModel`` in a DeepSpeed engine with bf16 weights and fp32 master weights, as
   ``pretrain.py --bf16`` runs it, at ZeRO-1 and for ELECTRA-large also at ZeRO-0; and the same
   model under plain autocast + fused AdamW without DeepSpeed, which isolates the engine's cost);
3. the 24 × 1024 layer stack alone: HF ``ElectraEncoder`` (SDPA) vs rtd_scale's megatron-core
   layer spec (forward + backward, bf16 weights);
4. where the time goes: a torch.profiler summary by kernel family for rtd_scale's and HF's
   ELECTRA-large steps and for both stacks, the forward / backward / optimizer split, the
   operations of rtd_scale's step that synchronise the host, and the sampler's and masking's
   own cost.

One table: workload, implementation, micro-batch, tokens/s, TFLOP/s, MFU (of the measured
ceiling), peak memory, target. FLOPs: ``rtd_scale/flops.py`` (formula in bench/README.md).
Warm-up steps are excluded; timed steps run back to back and the host waits for the device
only at measurement boundaries. Each row has a time budget, the whole run a deadline (rows that
no longer fit are reported as skipped), and an out-of-memory error or any other failure of a
row is reported in the table instead of ending the run. ``torch.compile`` runs in a child
process so that a slow compilation can be cut off at the deadline.

    python bench/gpu_rtd_step.py                      # on the GPU machine (bench/README.md)
    python bench/gpu_rtd_step.py --device cpu --tiny  # the same code paths, tiny, on CPU
    python bench/gpu_rtd_step.py --print-setup        # how to build and carry the wheels
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rtd_scale.flops import (EncoderDims, RTDDims, dims_of, mfu,  # noqa: E402
                             rtd_flops_per_token, stack_flops_per_token)
from bench import common  # noqa: E402
from bench.common import (MASK_ID, PAD_ID, RTD_LAMBDA, SEED, SPECIAL_IDS,  # noqa: E402
                          host_batches, sync, token_batches)

# the reference rows measure every workload at 15% (the electra-large preset has 25%)
MASK_PROB = 0.15

SETUP = """\
# On the CPU machine (network to PyPI), from the repository root; build/ is git-ignored.
mkdir -p build/bench_wheels
# deepspeed is an sdist: build its wheel here, against the installed torch
pip wheel --no-deps --no-build-isolation -w build/bench_wheels deepspeed==0.19.8
# megatron-core and deepspeed's dependencies, for whichever CPython the GPU machine has
for py in 3.11 3.12 3.13; do
  pip download --no-deps --only-binary=:all: --python-version $py --implementation cp \\
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
    --platform manylinux2014_x86_64 -d build/bench_wheels \\
    megatron-core==0.16.1 msgpack==1.2.4 pydantic-core==2.50.5 psutil==7.2.2 ninja==1.13.2 \\
    einops==0.8.2 hjson==3.1.0 py-cpuinfo==9.0.0 pydantic==2.14.4 annotated-types==0.8.0 \\
    typing-inspection==0.4.5 typing-extensions==4.16.0 nvidia-ml-py==13.615.71
done
# On the GPU machine (build/bench_wheels carried along; no network): install what is missing.
python -m pip install --no-index --find-links build/bench_wheels \\
    deepspeed==0.19.8 megatron-core==0.16.1
python bench/gpu_rtd_step.py --json "${OUT:-build}/gpu_rtd_step.json"
"""


# ----------------------------------------------------------------------------------------------
# Settings and workloads
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Settings:
    """How long and how hard to measure (GPU defaults; ``--tiny`` shrinks everything)."""

    device: torch.device
    tiny: bool
    deadline_s: float  # the whole run, from start-up
    warmup_steps: int
    min_steps: int
    max_steps: int
    row_budget_s: float  # timed steps of one row (after warm-up)
    profile_steps: int
    compile_backend: str
    zero_stage: int
    matmul_size: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One row group of the comparison table. Dimensions come from rtd_scale's preset."""

    key: str
    preset: str
    micro_batch: int
    target_tokens_per_s: float
    hf_arch: Literal["electra", "deberta-v2"]  # ElectraFor{MaskedLM,PreTraining} / DebertaV2
    anchors: dict  # implementation key -> tokens/s measured on one H200 (the reference rows)


WORKLOADS = {
    "electra-large": Workload(key="electra-large", preset="electra-large", micro_batch=32,
                              target_tokens_per_s=175e3, hf_arch="electra",
                              anchors={"hf-eager": 96.4e3, "hf-compile": 124.9e3}),
    "electra-base": Workload(key="electra-base", preset="electra-base", micro_batch=64,
                             target_tokens_per_s=450e3, hf_arch="electra",
                             anchors={"hf-eager": 230e3}),
    "debertav3-large": Workload(key="debertav3-large", preset="debertav3-large", micro_batch=16,
                                target_tokens_per_s=110e3, hf_arch="deberta-v2",
                                anchors={"hf-eager": 24.5e3}),
}
# The stack-only row: 24 × 1024, 16 heads, FFN 4096, seq 512, batch 16, bf16 weights, fwd + bwd.
STACK = dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096,
             seq_length=512, micro_batch=16)
STACK_ANCHORS = {"stack-hf": 191.5e3, "stack-mcore": 143.6e3}
STACK_TARGET = 191.5e3  # at least HF's plain encoder

SHORT = {"hf-eager": "HF eager", "hf-compile": "HF compile", "hf-electra-arch": "HF ELECTRA",
         "rtd-engine": "rtd_scale DS", "rtd-engine-z0": "rtd_scale DS Z0",
         "rtd-compile": "rtd_scale DS compiled",
         "rtd-autocast": "rtd_scale autocast", "stack-hf": "HF encoder",
         "stack-mcore": "rtd_scale spec", "stack-mcore-mask": "spec + mask"}
IMPL_TITLES = {
    "hf-eager": "HF eager",
    "hf-compile": "HF + torch.compile",
    "hf-electra-arch": "HF ELECTRA arch (abs. pos.)",
    "rtd-engine": "rtd_scale (DeepSpeed bf16{zs})",
    "rtd-engine-z0": "rtd_scale (DeepSpeed bf16, ZeRO-0)",
    "rtd-compile": "rtd_scale (DeepSpeed bf16{zs}, compiled layers)",
    "rtd-autocast": "rtd_scale (autocast, no DS)",
    "stack-hf": "HF ElectraEncoder (SDPA)",
    "stack-mcore": "rtd_scale spec, no mask",
    "stack-mcore-mask": "rtd_scale spec, pad mask",
}


def rtd_config(wl: Workload, tiny: bool):
    """rtd_scale's config for a workload: the preset at the reference micro-batch and 15% masking,
    bf16; ``tiny`` keeps its shape (ELECTRA: narrower generator; DeBERTaV3: half depth) at
    CPU size (seq 64)."""
    from rtd_scale import config as C

    cfg = C.preset(wl.preset)
    cfg.rtd.mask_prob = MASK_PROB
    cfg.train.precision = C.Precision.BF16
    cfg.train.micro_batch_size = cfg.train.global_batch_size = wl.micro_batch
    if tiny:
        m = cfg.model
        narrow = m.generator.hidden_size < m.discriminator.hidden_size
        deep_ratio = m.discriminator.num_layers // m.generator.num_layers
        m.discriminator = dataclasses.replace(m.discriminator, num_layers=2, hidden_size=64,
                                              num_attention_heads=2, ffn_hidden_size=256)
        gh = 32 if narrow else 64
        m.generator = dataclasses.replace(m.generator, num_layers=max(1, 2 // deep_ratio),
                                          hidden_size=gh, num_attention_heads=2,
                                          ffn_hidden_size=4 * gh)
        m.embedding_size = 64
        m.vocab_size = 3000 if wl.hf_arch == "deberta-v2" else 1000
        m.max_position_embeddings = 64
        cfg.data.seq_length = 64
        cfg.train.micro_batch_size = cfg.train.global_batch_size = 4
    cfg.validate()
    return cfg


def rtd_dims(cfg) -> RTDDims:
    """The FLOP-count shapes of ``cfg`` (``rtd_scale.flops.dims_of``: with the relative rows of
    disentangled attention for the debertav3 workloads)."""
    return dims_of(cfg)


def stack_shape(tiny: bool) -> dict:
    if tiny:
        return dict(num_layers=2, hidden_size=64, num_attention_heads=2, ffn_hidden_size=256,
                    seq_length=64, micro_batch=4)
    return dict(STACK)


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------

@dataclass
class Row:
    """One line of the table."""

    workload: str
    impl: str
    title: str
    micro_batch: int
    seq_length: int
    flops_per_token: float
    target_tokens_per_s: Optional[float] = None
    anchor_tokens_per_s: Optional[float] = None
    status: str = "ok"  # ok | OOM | error | skipped | timeout
    note: str = ""
    steps: int = 0
    step_ms: Optional[float] = None
    tokens_per_s: Optional[float] = None
    tflops: Optional[float] = None
    mfu: Optional[float] = None
    peak_mem_gib: Optional[float] = None
    seconds: float = 0.0  # wall time of the row, build included


@dataclass
class Stepper:
    """One training step as three phases (so the phase split can put marks between them)."""

    forward: Callable[[int], Any]
    backward: Callable[[Any], None]
    update: Callable[[], None]
    keep: list = field(default_factory=list)  # objects to free with the row

    def __call__(self, i: int) -> None:
        self.backward(self.forward(i))
        self.update()


class Clock:
    """CUDA events on the GPU (no host sync until ``elapsed_ms``), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b)
        return (b - a) * 1e3


def release(device: torch.device) -> None:
    """Return a finished row's device memory and restart the peak-memory count (GPU only: on
    CPU memory is not measured, and a full collection costs ~0.3 s with these libraries)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def failure_note(e: BaseException) -> str:
    text = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def is_oom(e: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", ())
    return isinstance(e, oom) or "out of memory" in str(e).lower()


# ----------------------------------------------------------------------------------------------
# Measurements
# ----------------------------------------------------------------------------------------------

def matmul_ceiling(s: Settings) -> float:
    """Best bf16 ``torch.mm`` FLOP/s over three trials of n³ products (n = 8192 on GPU)."""
    n = s.matmul_size
    g = torch.Generator(device=s.device).manual_seed(0)
    a = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, device=s.device, dtype=torch.bfloat16, generator=g)
    c = torch.empty(n, n, device=s.device, dtype=torch.bfloat16)
    reps = 2 if s.tiny else 25
    for _ in range(3):
        torch.mm(a, b, out=c)
    clock, best = Clock(s.device), 0.0
    for _ in range(3):
        t0 = clock.mark()
        for _ in range(reps):
            torch.mm(a, b, out=c)
        ms = clock.elapsed_ms(t0, clock.mark())
        best = max(best, 2.0 * n ** 3 * reps / (ms / 1e3))
    del a, b, c
    return best


def time_steps(step: Stepper, s: Settings, start: int = 0) -> tuple[float, int]:
    """(ms per step, timed steps): warm-up, one probe step to size the timed run to the row's
    budget (when the step count is not fixed), then ``n`` steps back to back between two CUDA
    events; the host waits for the device only after the last one."""
    for i in range(s.warmup_steps):
        step(start + i)
    first = start + s.warmup_steps
    n = s.min_steps
    if s.max_steps > s.min_steps:
        sync(s.device)
        t0 = time.perf_counter()
        step(first)
        sync(s.device)
        probe = time.perf_counter() - t0
        n = int(min(s.max_steps, max(s.min_steps, s.row_budget_s // max(probe, 1e-6))))
        first += 1
    clock = Clock(s.device)
    a = clock.mark()
    for i in range(first, first + n):
        step(i)
    b = clock.mark()
    return clock.elapsed_ms(a, b) / n, n


def phase_split(step: Stepper, s: Settings, start: int, n: int = 3) -> dict[str, float]:
    """Mean ms per step in forward, backward and optimizer update (device time between marks)."""
    clock, marks = Clock(s.device), []
    for i in range(start, start + n):
        m0 = clock.mark()
        out = step.forward(i)
        m1 = clock.mark()
        step.backward(out)
        m2 = clock.mark()
        step.update()
        marks.append((m0, m1, m2, clock.mark()))
    sync(s.device)
    names = ("forward", "backward", "update")
    return {k: sum(clock.elapsed_ms(m[j], m[j + 1]) for m in marks) / n
            for j, k in enumerate(names)}


# Kernel families, matched in this order against the lower-cased kernel (GPU) or aten op (CPU)
# name. The first match wins, so the specific families come before the generic ones: a copy or
# index kernel is an "elementwise_kernel" too, and the hash RNG's int64 / fp64 arithmetic is
# told apart from bf16 / fp32 elementwise work by the dtype in the kernel's template arguments.
FAMILIES = (
    ("optimizer", ("adam", "multi_tensor_apply", "foreach", "lpnorm")),
    ("attention (flash/sdpa)", ("flash", "fmha", "sdpa", "attention", "attn",
                                "scaled_dot_product")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "ampere_",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
              "aten::linear")),
    ("layernorm", ("layer_norm", "layernorm", "gammabeta", "gradgamma")),
    ("copy/transpose", ("copy", "memcpy", "transpose", "permute", "contiguous", "aten::cat",
                        "catarray", "clone", "aten::_to_copy", "aten::to")),
    ("index/gather/embedding", ("index", "gather", "scatter", "embedding", "nonzero",
                                "masked_select", "aten::select", "take")),
    ("reduction/softmax/loss", ("reduce", "softmax", "cross_entropy", "nll", "aten::sum",
                                "aten::max", "aten::mean", "norm", "triton_red", "triton_per",
                                "argmax", "aten::any", "aten::all")),
    ("int64/fp64 math (hash RNG)", ("bitwise", "shift", "<long", "long>", "double",
                                    "aten::__and__", "aten::__xor__", "aten::__rshift__",
                                    "aten::__lshift__", "aten::remainder")),
    ("elementwise/gelu/dropout", ("elementwise", "gelu", "dropout", "bernoulli", "triton_poi",
                                  "triton_", "aten::add", "aten::mul", "aten::sub",
                                  "aten::div", "aten::where", "aten::masked_fill", "aten::log",
                                  "aten::neg", "aten::exp", "aten::fill", "aten::zero",
                                  "aten::ne", "aten::eq", "aten::lt", "aten::ge", "aten::gt",
                                  "aten::le", "aten::rsub", "aten::clamp", "aten::pow",
                                  "aten::sqrt", "aten::rsqrt", "aten::tanh", "aten::sigmoid",
                                  "aten::logical", "aten::uniform", "aten::normal")),
    ("memset", ("memset",)),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in FAMILIES:
        if any(k in low for k in keys):
            return family
    return "other"


@dataclass
class FamilyProfile:
    """Device time per step by kernel family (GPU), or aten self CPU time by op family (CPU)."""

    unit: str  # "GPU kernel time" or "CPU aten self time"
    ms_per_step: dict[str, float]
    top: dict[str, list[tuple[str, float]]]  # family -> [(name, ms/step)] largest first
    step_ms: float  # the timed step of the same row (for the idle share)


def profile_families(step: Stepper, s: Settings, start: int, step_ms: float) -> FamilyProfile:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if s.cuda else [])
    n = s.profile_steps
    with profile(activities=acts) as prof:
        for i in range(start, start + n):
            step(i)
        sync(s.device)
    totals: dict[str, float] = {}
    if s.cuda:
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us()
        unit = "GPU kernel time"
        if not totals:  # older kineto attributions: kernel time on the launching op
            for e in prof.key_averages():
                t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                if t > 0:
                    totals[e.key] = totals.get(e.key, 0.0) + t
    else:
        for e in prof.events():
            if e.name.startswith("aten::"):
                totals[e.name] = totals.get(e.name, 0.0) + e.self_cpu_time_total
        unit = "CPU aten self time"
    per_family: dict[str, float] = {}
    top: dict[str, list[tuple[str, float]]] = {}
    for name, us in totals.items():
        fam = kernel_family(name)
        ms = us / 1e3 / n
        per_family[fam] = per_family.get(fam, 0.0) + ms
        top.setdefault(fam, []).append((name, ms))
    for fam in top:
        top[fam].sort(key=lambda t: -t[1])
        top[fam] = top[fam][:2]
    return FamilyProfile(unit=unit, ms_per_step=per_family, top=top, step_ms=step_ms)


class SyncCensus:
    """Operations of one step that make the host wait for the device on CUDA, with the first
    frame outside torch that issued each (file:line in rtd_scale, deepspeed, megatron, ...).

    Found by a TorchDispatchMode (device-independent: works on CPU too): ``.item()`` /
    ``float(t)`` / ``bool(t)`` (aten::_local_scalar_dense), ``nonzero``, ``masked_select``,
    boolean-mask indexing, device-to-host copies and blocking host-to-device copies (these two
    only where there is a device: on CPU nothing is copied). On CUDA the real synchronisations
    are also counted with ``torch.cuda.set_sync_debug_mode``.
    """

    ALWAYS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
              "aten::is_nonzero", "aten::equal", "aten::unique_dim", "aten::_unique2",
              "aten::unique_consecutive", "aten::repeat_interleave"}
    INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
    ROOTS = ("rtd_scale/", "deepspeed/", "megatron/", "transformers/", "bench/")
    OWN_ROOTS = ("rtd_scale/", "bench/")  # folders of this checkout; the rest are libraries
    MACHINERY = ("gpu_rtd_step.py", "torch/_compile.py", "torch/_dynamo/", "torch/_ops.py",
                 "torch/utils/_python_dispatch.py", "torch/overrides.py")

    @classmethod
    def _is_sync(cls, func, args, kwargs) -> bool:
        name = func._schema.name
        if name in cls.ALWAYS:
            return True
        if name in cls.INDEXING and len(args) > 1 and isinstance(args[1], (list, tuple)):
            # t[mask] = scalar is dispatched to masked_fill_ inside ATen: no wait
            scalar_put = (name != "aten::index" and len(args) > 2 and len(args[1]) == 1
                          and isinstance(args[2], torch.Tensor) and args[2].numel() == 1)
            return not scalar_put and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool
                                          for t in args[1])
        kw = kwargs or {}
        if name == "aten::_to_copy" and args and isinstance(args[0], torch.Tensor):
            src, dst = args[0].device.type, torch.device(kw.get("device") or args[0].device).type
            # device -> host always waits; host -> device waits unless non_blocking
            return src != dst and (dst == "cpu" or not kw.get("non_blocking", False))
        if name == "aten::copy_" and len(args) > 1:
            dst, src = args[0].device.type, args[1].device.type
            non_blocking = bool(args[2]) if len(args) > 2 else kw.get("non_blocking", False)
            return src != dst and (dst == "cpu" or not non_blocking)
        return False

    @classmethod
    def _site(cls) -> str:
        """The first frame under one of ROOTS, and the torch API it went through, if any."""
        frames = [f for f in traceback.extract_stack()
                  if not any(m in f.filename.replace("\\", "/") for m in cls.MACHINERY)]
        via, site = "", ""
        repo = REPO.as_posix() + "/"
        for fr in reversed(frames):
            path = fr.filename.replace("\\", "/")
            # the project's own files by their place in the checkout (whatever the checkout is
            # called, and never a library installed under it, e.g. in .venv/)
            ours = path.startswith(repo) and "/site-packages/" not in path
            j = path.rfind("/torch/")
            if j >= 0 and not ours:
                via = via or f"{path[j + 1:]}:{fr.lineno}"
                continue
            for root in cls.ROOTS:
                if ours and root in cls.OWN_ROOTS:
                    if path[len(repo):].startswith(root):
                        site = f"{path[len(repo):]}:{fr.lineno}"
                elif not ours and root not in cls.OWN_ROOTS:
                    i = path.rfind("/" + root)
                    if i >= 0:
                        site = f"{path[i + 1:]}:{fr.lineno}"
                if site:
                    break
            if site:
                break
        site = site or "bench/gpu_rtd_step.py (the benchmark's own step)"
        return f"{site} via {via}" if via else site

    @classmethod
    def run(cls, step: Stepper, i: int, device: torch.device) -> dict:
        from torch.utils._python_dispatch import TorchDispatchMode

        sites: dict[str, int] = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if cls._is_sync(func, args, kwargs):
                    key = f"{cls._site()}  [{func._schema.name}]"
                    sites[key] = sites.get(key, 0) + 1
                return func(*args, **(kwargs or {}))

        with Mode():
            step(i)
        result = {"sites": dict(sorted(sites.items(), key=lambda kv: -kv[1])),
                  "sync_ops": sum(sites.values()), "cuda_syncs": None}
        if device.type == "cuda":
            sync(device)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step(i + 1)
                    sync(device)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            result["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in caught)
        return result


def sampler_cost(model, cfg, s: Settings, step_ms: float) -> dict:
    """ms per call of rtd_scale's masking and Gumbel sampler at this workload's shapes
    (n = mask_prob · b · s rows × the padded vocabulary), and their share of the step."""
    from rtd_scale.objectives.masking import mask_tokens
    from rtd_scale.objectives.sampling import sample_from_logits

    b, seq = cfg.train.micro_batch_size, cfg.data.seq_length
    n = max(1, int(round(cfg.rtd.mask_prob * b * seq)))
    v = model.padded_vocab_size
    g = torch.Generator(device=s.device).manual_seed(0)
    logits = torch.randn(n, v, device=s.device, dtype=torch.bfloat16, generator=g)
    rows_index = torch.arange(n, device=s.device) % b
    position = torch.arange(n, device=s.device) % seq
    ids = torch.randint(5, cfg.model.vocab_size, (b, seq), device=s.device, generator=g)
    sample_index = torch.arange(b, device=s.device)

    def sample():
        sample_from_logits(logits, seed=SEED, step=0, sample_index=rows_index, position=position,
                           vocab_start=0, sampleable=model.sampleable, temperature=1.0)

    def mask():
        mask_tokens(ids, sample_index, seed=SEED, mask_prob=cfg.rtd.mask_prob,
                    mask_token_prob=cfg.rtd.mask_token_prob,
                    random_token_prob=cfg.rtd.random_token_prob, mask_id=MASK_ID,
                    vocab_size=cfg.model.vocab_size, special_ids=SPECIAL_IDS)

    out = {"rows": n, "vocab": v}
    clock = Clock(s.device)
    for name, fn in (("sample_from_logits", sample), ("mask_tokens", mask)):
        fn()
        reps = 1 if s.tiny else 5
        a = clock.mark()
        for _ in range(reps):
            fn()
        ms = clock.elapsed_ms(a, clock.mark()) / reps
        out[name] = {"ms": ms, "share_of_step": ms / step_ms if step_ms else None}
    return out


# ----------------------------------------------------------------------------------------------
# The steps
# ----------------------------------------------------------------------------------------------

def _hf_module(cls, config, device: torch.device, attn: Optional[str]):
    """Build a transformers model on ``device`` with the attention implementation ``attn``,
    falling back to the library's default where that version lacks it."""
    with torch.device(device):
        if attn is None:
            return cls(config)
        try:
            return cls._from_config(config, attn_implementation=attn)
        except (ValueError, TypeError, ImportError):
            return cls._from_config(config)


def hf_rtd_step(cfg, wl_arch: Literal["electra", "deberta-v2"], s: Settings,
                compile_backend: Optional[str]) -> Stepper:
    """The RTD step as a transformers user writes it: generator ``*ForMaskedLM`` with
    ``labels=-100`` outside the masked slots, the discriminator sharing the generator's token
    table (ELECTRA: the same ``nn.Embedding``; GDES: ``E_G.detach() + E_Δ`` fed as
    ``inputs_embeds``), 15% masking with ``torch.bernoulli``, ``torch.multinomial`` from the
    softmax at masked positions, L = L_MLM + 50 · L_RTD, bf16 autocast, fused AdamW."""
    import transformers as T

    m, seq, b = cfg.model, cfg.data.seq_length, cfg.train.micro_batch_size
    dev, gdes = s.device, m.sharing.value == "gdes"
    gen_e, disc_e = m.generator, m.discriminator
    extra: list[torch.nn.Module] = []
    if wl_arch == "electra":
        def ecfg(e):
            return T.ElectraConfig(vocab_size=m.vocab_size, embedding_size=m.embedding_size,
                                   hidden_size=e.hidden_size, num_hidden_layers=e.num_layers,
                                   num_attention_heads=e.num_attention_heads,
                                   intermediate_size=e.ffn_hidden_size,
                                   max_position_embeddings=m.max_position_embeddings,
                                   pad_token_id=PAD_ID)
        gen = _hf_module(T.ElectraForMaskedLM, ecfg(gen_e), dev, "sdpa")
        disc = _hf_module(T.ElectraForPreTraining, ecfg(disc_e), dev, "sdpa")
        table = gen.electra.embeddings.word_embeddings
        if not gdes:
            disc.electra.embeddings.word_embeddings = table  # ES, as HF ELECTRA recipes tie it

        def disc_loss(corrupted, attn, labels, embeds=None):
            kw = dict(inputs_embeds=embeds) if embeds is not None else dict(input_ids=corrupted)
            return disc(attention_mask=attn, labels=labels, **kw).loss
    else:
        def dcfg(e):
            return T.DebertaV2Config(vocab_size=m.vocab_size, hidden_size=e.hidden_size,
                                     num_hidden_layers=e.num_layers,
                                     num_attention_heads=e.num_attention_heads,
                                     intermediate_size=e.ffn_hidden_size,
                                     max_position_embeddings=m.max_position_embeddings,
                                     relative_attention=True, position_buckets=256,
                                     max_relative_positions=-1, pos_att_type=["p2c", "c2p"],
                                     norm_rel_ebd="layer_norm", share_att_key=True,
                                     position_biased_input=False, layer_norm_eps=1e-7,
                                     type_vocab_size=0, pad_token_id=PAD_ID)
        gen = _hf_module(T.DebertaV2ForMaskedLM, dcfg(gen_e), dev, None)
        disc = _hf_module(T.DebertaV2Model, dcfg(disc_e), dev, None)
        h = disc_e.hidden_size
        with torch.device(dev):
            head = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.GELU(),
                                       torch.nn.Linear(h, 1))
        extra.append(head)
        table = gen.deberta.embeddings.word_embeddings

        def disc_loss(corrupted, attn, labels, embeds=None):
            kw = dict(inputs_embeds=embeds) if embeds is not None else dict(input_ids=corrupted)
            hidden = disc(attention_mask=attn, **kw).last_hidden_state
            logits = head(hidden).squeeze(-1)
            active = attn.bool()
            return F.binary_cross_entropy_with_logits(logits[active].float(), labels[active])
    delta = None
    if gdes:  # DeBERTaV3's gradient-disentangled sharing, written the plain way
        delta = torch.nn.Parameter(torch.zeros_like(table.weight))
    modules = [gen, disc] + extra
    params = list({id(p): p for mod in modules for p in mod.parameters()}.values())
    params += [delta] if delta is not None else []
    opt = torch.optim.AdamW(params, lr=2e-4, weight_decay=0.01, fused=True)
    gen_c = gen
    if compile_backend:  # as users do: compile both models whole (the loss may graph-break)
        gen_c = torch.compile(gen, backend=compile_backend)
        disc = torch.compile(disc, backend=compile_backend)
    for mod in modules:
        mod.train()
    batches = token_batches(m.vocab_size, b, seq)
    mask_token_prob = cfg.rtd.mask_token_prob

    def forward(i: int):
        ids = batches[i % len(batches)].to(dev)
        attn = torch.ones_like(ids)
        prob = torch.full(ids.shape, cfg.rtd.mask_prob, device=dev)
        prob.masked_fill_(ids < len(SPECIAL_IDS), 0.0)
        masked = torch.bernoulli(prob).bool()
        labels = ids.masked_fill(~masked, -100)
        keep_prob = torch.full(ids.shape, mask_token_prob, device=dev)
        to_mask = masked & torch.bernoulli(keep_prob).bool()
        gen_in = ids.masked_fill(to_mask, MASK_ID)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = gen_c(input_ids=gen_in, attention_mask=attn, labels=labels)
            with torch.no_grad():
                probs = torch.softmax(out.logits[masked].float(), dim=-1)
                sampled = torch.multinomial(probs, 1).squeeze(-1)
            corrupted = ids.clone()
            corrupted[masked] = sampled
            rtd_labels = (corrupted != ids).float()
            embeds = None
            if delta is not None:
                embeds = F.embedding(corrupted, table.weight.detach() + delta)
            l_rtd = disc_loss(corrupted, attn, rtd_labels, embeds)
            return out.loss + RTD_LAMBDA * l_rtd

    def backward(loss):
        if dev.type == "cpu":  # CPU autocast is not restored in backward (see rtd_autocast_step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss.backward()
        else:
            loss.backward()

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Stepper(forward, backward, update, keep=[modules, opt])


_PARALLEL_CTX = None


def parallel_context(s: Settings):
    """megatron-core's parallel state at world 1 through rtd_scale.distributed (started once)."""
    global _PARALLEL_CTX
    if _PARALLEL_CTX is None:
        from rtd_scale import distributed

        _PARALLEL_CTX = common.world_one()
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)  # keep DeepSpeed's per-engine banners out of the table
        distributed.seed_after_build(_PARALLEL_CTX, SEED)
    return _PARALLEL_CTX


def build_rtd_model(cfg, s: Settings):
    parallel_context(s)
    return common.build_rtd_model(cfg, s.device)


def rtd_engine_step(cfg, s: Settings, zero_stage: int) -> tuple[Stepper, Any]:
    """rtd_scale's step as ``pretrain.py --bf16`` runs it: ``engine(ids, sample_index, step)``,
    ``engine.backward(loss)``, ``engine.step()``. DeepSpeed casts the model to bf16 and keeps
    fp32 master weights in its optimizer wrapper around rtd_scale's AdamW (fused on GPU)."""
    from rtd_scale import distributed
    from rtd_scale.training.engine import build_engine, resolve_ds_config

    model = build_rtd_model(cfg, s)
    ds = resolve_ds_config({"zero_optimization": {"stage": zero_stage}}, cfg,
                           data_parallel_size=1, gradient_accumulation_steps=1)
    with contextlib.redirect_stdout(io.StringIO()):  # BF16_Optimizer prints memory banners
        eng = build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
    batches = host_batches(cfg)

    def forward(i: int):  # training/loop.py's micro-batch step (has_padding from the host)
        ids, idx = batches[i % len(batches)]
        return eng(ids.to(s.device, non_blocking=True), idx.to(s.device, non_blocking=True), i,
                   has_padding=bool((ids == PAD_ID).any()))

    stepper = Stepper(forward, lambda out: eng.backward(out.loss), eng.step, keep=[eng, model])
    note = f"{type(eng.optimizer).__name__} over {type(eng.basic_optimizer).__name__}"
    return stepper, (model, note)


def rtd_autocast_step(cfg, s: Settings) -> tuple[Stepper, Any]:
    """rtd_scale's model without DeepSpeed: fp32 weights, bf16 autocast, rtd_scale's AdamW
    (``training.optimizer.build_optimizer``: fused on GPU), no clipping — the HF step's recipe.
    On CPU autocast is entered around backward as well: megatron-core's linear layers restore
    autocast in backward only for CUDA (``custom_bwd(device_type="cuda")``)."""
    from rtd_scale.training.optimizer import build_optimizer

    model = build_rtd_model(cfg, s)
    opt = build_optimizer(model, cfg.optim)
    batches = host_batches(cfg)
    autocast = lambda: torch.autocast(s.device.type, dtype=torch.bfloat16)  # noqa: E731

    def forward(i: int):
        ids, idx = batches[i % len(batches)]
        with autocast():
            return model(ids.to(s.device, non_blocking=True), idx.to(s.device, non_blocking=True),
                         i, has_padding=bool((ids == PAD_ID).any())).loss

    def backward(loss):
        with autocast() if not s.cuda else contextlib.nullcontext():
            loss.backward()

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    stepper = Stepper(forward, backward, update, keep=[model, opt])
    return stepper, (model, "")


def stack_step(impl: str, shape: dict, s: Settings) -> tuple[Stepper, str]:
    """A layer stack alone, bf16 weights, forward + backward of a fixed random input and output
    gradient (no optimizer): HF's ``ElectraEncoder`` (SDPA) or rtd_scale's megatron-core spec."""
    L, h, heads, f = (shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                         "ffn_hidden_size"))
    seq, b, dev = shape["seq_length"], shape["micro_batch"], s.device
    g = torch.Generator(device=dev).manual_seed(0)
    if impl == "stack-hf":
        import transformers as T
        from transformers.models.electra.modeling_electra import ElectraEncoder

        c = T.ElectraConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=heads,
                            intermediate_size=f, max_position_embeddings=max(512, seq))
        c._attn_implementation = "sdpa"
        with torch.device(dev):
            try:
                module = ElectraEncoder(c)
            except (KeyError, ValueError):
                c._attn_implementation = "eager"
                module = ElectraEncoder(c)
        note = f"attn={c._attn_implementation}"
        x = torch.randn(b, seq, h, device=dev, dtype=torch.bfloat16, generator=g)
        run = lambda inp: module(inp)[0]  # noqa: E731
    else:
        from megatron.core.transformer.transformer_block import TransformerBlock

        from rtd_scale.config import EncoderConfig
        from rtd_scale.model.encoder import transformer_config
        from rtd_scale.model.specs import _have_transformer_engine, encoder_layer_spec

        parallel_context(s)
        enc = EncoderConfig(num_layers=L, hidden_size=h, num_attention_heads=heads,
                            ffn_hidden_size=f)
        tc = transformer_config(enc, init_std=0.02, tensor_model_parallel_size=1)
        module = TransformerBlock(config=tc, spec=encoder_layer_spec(), post_layer_norm=True,
                                  pre_process=True, post_process=True).to(dev)
        note = "TransformerEngine" if _have_transformer_engine() else "local layers, no TE"
        x = torch.randn(seq, b, h, device=dev, dtype=torch.bfloat16, generator=g)
        mask = None
        if impl == "stack-mcore-mask":  # what Encoder.forward passes: a [b,1,1,s] all-False mask
            mask = torch.zeros(b, 1, 1, seq, dtype=torch.bool, device=dev)
        run = lambda inp: module(hidden_states=inp, attention_mask=mask)  # noqa: E731
    module.to(torch.bfloat16).train()
    x.requires_grad_(True)
    grad = torch.randn_like(x)

    def update():
        module.zero_grad(set_to_none=True)
        x.grad = None

    return Stepper(lambda i: run(x), lambda out: out.backward(grad), update,
                   keep=[module, x]), note


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    """One planned row."""

    workload: str  # a WORKLOADS key or "stack"
    impl: str
    # diagnostics after the timed steps: "families" (torch.profiler by kernel family), and for
    # rtd_scale rows "phases" (forward/backward/update), "syncs" (host-sync census), "sampler"
    diag: frozenset = frozenset()
    min_left_s: float = 25.0  # do not start with less time than this left


class Bench:
    def __init__(self, s: Settings, args, in_child: bool = False):
        self.s, self.args, self.in_child = s, args, in_child
        self.t0 = time.perf_counter()
        self.rows: list[Row] = []
        self.ceiling: Optional[float] = None
        self.profiles: dict[str, FamilyProfile] = {}
        self.phases: dict[str, dict] = {}
        self.syncs: dict[str, dict] = {}
        self.samplers: dict[str, dict] = {}
        self.log = print

    def left(self) -> float:
        return self.s.deadline_s - (time.perf_counter() - self.t0)

    # rows -----------------------------------------------------------------------------------
    def new_row(self, item: Item) -> Row:
        if item.workload == "stack":
            shape = stack_shape(self.s.tiny)
            enc = EncoderDims(num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
                              ffn_hidden_size=shape["ffn_hidden_size"])
            return Row(workload=f"stack {shape['num_layers']}x{shape['hidden_size']}",
                       impl=item.impl, title=IMPL_TITLES[item.impl],
                       micro_batch=shape["micro_batch"], seq_length=shape["seq_length"],
                       flops_per_token=stack_flops_per_token(enc, shape["seq_length"]),
                       target_tokens_per_s=STACK_TARGET,
                       anchor_tokens_per_s=None if self.s.tiny else STACK_ANCHORS.get(item.impl))
        wl = WORKLOADS[item.workload]
        cfg = rtd_config(wl, self.s.tiny)
        title = IMPL_TITLES[item.impl].format(zs=f", ZeRO-{self.s.zero_stage}")
        if item.impl == "hf-eager" and wl.hf_arch == "deberta-v2":
            title = "HF eager (DebertaV2)"
        return Row(workload=wl.key, impl=item.impl, title=title,
                   micro_batch=cfg.train.micro_batch_size, seq_length=cfg.data.seq_length,
                   flops_per_token=rtd_flops_per_token(rtd_dims(cfg)),
                   target_tokens_per_s=wl.target_tokens_per_s,
                   anchor_tokens_per_s=None if self.s.tiny else wl.anchors.get(item.impl))

    def build(self, item: Item) -> tuple[Stepper, Any, str]:
        s = self.s
        if item.workload == "stack":
            stepper, note = stack_step(item.impl, stack_shape(s.tiny), s)
            return stepper, None, note
        wl = WORKLOADS[item.workload]
        cfg = rtd_config(wl, s.tiny)
        if item.impl in ("hf-eager", "hf-electra-arch"):
            arch = "electra" if item.impl == "hf-electra-arch" else wl.hf_arch
            return hf_rtd_step(cfg, arch, s, None), None, ""
        if item.impl == "hf-compile":
            return hf_rtd_step(cfg, wl.hf_arch, s, s.compile_backend), None, \
                f"backend={s.compile_backend}"
        if item.impl in ("rtd-engine", "rtd-engine-z0", "rtd-compile"):
            zs = 0 if item.impl == "rtd-engine-z0" else s.zero_stage
            cfg.model.compile_layers = item.impl == "rtd-compile"
            stepper, (model, note) = rtd_engine_step(cfg, s, zs)
            return stepper, (model, cfg), note
        if item.impl == "rtd-autocast":
            stepper, (model, note) = rtd_autocast_step(cfg, s)
            return stepper, (model, cfg), note
        raise AssertionError(item.impl)

    def run(self, item: Item) -> Row:
        row = self.new_row(item)
        self.rows.append(row)
        if self.left() < item.min_left_s:
            row.status, row.note = "skipped", f"deadline: {self.left():.0f}s left"
            return row
        if item.impl in ("hf-compile", "rtd-compile") and not self.in_child:
            return self.run_child(item, row)
        t0 = time.perf_counter()
        self.log(f"-- {row.workload} / {row.title} ...")
        if self.s.cuda:
            torch.cuda.reset_peak_memory_stats(self.s.device)
        stepper = rtd = None
        try:
            torch.manual_seed(SEED)
            stepper, rtd, note = self.build(item)
            row.note = note
            row.step_ms, row.steps = time_steps(stepper, self.s)
            self.finish(row)
        except Exception as e:  # noqa: BLE001 - a row's failure is reported, not fatal
            row.status = "OOM" if is_oom(e) else "error"
            row.note = failure_note(e)
            if row.status == "error":
                traceback.print_exc()
        if self.s.cuda and row.status in ("ok", "OOM"):
            row.peak_mem_gib = torch.cuda.max_memory_allocated(self.s.device) / 2 ** 30
        try:
            if row.status == "ok" and item.diag:
                self.diagnose(item, row, stepper, rtd)
        except Exception as e:  # noqa: BLE001 - the measurement stands; say what is missing
            row.note = (row.note + f" [diagnostics failed: {failure_note(e)}]").strip()
            traceback.print_exc()
        finally:
            for obj in (stepper.keep if stepper is not None else []):
                if hasattr(obj, "destroy"):
                    with contextlib.suppress(Exception):
                        obj.destroy()
            stepper = rtd = None
            release(self.s.device)
            row.seconds = time.perf_counter() - t0
        resident = (f", {torch.cuda.memory_allocated(self.s.device) / 2 ** 30:.2f} GiB still "
                    "allocated after the row" if self.s.cuda else "")
        self.log(f"   {row.status}: {fmt_k(row.tokens_per_s)} tokens/s "
                 f"({row.seconds:.0f}s{resident}) {row.note}")
        return row

    def finish(self, row: Row) -> None:
        row.tokens_per_s = row.micro_batch * row.seq_length / (row.step_ms / 1e3)
        row.tflops = row.flops_per_token * row.tokens_per_s / 1e12
        if self.ceiling:
            row.mfu = mfu(row.flops_per_token, row.tokens_per_s, self.ceiling)

    def diagnose(self, item: Item, row: Row, stepper: Stepper, rtd) -> None:
        key = f"{row.workload} / {row.title}"
        start = 10_000
        if "families" in item.diag:
            self.profiles[f"{row.workload}|{item.impl}"] = profile_families(
                stepper, self.s, start, row.step_ms)
        if rtd is None:
            return
        model, cfg = rtd
        if "phases" in item.diag:
            self.phases[key] = phase_split(stepper, self.s, start + 100,
                                           n=1 if self.s.tiny else 3)
        if "syncs" in item.diag:
            self.syncs[key] = SyncCensus.run(stepper, start + 200, self.s.device)
        if "sampler" in item.diag:
            self.samplers[key] = sampler_cost(model, cfg, self.s, row.step_ms)

    def run_child(self, item: Item, row: Row) -> Row:
        """A torch.compile row in a child process, cut off at the deadline."""
        t0 = time.perf_counter()
        self.log(f"-- {row.workload} / {row.title} (child process, ≤ {self.left() - 10:.0f}s) ...")
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_rtd_step_child_{os.getpid()}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-row",
               f"{item.workload}:{item.impl}", "--child-out", str(out),
               "--device", self.s.device.type, "--compile-backend", self.s.compile_backend]
        cmd += ["--tiny"] if self.s.tiny else []
        release(self.s.device)
        try:
            subprocess.run(cmd, timeout=max(5.0, self.left() - 10), check=False)
            child = json.loads(out.read_text())
            for k in ("status", "note", "steps", "step_ms", "peak_mem_gib"):
                setattr(row, k, child[k])
            if row.status == "ok":
                self.finish(row)
        except subprocess.TimeoutExpired:
            row.status, row.note = "timeout", "compilation did not finish before the deadline"
        except (OSError, ValueError, KeyError) as e:
            row.status, row.note = "error", f"child process: {type(e).__name__}: {e}"
        finally:
            with contextlib.suppress(OSError):
                out.unlink()
        row.seconds = time.perf_counter() - t0
        self.log(f"   {row.status}: {fmt_k(row.tokens_per_s)} tokens/s ({row.seconds:.0f}s)")
        return row


def plan(s: Settings, workloads: list[str], skip: set[str]) -> list[Item]:
    """Rows in priority order: the side-by-side rows first, diagnostics after, compile last."""
    on = "profile" not in skip

    def diag(*what: str, when: bool = True) -> frozenset:
        return frozenset(what) if on and when else frozenset()

    items = []
    for w in workloads:
        large = w == "electra-large"
        items += [Item(w, "hf-eager", diag("families", when=large)),
                  Item(w, "rtd-engine", diag("families", "phases", "syncs", "sampler", when=large))]
    if "stack" not in skip:
        items += [Item("stack", "stack-hf", diag("families")),
                  Item("stack", "stack-mcore", diag("families"))]
    if "extras" not in skip:
        items += [Item(w, "rtd-autocast", diag("families", "phases", "syncs",
                                               when=w == "electra-large")) for w in workloads]
        if "electra-large" in workloads and s.zero_stage != 0:
            items.append(Item("electra-large", "rtd-engine-z0", diag("phases", "syncs")))
        if "stack" not in skip:
            items.append(Item("stack", "stack-mcore-mask"))
        if "debertav3-large" in workloads:
            items.append(Item("debertav3-large", "hf-electra-arch"))
    if "rtd-compile" not in skip and "electra-large" in workloads and not s.tiny:
        items.append(Item("electra-large", "rtd-compile", min_left_s=60))
    if "hf-compile" not in skip and "electra-large" in workloads:
        items.append(Item("electra-large", "hf-compile", min_left_s=20 if s.tiny else 75))
    return items


# ----------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------

def fmt_k(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.1f}"


def table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def results_table(bench: Bench) -> str:
    order = [w for w in WORKLOADS] + ["stack"]

    def key(r: Row):
        w = "stack" if r.workload.startswith("stack") else r.workload
        return (order.index(w), list(IMPL_TITLES).index(r.impl))

    base = {r.workload: r.tokens_per_s for r in bench.rows
            if r.impl in ("hf-eager", "stack-hf") and r.tokens_per_s}
    lines = []
    for r in sorted(bench.rows, key=key):
        ours = r.impl.startswith(("rtd", "stack-mcore"))
        meets = ""
        if ours and r.tokens_per_s and r.target_tokens_per_s:
            meets = " yes" if r.tokens_per_s >= r.target_tokens_per_s else " no"
        vs = "-"
        if r.tokens_per_s and base.get(r.workload):
            vs = f"{r.tokens_per_s / base[r.workload]:.2f}x"
        lines.append([
            r.workload, r.title, str(r.micro_batch),
            fmt_k(r.tokens_per_s) if r.status == "ok" else r.status,
            f"{r.tflops:.1f}" if r.tflops is not None else "-",
            f"{100 * r.mfu:.1f}%" if r.mfu is not None else "-",
            f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-",
            (f">= {fmt_k(r.target_tokens_per_s)}" + meets) if r.target_tokens_per_s else "-",
            vs, fmt_k(r.anchor_tokens_per_s),
        ])
    head = ["workload", "implementation", "micro-batch", "tokens/s", "TFLOP/s", "MFU",
            "peak GiB", "target (rtd_scale)", "vs HF", "issue anchor"]
    out = table(head, lines, right={2, 3, 4, 5, 6, 8, 9})
    notes = [f"  [{r.workload} / {r.title}] {r.status}: {r.note}"
             for r in sorted(bench.rows, key=key) if r.note]
    return out + ("\nNotes:\n" + "\n".join(notes) if notes else "")


def profile_table(bench: Bench, keys: list[str]) -> str:
    """Family × implementation table; ``keys`` are "workload|impl", the first one's largest
    kernels are named."""
    keys = [k for k in keys if k in bench.profiles]
    if not keys:
        return ""
    profs = [bench.profiles[k] for k in keys]
    head = ["family"]
    for k in keys:
        head += [f"{SHORT[k.split('|')[1]]} ms", "%"]
    head += [f"largest ({SHORT[keys[0].split('|')[1]]}), ms"]
    lines = []
    for fam in [f for f, _ in FAMILIES] + ["other"]:
        vals = [p.ms_per_step.get(fam, 0.0) for p in profs]
        if not any(v > 0.0005 for v in vals):
            continue
        cells = [fam]
        for p, v in zip(profs, vals):
            tot = sum(p.ms_per_step.values()) or 1.0
            cells += [f"{v:.2f}", f"{100 * v / tot:.0f}"]
        cells.append("; ".join(f"{shorten(n)} {ms:.2f}" for n, ms in profs[0].top.get(fam, [])))
        lines.append(cells)
    total, gap = ["total profiled"], ["timed step - profiled"]
    for p in profs:
        tot = sum(p.ms_per_step.values())
        total += [f"{tot:.2f}", ""]
        gap += [f"{p.step_ms - tot:.2f}", f"{100 * (p.step_ms - tot) / p.step_ms:.0f}"]
    what = ("GPU idle: the host is the bottleneck" if bench.s.cuda
            else "python and framework time outside aten ops")
    lines += [total + [""], gap + [what]]
    attn = [f"  {SHORT[k.split('|')[1]]}: " + ("; ".join(
        shorten(n, 70) for n, _ in p.top.get("attention (flash/sdpa)", [])) or "-")
        for k, p in zip(keys, profs)]
    return (f"{profs[0].unit} per step by family:\n"
            + table(head, lines, right=set(range(1, 1 + 2 * len(profs))))
            + "\nAttention kernels (flash vs memory-efficient vs math):\n" + "\n".join(attn))


def shorten(name: str, n: int = 48) -> str:
    name = name.replace("void ", "").replace("at::native::", "")
    return name if len(name) <= n else name[:n - 1] + "~"


def diagnostics_text(bench: Bench) -> str:
    out = []
    for key, ph in bench.phases.items():
        tot = sum(ph.values()) or 1.0
        out.append(f"Phase split, {key}: " + ", ".join(
            f"{k} {v:.2f} ms ({100 * v / tot:.0f}%)" for k, v in ph.items()))
    for key, c in bench.syncs.items():
        cuda = f", CUDA sync-debug count {c['cuda_syncs']}" if c["cuda_syncs"] is not None else ""
        out.append(f"Host-synchronising operations in one step, {key}: {c['sync_ops']}{cuda}")
        for site, n in list(c["sites"].items())[:15]:
            out.append(f"  {n:5d}  {site}")
        if len(c["sites"]) > 15:
            out.append(f"  ... {len(c['sites']) - 15} more sites")
    for key, sm in bench.samplers.items():
        parts = []
        for name in ("sample_from_logits", "mask_tokens"):
            d = sm[name]
            share = f" = {100 * d['share_of_step']:.1f}% of the step" if d["share_of_step"] else ""
            parts.append(f"{name} {d['ms']:.2f} ms{share}")
        out.append(f"Objective pieces, {key} (n={sm['rows']} masked rows x V={sm['vocab']}): "
                   + "; ".join(parts))
    return "\n".join(out)


def header(s: Settings) -> str:
    def ver(dist: str) -> str:
        from importlib import metadata

        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "NOT INSTALLED (see the setup below)"

    dev = torch.cuda.get_device_name(s.device) if s.cuda else platform.processor() or "cpu"
    return "\n".join([
        f"gpu_rtd_step: device {s.device} ({dev}), python {platform.python_version()}, torch "
        f"{torch.__version__}, transformers {ver('transformers')}, deepspeed {ver('deepspeed')}, "
        f"megatron-core {ver('megatron-core')}",
        f"{'tiny CPU sizes (seq 64)' if s.tiny else 'full sizes (seq 512)'}; deadline "
        f"{s.deadline_s:.0f}s; warm-up {s.warmup_steps}, timed {s.min_steps}-{s.max_steps} steps "
        f"within {s.row_budget_s:.0f}s per row; masking {MASK_PROB:.0%}, lambda {RTD_LAMBDA:g}",
        "FLOPs per token (rtd_scale/flops.py, bench/README.md): 3 x sum over layers (24h^2 + 4sh "
        "+ 4Rh, R = relative rows of disentangled attention, 0 for BERT attention) "
        "+ 3 x mask_prob x MLM head (2 h_g E + 2 E V) + projections + RTD head; MFU = FLOP/s over "
        "the measured bf16 matmul ceiling",
        "Setup of this machine (also --print-setup):",
        *("  " + ln for ln in SETUP.splitlines()),
    ])


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def settings_from(args) -> Settings:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device visible; use --device cpu --tiny")
    if args.tiny:
        return Settings(device=dev, tiny=True, deadline_s=args.deadline_s or 300.0,
                        warmup_steps=1, min_steps=2, max_steps=2, row_budget_s=0.0,
                        profile_steps=1, compile_backend=args.compile_backend or "eager",
                        zero_stage=args.zero_stage, matmul_size=256)
    return Settings(device=dev, tiny=False, deadline_s=args.deadline_s or 450.0,
                    warmup_steps=3, min_steps=5, max_steps=30, row_budget_s=5.0,
                    profile_steps=3, compile_backend=args.compile_backend or "inductor",
                    zero_stage=args.zero_stage, matmul_size=8192)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--tiny", action="store_true",
                   help="tiny sizes (hidden 64, seq 64, 2 timed steps): the CPU smoke run")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated subset of {', '.join(WORKLOADS)}")
    p.add_argument("--skip", default="",
                   help="comma-separated parts to leave out: stack, profile, extras, "
                        "rtd-compile, hf-compile")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3),
                   help="ZeRO stage of rtd_scale's engine rows (as ds_configs/zeroN.json); "
                        "default 1: DeepSpeed's BF16_Optimizer (flat fp32 master weights and "
                        "gradients). ELECTRA-large also gets a ZeRO-0 row")
    p.add_argument("--compile-backend",
                   help="torch.compile backend (default inductor; eager in --tiny)")
    p.add_argument("--deadline-s", type=float,
                   help="whole-run deadline in seconds (default 450; 300 in --tiny)")
    p.add_argument("--json", help="also write every result to this JSON file")
    p.add_argument("--print-setup", action="store_true",
                   help="print how to build, carry and install the wheels, then exit")
    p.add_argument("--child-row", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(filter(None, args.workloads.split(","))) - set(WORKLOADS)
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    parts = {"stack", "profile", "extras", "rtd-compile", "hf-compile"}
    bad = set(filter(None, args.skip.split(","))) - parts
    if bad:
        p.error(f"--skip: unknown {sorted(bad)}; choose from {', '.join(sorted(parts))}")
    return args


def child_main(args, s: Settings) -> int:
    """Run one row (torch.compile) in this child process and write it for the parent."""
    workload, impl = args.child_row.split(":")
    bench = Bench(s, args, in_child=True)
    bench.log = lambda *a, **k: None
    row = bench.run(Item(workload, impl, min_left_s=0.0))
    Path(args.child_out).write_text(json.dumps(dataclasses.asdict(row)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.print_setup:
        print(SETUP, end="")
        return 0
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    s = settings_from(args)
    if args.child_row:
        return child_main(args, s)
    bench = Bench(s, args)
    print(header(s), flush=True)
    bench.ceiling = matmul_ceiling(s)
    print(f"bf16 matmul ceiling ({s.matmul_size}^3 torch.mm): {bench.ceiling / 1e12:.1f} TFLOP/s",
          flush=True)
    workloads = [w for w in args.workloads.split(",") if w]
    for item in plan(s, workloads, set(filter(None, args.skip.split(",")))):
        bench.run(item)
        sys.stdout.flush()
    if _PARALLEL_CTX is not None:
        from rtd_scale import distributed

        distributed.teardown()
    order = list(IMPL_TITLES)
    def ours_first(k: str):
        return (0 if "|rtd" in k or "mcore" in k else 1, order.index(k.split("|")[1]))

    large = sorted([k for k in bench.profiles if k.startswith("electra-large")], key=ours_first)
    stack = sorted([k for k in bench.profiles if k.startswith("stack")], key=ours_first)
    report = "\n\n".join(filter(None, [
        f"== Results (bf16 matmul ceiling {bench.ceiling / 1e12:.1f} TFLOP/s; "
        f"run {time.perf_counter() - bench.t0:.0f}s) ==",
        results_table(bench),
        "== Where the time goes: ELECTRA-large RTD step ==",
        profile_table(bench, large),
        "== Where the time goes: layer stack alone ==",
        profile_table(bench, stack),
        "== rtd_scale step diagnostics ==",
        diagnostics_text(bench),
    ]))
    print("\n" + report, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "ceiling_flops_per_s": bench.ceiling,
            "rows": [dataclasses.asdict(r) for r in bench.rows],
            "profiles": {k: dataclasses.asdict(v) for k, v in bench.profiles.items()},
            "phases_ms": bench.phases, "host_syncs": bench.syncs,
            "objective_pieces": bench.samplers,
            "settings": {k: str(v) for k, v in dataclasses.asdict(s).items()},
            "report": report,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
