"""Memory per rank of an RTD training run: what a rank holds, part by part, before a job starts
(``pretrain.py``'s ``memory per rank:`` line, ``tools/estimate_cost.py --memory``,
``bench/memory.py``).

The model states follow the ZeRO paper (arXiv 1910.02054 §5: Adam's fp32 master weights and two
moments are 12 bytes per parameter, gradients 2 or 4, the 16-bit weights 2; stage 1 shards the
optimizer states over the data-parallel ranks, stage 2 also the gradients, stage 3 also the
weights) and what DeepSpeed 0.19.8 allocates beside them, read from its source:

- ZeRO 1 and 2 keep an fp32 copy of the rank's partition even when the model is fp32
  (``stage_1_and_2.py``: ``weights_partition ... .clone()``); stage 3 reuses an fp32 partition
  (``stage3.py``: "we don't need another copy of the weights").
- ZeRO 1 and 2 stage each bucket of gradients in a buffer of ``reduce_bucket_size`` elements
  (``setup_buckets``; fp32 at stage 1, the model's dtype at stage 2), stage 0 flattens the
  gradients into buckets of 500M elements to all-reduce them (``buffered_allreduce_fallback``),
  stage 3 reduces through a bucket of ``reduce_bucket_size``.
- ZeRO 1 reduces the gradients after the whole backward pass (``reduce_gradients``), so every
  gradient is alive at once; stage 2 reduces bucket by bucket during the backward pass.
- ZeRO 3 gathers a layer's parameters before it runs and keeps at most
  ``stage3_max_live_parameters`` gathered (DeepSpeed's default 1e9 keeps a base or large model
  whole), ``stage3_prefetch_bucket_size`` more ahead of use; a parameter under
  ``stage3_param_persistence_threshold`` elements stays gathered on every rank.
- bf16 at stage 0 (gradients accumulated in bf16, rtd_scale's ds_config sets no
  ``grad_accum_dtype`` there) is DeepSpeed's ``FP16_UnfusedOptimizer`` around the client AdamW
  (``engine._do_optimizer_sanity_check``: ``DDP_BFLOAT16``): an fp32 copy of every weight and
  both moments on every rank, not sharded, and at the step an fp32 ``.grad`` of every weight
  beside the bf16 one — 20 bytes a parameter, more than fp32's 16. With pipeline parallelism it
  is ``BF16_Optimizer``: fp32 masters and moments sharded over the data-parallel ranks (ZeRO 1's
  layout) and a whole bf16 gradient accumulator.
- ZeRO-Offload (``offload_optimizer``) moves the fp32 masters, moments and gradient partition to
  host memory; ``offload_param`` (stage 3) the weights' partition.

Activations: per micro-batch of b sequences of s tokens, what autograd keeps for the backward
pass, per layer and per model, counted on the CPU with ``torch.autograd.graph.saved_tensors_hooks``
(``bench/memory.py --saved``) and written as multiples of s·b·h (and of the n·s·K attention
scores where an attention keeps them); with full-layer recompute (``--recompute-activations``)
a layer keeps only its input, and one layer's activations are alive again while it is
recomputed. The MLM head's logits exist at the masked positions only, over this rank's share of
the vocabulary-parallel table.

Not ours to shrink, named apart: the process's own memory (the Python interpreter, torch,
DeepSpeed and megatron-core with their kernels and caches; on the CPU the resident size measured
before the model is built, on a GPU the CUDA context, which ``max_memory_allocated`` does not
count) and DeepSpeed's CPU Adam op under offload.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

GB = 1e9

# DeepSpeed 0.19.8's DeepSpeedZeroConfig defaults (runtime/zero/config.py) and the engine's
# stage-0 all-reduce bucket (runtime/engine.py, MEMORY_OPT_ALLREDUCE_SIZE).
DS_DEFAULTS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
               "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9,
               "stage3_param_persistence_threshold": 1e5, "sub_group_size": 1e9}
STAGE0_ALLREDUCE_BUCKET = 5e8
_ALIASES = {"prefetch_bucket_size": "stage3_prefetch_bucket_size",
            "max_live_parameters": "stage3_max_live_parameters",
            "param_persistence_threshold": "stage3_param_persistence_threshold"}

# Saved activations per layer and micro-batch, in elements of the activation dtype per s·b·h:
# C_HIDDEN + C_FFN · (FFN width / h), the FFN width doubled for a gated FFN (fc1 of 2f);
# disentangled attention's position projections C_REL · R·h per layer (R relative rows). Counted
# on the CPU by bench/memory.py --saved (h 768, 12 heads, s 256 and 512, b 1; what autograd
# keeps, parameters excluded). The attention's [b, n, s, K] scores, C_SCORES · n·s·K per layer
# (K the keys each query attends to): none for SDPA's flash kernels; DeBERTa's explicit core
# (the CPU's: c2c, the c2p and p2c gathers, their sum, softmax and the backward's scatter) from
# the measured peak of debertav3-base (bench/memory.py, ZeRO-3, fp32, 2 ranks) less the rest of
# the estimate; the GPU's SDPA core keeps fewer (one bias and its gradient), so this is high
# there.
C_HIDDEN = {"bert": 48.0, "disentangled": 46.0, "rotary": 48.0}
C_FFN = {"bert": 2.0, "disentangled": 2.0, "rotary": 2.0}
C_SCORES = {"bert": 0.0, "disentangled": 5.0, "rotary": 0.0}
C_REL = 4.0
# Per token and micro-batch outside the layers (embeddings, heads, losses, masks, sampled ids):
# elements of the activation dtype per s·b·h of the discriminator.
C_OUTSIDE = 12.0
# The MLM logits at the masked positions: elements per masked position and vocabulary row of
# this rank (logits, their fp32 softmax and gradient, and the sampler's Gumbel scores).
C_LOGITS = 4.0


@dataclass(frozen=True, kw_only=True)
class ParameterCounts:
    """A rank's parameters (elements), by how parallelism divides them."""

    vocab: int  # rows of the vocabulary-parallel tables (token tables, GDES's E_Δ, MLM bias)
    layers: int  # the encoders' transformer layers
    other: int  # the rest: positions, relative tables, norms, projections, heads
    largest: int  # the largest single parameter (a per-tensor optimizer step's temporaries)

    @property
    def total(self) -> int:
        return self.vocab + self.layers + self.other

    def per_rank(self, tp: int, pp: int) -> "ParameterCounts":
        """This whole-model count as the largest rank holds it at TP ``tp`` and PP ``pp``: the
        tables and the layers split over TP, the layers over PP (the first stage holds the
        tables, the last the heads; both counted: an upper bound)."""
        return ParameterCounts(vocab=-(-self.vocab // tp), layers=-(-self.layers // (tp * pp)),
                               other=self.other, largest=-(-self.largest // tp))


def count_parameters(model) -> ParameterCounts:
    """``model``'s own parameters (each once; a ZeRO-3 partition by its full size
    ``ds_numel``), sorted by what divides them: the vocabulary-parallel ones are those
    ``model/weights.py``'s ``mark_vocab_parallel`` marked."""
    from rtd_scale.model.weights import VOCAB_DIM_ATTR

    seen: dict[int, Any] = {}
    for name, p in model.named_parameters():
        seen.setdefault(id(p), (name, p))
    vocab = layers = other = largest = 0
    for name, p in seen.values():
        n = int(getattr(p, "ds_numel", p.numel()))
        largest = max(largest, n)
        if getattr(p, VOCAB_DIM_ATTR, None) is not None:
            vocab += n
        elif ".layers." in name:
            layers += n
        else:
            other += n
    return ParameterCounts(vocab=vocab, layers=layers, other=other, largest=largest)


def config_parameter_counts(cfg, ctx=None) -> ParameterCounts:
    """The parameter counts of a ``RunConfig``'s model, built on the meta device (no memory)
    by the run's own builder (``model/build.py``), so every layout and sharing mode counts
    exactly. ``ctx``: a started run's ``ParallelContext``: this rank's TP shard and pipeline
    stage; None: the whole model (TP 1, PP 1), in a one-process group of this process."""
    import copy

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rtd_scale import cpu_compat
    from rtd_scale.model.build import build_on_meta

    own_group = ctx is None and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ps.initialize_model_parallel(tensor_model_parallel_size=1,
                                     pipeline_model_parallel_size=1,
                                     create_gloo_process_groups=False)
        cpu_compat.install()
    try:
        if ctx is None:
            cfg = copy.deepcopy(cfg)
            cfg.parallel.tensor_model_parallel_size = 1
            cfg.parallel.pipeline_model_parallel_size = 1
        model = build_on_meta(cfg, ctx)
        return count_parameters(model)
    finally:
        if own_group:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


@dataclass(frozen=True, kw_only=True)
class ZeroSettings:
    """What the estimate reads of a ds_config's ``zero_optimization`` (DeepSpeed's defaults
    for what it does not set)."""

    stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    reduce_bucket_size: float = DS_DEFAULTS["reduce_bucket_size"]
    allgather_bucket_size: float = DS_DEFAULTS["allgather_bucket_size"]
    prefetch_bucket_size: float = DS_DEFAULTS["stage3_prefetch_bucket_size"]
    max_live_parameters: float = DS_DEFAULTS["stage3_max_live_parameters"]
    param_persistence_threshold: float = DS_DEFAULTS["stage3_param_persistence_threshold"]
    sub_group_size: float = DS_DEFAULTS["sub_group_size"]

    @classmethod
    def from_ds_config(cls, ds_config: dict) -> "ZeroSettings":
        zero = dict(ds_config.get("zero_optimization") or {})
        for short, long in _ALIASES.items():
            if short in zero:
                zero[long] = zero.pop(short)

        def device(key: str) -> bool:
            return (zero.get(key) or {}).get("device", "none") in ("cpu", "nvme")

        return cls(stage=int(zero.get("stage", 0)), offload_optimizer=device("offload_optimizer"),
                   offload_param=device("offload_param"),
                   **{f: float(zero.get(k, DS_DEFAULTS[k])) for f, k in (
                       ("reduce_bucket_size", "reduce_bucket_size"),
                       ("allgather_bucket_size", "allgather_bucket_size"),
                       ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
                       ("max_live_parameters", "stage3_max_live_parameters"),
                       ("param_persistence_threshold", "stage3_param_persistence_threshold"),
                       ("sub_group_size", "sub_group_size"))})


@dataclass(frozen=True, kw_only=True)
class RankLayout:
    """One rank's place in a run: parallel sizes, ZeRO, precision, micro-batch, device."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: ZeroSettings = field(default_factory=ZeroSettings)
    bf16: bool = False
    micro_batch_size: int = 1
    seq_length: int = 512
    recompute: bool = False
    device: str = "cuda"  # "cuda" or "cpu": a CPU rank's buffers count as the pages it touches


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, part by part: ``parts`` ours (the model states, DeepSpeed's buffers,
    activations), ``host`` what ZeRO-Offload keeps in host memory, ``not_ours`` the process's
    own (runtime) memory."""

    parts: dict[str, float]
    host: dict[str, float]
    not_ours: dict[str, float]

    @property
    def device_bytes(self) -> float:
        """What the accelerator holds of ours (CUDA's ``max_memory_allocated`` counts this)."""
        return sum(self.parts.values())

    @property
    def total(self) -> float:
        """Everything a rank holds: ours on the device and host, and the runtime's."""
        return self.device_bytes + sum(self.host.values()) + sum(self.not_ours.values())

    def measured_as(self, device_type: str) -> float:
        """The share of the estimate that ``peak_bytes`` measures on ``device_type``: ours on
        the device on a GPU (``max_memory_allocated``), everything on the CPU (the resident
        size)."""
        return self.device_bytes if device_type == "cuda" else self.total

    def line(self) -> str:
        """``memory per rank: estimate 9.40 GB = weights 1.31 + … | host … | not ours …``."""
        def fmt(d: dict[str, float]) -> str:
            return " + ".join(f"{k} {v / GB:.2f}" for k, v in d.items() if v > 0) or "0"

        out = f"memory per rank: estimate {self.total / GB:.2f} GB = {fmt(self.parts)}"
        if any(v > 0 for v in self.host.values()):
            out += f"; host (offload) {fmt(self.host)}"
        if self.not_ours:
            out += f"; not ours {fmt(self.not_ours)}"
        return out


def _activations(cfg, layout: RankLayout, b_act: int) -> tuple[float, float]:
    """(saved activations of one micro-batch on this rank's layers, MLM logits) in bytes; under
    ``rtd.objective=mlm`` of the one encoder the run builds (``RunConfig.trained_model``)."""
    from rtd_scale import flops
    from rtd_scale.config import Objective

    m = cfg.trained_model()
    encoders = ((m.generator,) if cfg.rtd.objective is Objective.MLM
                else (m.generator, m.discriminator))
    family = m.attention_type.value
    s, b = layout.seq_length, layout.micro_batch_size
    keys = flops.attended_keys(s, m.window_size)
    total = 0.0
    peak_layer = 0.0
    for enc in encoders:
        h, heads = enc.hidden_size, enc.num_attention_heads
        ffn = enc.ffn_hidden_size * (2 if m.mlp_activation.gated else 1)
        per_layer_elems = s * b * h * (C_HIDDEN[family] + C_FFN[family] * ffn / h) / layout.tp
        local = sum(m.local_layer(n) for n in range(1, enc.num_layers + 1))
        scores = heads * s * b * C_SCORES[family] / layout.tp
        if m.attention_type.relative_table:
            per_layer_elems += C_REL * flops.relative_rows(m, s) * h / layout.tp
        layers_here = enc.num_layers // layout.pp
        local_here = local // layout.pp
        elems = (layers_here * per_layer_elems + (layers_here - local_here) * scores * s
                 + local_here * scores * keys)
        one_layer = (per_layer_elems + scores * s) * b_act
        peak_layer = max(peak_layer, one_layer)
        if layout.recompute:  # each layer keeps its input; one layer alive while recomputed
            total += layers_here * s * b * h * b_act
        else:
            total += elems * b_act
    if layout.recompute:
        total += peak_layer
    h_d = m.discriminator.hidden_size
    total += C_OUTSIDE * s * b * h_d * b_act
    vocab = m.padded_vocab_size(layout.tp) // layout.tp
    masked = s * b * cfg.rtd.mask_prob
    logits = C_LOGITS * masked * vocab * 4
    return total, logits


def estimate(cfg, mine: ParameterCounts, layout: RankLayout, *,
             runtime_bytes: float = 0.0) -> MemoryEstimate:
    """Bytes per rank of training ``cfg`` at ``layout``. ``mine``: the rank's parameters
    (``config_parameter_counts(cfg, ctx)`` in a run; a whole model's ``.per_rank(tp, pp)`` for
    a plan). ``runtime_bytes``: the process's own memory (the
    CPU's resident size before the model is built; on a GPU the CUDA context), named apart.

    Each part is the most it holds during a step (see the module docstring); their sum is the
    rank's peak, because the parts that come and go in a step (gradients, buckets, the
    activations) are alive together at the end of the backward pass.
    """
    z = layout.zero
    p, n = float(mine.total), float(layout.dp)
    w = 2 if layout.bf16 else 4  # bytes of a weight and of its .grad
    cpu = layout.device == "cpu"

    def bucket(size: float, elem_bytes: int) -> float:
        # a CPU buffer's untouched pages are not resident: at most the model's gradients fill it
        return (min(size, p) if cpu else size) * elem_bytes

    parts: dict[str, float] = {}
    host: dict[str, float] = {}
    if z.stage < 3:
        parts["weights"] = w * p
    else:
        parts["weights"] = w * p / n
        live = min(p, z.max_live_parameters + z.prefetch_bucket_size)
        parts["ZeRO-3 live parameters"] = w * live
    if z.stage == 0:
        if layout.bf16 and layout.pp == 1:
            # FP16_UnfusedOptimizer around the client AdamW: a whole fp32 copy of every weight
            # and both moments, not sharded (12); the bf16 .grad, and at the step an fp32 .grad
            # of every weight made before the client steps (unfused_optimizer.py ``step``)
            parts["gradients"] = (w + 4) * p
            parts["optimizer"] = 12 * p
        elif layout.bf16:  # BF16_Optimizer: a bf16 .grad and a whole bf16 accumulator
            parts["gradients"] = 2 * w * p
            parts["optimizer"] = 12 * p / n
        else:
            parts["gradients"] = 4 * p
            parts["optimizer"] = 8 * p
            # after the backward pass the gradients are flattened into all-reduce buckets, then
            # NonFiniteSkippingAdamW computes an update and its where() per tensor: one phase
            # after the other, so the larger of the two
            reduce = bucket(STAGE0_ALLREDUCE_BUCKET, 4) if n > 1 else 0.0
            parts["all-reduce bucket / optimizer step"] = max(reduce, 3 * 4 * float(mine.largest))
    else:
        grads_alive = w * p if z.stage == 1 else 0.0  # stage 1 reduces after the backward pass
        if z.stage == 2 and not layout.bf16 and cpu:
            # fitted: in fp32 on the CPU, stage 2 was measured to hold about one more copy of
            # the gradients than its buckets and partition (bench/memory.py, 2 ranks, seq 512:
            # electra-base 5.83 GB, debertav3-base 8.90 GB; bf16 holds none)
            grads_alive = w * p
        grad_partition = 4 * p / n
        master = 4 * p / n if (z.stage < 3 or layout.bf16) else 0.0
        moments = 8 * p / n
        parts["gradients"] = grads_alive + (0.0 if z.offload_optimizer else grad_partition)
        staging = 4 if z.stage == 1 else w
        parts["reduce bucket"] = bucket(z.reduce_bucket_size, staging)
        optimizer = master + moments
        if z.offload_optimizer:
            host["optimizer (offloaded)"] = optimizer + grad_partition
        else:
            parts["optimizer"] = optimizer
        if z.stage == 3 and z.offload_param:
            host["weights (offloaded)"] = parts.pop("weights")
    # bf16 activations are 2 bytes on a GPU; on the CPU a bf16 step was measured to keep about
    # what an fp32 step keeps (bench/memory.py: electra-base ZeRO-1, 2 ranks)
    b_act = 2 if layout.bf16 and not cpu else 4
    acts, logits = _activations(cfg, layout, b_act)
    parts["activations"] = acts
    parts["MLM logits"] = logits
    # torch's AdamW unfused (on the CPU; fused on a GPU) makes two temporaries the size of the
    # tensor it steps (√v and the denominator: torch/optim/adam.py ``_single_tensor_adam``); a
    # ZeRO-1/2 optimizer steps the rank's flat fp32 partition at once, ZeRO-3 its sub-groups of
    # ``sub_group_size``, ZeRO-0 one parameter at a time. They live after the backward pass has
    # freed the activations, so only what they add beyond those counts (measured: electra-large
    # ZeRO-2 bf16 with recompute on 2 CPU ranks, bench/rehearse.py). DeepSpeed's CPU Adam
    # (offload) updates in place; ZeRO-0 in fp32 has its own step above.
    if cpu and not z.offload_optimizer and (z.stage > 0 or layout.bf16):
        per_tensor = z.stage == 0 and layout.pp == 1  # BF16_Optimizer (PP) steps a partition
        stepped = (float(mine.largest) if per_tensor else
                   p / n if z.stage < 3 else min(p / n, z.sub_group_size))
        extra = 2 * 4 * stepped - acts - logits
        if extra > 0:
            parts["optimizer step"] = extra
    if z.stage == 3 and z.offload_optimizer:
        # ZeRO-3 sets its optimizer up with a step on zero gradients through an fp32 buffer of
        # the largest sub-group (stage3.py ``initialize_optimizer_states``), made beside the
        # host's gradient partition it keeps: before any activation exists, so only what it
        # adds beyond them counts
        extra = 4 * min(p / n, z.sub_group_size) - acts - logits
        if extra > 0:
            host["optimizer set-up"] = extra
    not_ours = {"runtime": runtime_bytes} if runtime_bytes else {}
    if cpu and z.stage == 3:
        # ZeRO-3's gathers on the CPU: the freed gathered copies stay in the C heap (glibc keeps
        # freed blocks below its mmap threshold); measured at about one copy of the rank's
        # weights (bench/memory.py: electra-base ZeRO-3, 2 ranks, fp32 and bf16)
        not_ours["CPU heap of ZeRO-3 gathers"] = w * p
    return MemoryEstimate(parts, host, not_ours)


def layout_of(cfg, ds_config: dict, *, dp: int, device: str) -> RankLayout:
    """The ``RankLayout`` of a resolved run (its config, resolved ds_config and DP size)."""
    from rtd_scale.config import Precision

    return RankLayout(tp=cfg.parallel.tensor_model_parallel_size,
                      pp=cfg.parallel.pipeline_model_parallel_size, dp=dp,
                      zero=ZeroSettings.from_ds_config(ds_config),
                      bf16=cfg.train.precision is Precision.BF16,
                      micro_batch_size=cfg.train.micro_batch_size,
                      seq_length=cfg.data.seq_length, recompute=cfg.model.recompute_activations,
                      device=device)


_cpu_peak = 0.0  # the largest resident size peak_bytes has seen in this process


def peak_bytes(device) -> Optional[float]:
    """This rank's measured peak: CUDA's ``max_memory_allocated`` on a GPU (ours: the
    estimate's ``device_bytes``), the process's peak resident size (``ru_maxrss``) on the CPU
    (everything: the estimate's ``total``). Never smaller than an earlier call's."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return float(torch.cuda.max_memory_allocated(device))
    import resource

    global _cpu_peak
    # KiB on Linux. The kernel updates its high-water mark lazily (when the resident size
    # shrinks), so the size now can exceed it; keep the largest either has shown
    # (tests/e2e/test_pretrain_launcher.py: the logged peak is a running max)
    _cpu_peak = max(_cpu_peak, float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0,
                    resident_bytes())
    return _cpu_peak


def resident_bytes() -> float:
    """This process's resident size now (``/proc/self/statm``; the CPU runtime's share)."""
    import os

    with open("/proc/self/statm", encoding="ascii") as f:
        return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
