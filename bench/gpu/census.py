"""Where the time goes: a torch.profiler summary by kernel family, the operations of a step that
make the host wait for the device (the sync census), and the masking's and sampler's own cost."""
from __future__ import annotations

import contextlib
import traceback
import warnings
from dataclasses import dataclass

import torch

from bench.common import MASK_ID, REPO, SEED, SPECIAL_IDS, sync
from bench.gpu.timing import Clock, Stepper
from bench.gpu.workloads import Settings
from rtd_scale.phases import PHASE_DATA_WAIT

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
    only where there is a device: on CPU nothing is copied). Host work is not counted: on CUDA an
    operation on host tensors alone, and on CPU (where host and device are one) such an
    operation inside the step's data-wait phase — ``training/step.py``'s
    ``micro_batch_kwargs`` decides ``has_padding`` on the host batch before its copy. On CUDA
    the real synchronisations are also counted with ``torch.cuda.set_sync_debug_mode``.
    """

    ALWAYS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
              "aten::is_nonzero", "aten::equal", "aten::unique_dim", "aten::_unique2",
              "aten::unique_consecutive", "aten::repeat_interleave"}
    INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}
    ROOTS = ("rtd_scale/", "deepspeed/", "megatron/", "transformers/", "bench/")
    OWN_ROOTS = ("rtd_scale/", "bench/")  # folders of this checkout; the rest are libraries
    MACHINERY = ("bench/gpu_rtd_step.py", "bench/gpu/", "torch/_compile.py", "torch/_dynamo/",
                 "torch/_ops.py", "torch/utils/_python_dispatch.py", "torch/overrides.py")

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
        site = site or "bench/gpu/ (the benchmark's own step)"
        return f"{site} via {via}" if via else site

    @staticmethod
    def _host_only(args, kwargs) -> bool:
        from torch.utils._pytree import tree_leaves

        tensors = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        return all(t.device.type == "cpu" for t in tensors)

    @classmethod
    def run(cls, step: Stepper, i: int, device: torch.device) -> dict:
        from torch.utils._python_dispatch import TorchDispatchMode

        sites: dict[str, int] = {}
        phases: list[str] = []

        @contextlib.contextmanager
        def timers(phase: str):  # the step's phases (Stepper): which one an operation is in
            phases.append(phase)
            try:
                yield
            finally:
                phases.pop()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                # a copy names its destination device apart from its tensors: judged by _is_sync
                host = (func._schema.name not in ("aten::_to_copy", "aten::copy_")
                        and (device.type == "cuda" or PHASE_DATA_WAIT in phases)
                        and cls._host_only(args, kwargs))
                if not host and cls._is_sync(func, args, kwargs):
                    key = f"{cls._site()}  [{func._schema.name}]"
                    sites[key] = sites.get(key, 0) + 1
                return func(*args, **(kwargs or {}))

        with Mode():
            step(i, timers)
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
                           vocab_start=0, sampleable=model.sampler.sampleable, temperature=1.0)

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
