#!/usr/bin/env python
"""Model FLOPs of one RTD training step, of a whole regime, and the GPU-hours it takes.

    python tools/estimate_cost.py --preset debertav3-large --tokens-per-step 8192*512 \\
        --steps 500000 --mfu 0.4 --peak-tflops 989 --gpus 64
    python tools/estimate_cost.py --preset debertav3-large --tokens-per-s 1.2e6 --gpus 64

Shapes come from the rtd_scale.config preset (generator and discriminator: layers, hidden size,
FFN size; the shared table's width E; vocabulary V; mask probability p). Defaults for the regime
are the preset's: tokens per step = global batch × sequence length, steps = train_iters.

Formula: model FLOPs per token of one training step (forward + backward), counting each
multiply-add as 2 FLOPs and the backward pass as twice the forward (gradients with respect to
inputs and to weights), so every matmul costs 6 × (its weight count) per token it is applied to:

  per encoder layer (hidden h, FFN f, sequence length s, all s positions attend to all s):
      matmuls     6 · (4h² + 2hf)        Q, K, V and output projections (4h²), FFN in and out (2hf)
      attention   12 · (s + R) · h       QKᵀ and attention × V: 2·s·h each forward, × 3; with
                                         DeBERTa's disentangled attention also content→position
                                         and position→content against the R relative embeddings
                                         a sequence reads (2·R·h each; R = 511 at s 512 with 256
                                         buckets; R = 0 for BERT attention)
  modern block:   a gated FFN (GeGLU / SwiGLU, fc1 of width 2f) has matmuls 6 · (4h² + 3hf); a
                  local layer's queries attend to the K keys of their window (|i - j| <= w/2,
                  K = 124.9 on average for w 128 at s 1,024), its attention 12 · K · h
  per model:      L · (matmuls + attention) [+ 6 · E · h when E ≠ h: the ELECTRA-style projection
                                             of the shared table's width E to the hidden size]
  MLM head        p · 6 · (h_G · E + E · V)  dense h_G → E, then logits against the tied table,
                                             at the masked positions only (a fraction p of tokens)
  RTD head        6 · (h_D² + h_D)           dense h_D → h_D and h_D → 1, at every position

  F_token = generator + discriminator + MLM head + RTD head
  F_step  = F_token · tokens_per_step;      F_total = F_step · steps

The masked-LM control (--set rtd.objective=mlm) counts one encoder of the discriminator's shape
(in the generator's row) and its MLM head: F_token = encoder + MLM head. For an RTD regime the
tool also prints the steps a masked-LM run of the same shape takes for the same FLOPs (steps ×
F_RTD / F_MLM): equal compute as a number.

Both encoders run forward and backward every step: the generator is trained by L_MLM, the
discriminator by λ·L_RTD, and the sampled replacements carry no gradient. Excluded, as in the
usual model-FLOPs (MFU) convention: embedding lookups and their scatter-add gradients, layer
norms, softmax, GELU, dropout, biases, the Gumbel-max sampling (elementwise, no matmul), the
optimizer update and any activation recomputation. V is the real vocabulary, not the padded one.

Memory (--memory, with --gpus and --gpu-memory): the bytes per rank of rtd_scale/memory.py (the
function pretrain.py prints at start) for each of ds_configs/zero0-3.json and zero3_offload.json
as written (their bucket and live-parameter limits), at the precision of --bf16 (the regime's) or
fp32, TP --tp and DP = GPUs / TP: the largest micro-batch that fits and divides the rank's share
of the global batch, and the gradient accumulation it implies. A GPU's room is --gpu-memory less
what max_memory_allocated does not count (CUDA context, NCCL buffers) and the caching
allocator's slack.

GPU-hours: with a measured throughput (--tokens-per-s, for the whole job, and --gpus),
hours = total tokens / tokens-per-s / 3600 and GPU-hours = hours × GPUs. With an assumed model
FLOPs utilisation (--mfu and --peak-tflops, per GPU, e.g. 989 dense bf16 TFLOPs for an H100 SXM),
GPU-hours = F_total / (mfu · peak) / 3600, and wall-clock hours = GPU-hours / GPUs.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale import flops  # noqa: E402
from rtd_scale.cli_errors import OneLineArgumentParser  # noqa: E402
from rtd_scale.batch import BatchNames  # noqa: E402
from rtd_scale.config import ConfigError, Objective, RunConfig, apply_override  # noqa: E402
from rtd_scale.presets import PRESETS, preset  # noqa: E402
from rtd_scale.batch import batch_layout as config_batch_layout  # noqa: E402


@dataclass(frozen=True)
class StepFlops:
    """FLOPs per token of one RTD training step (forward + backward), by component."""

    generator_matmul: float
    generator_attention: float
    discriminator_matmul: float
    discriminator_attention: float
    embedding_projection: float
    mlm_head: float
    rtd_head: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def rtd_flops_per_token(cfg: RunConfig, *, seq_length: Optional[int] = None,
                        vocab_size: Optional[int] = None,
                        mask_prob: Optional[float] = None) -> StepFlops:
    """Model FLOPs per token of one step for ``cfg``'s shapes (``rtd_scale.flops``, the formula
    bench/ uses for MFU). ``seq_length``, ``vocab_size`` and ``mask_prob`` default to the
    config's values."""
    return StepFlops(**flops.rtd_flops_breakdown(flops.dims_of(
        cfg, seq_length=seq_length, vocab_size=vocab_size, mask_prob=mask_prob)))


def masked_lm_flops_per_token(cfg: RunConfig, **overrides) -> StepFlops:
    """``rtd_flops_per_token`` of ``cfg`` under ``rtd.objective=mlm`` (``cfg`` is left as it
    is): the masked-LM control of the same shape."""
    import copy

    mlm = copy.deepcopy(cfg)
    mlm.rtd.objective = Objective.MLM
    return rtd_flops_per_token(mlm, **overrides)


def gpu_hours(total_flops: float, total_tokens: float, *, tokens_per_s: Optional[float] = None,
              gpus: Optional[int] = None, mfu: Optional[float] = None,
              peak_tflops: Optional[float] = None) -> tuple[float, Optional[float]]:
    """(GPU-hours, wall-clock hours or None when the GPU count is unknown).

    Raises:
        ValueError: neither (tokens_per_s and gpus) nor (mfu and peak_tflops) given.
    """
    if tokens_per_s is not None:
        if gpus is None:
            raise ValueError("--tokens-per-s is the whole job's throughput: also pass --gpus")
        hours = total_tokens / tokens_per_s / 3600.0
        return hours * gpus, hours
    if mfu is None or peak_tflops is None:
        raise ValueError("pass --tokens-per-s with --gpus, or --mfu with --peak-tflops")
    gpu_h = total_flops / (mfu * peak_tflops * 1e12) / 3600.0
    return gpu_h, (gpu_h / gpus if gpus else None)


# the tool's words for the numbers in rtd_scale.batch.batch_layout's errors
TOOL_NAMES = BatchNames(global_batch="global batch {}", micro_batch="micro-batch {}", tp="--tp {}",
                        ranks="ranks", ranks_per_node="GPUs",
                        global_fix="change --global-batch-size or --nodes")


def batch_layout(nodes: int, gpus_per_node: int, tp: int, global_batch: int,
                 micro_batch: int) -> tuple[int, int, int]:
    """(ranks, data-parallel size, gradient-accumulation steps) of a job of ``nodes`` nodes ×
    ``gpus_per_node`` ranks at tensor-parallel size ``tp``: rtd_scale.batch.batch_layout, the
    arithmetic slurm/lib/pretrain_job.sh applies and prints, with the same refusals.

    Raises:
        ConfigError: a TP that does not divide the ranks per node, a global batch that the DP
            size does not divide, or a micro-batch that does not divide the per-rank samples.
    """
    world = nodes * gpus_per_node
    dp, gas = config_batch_layout(world, global_batch, micro_batch, tp=tp,
                                  ranks_per_node=gpus_per_node, names=TOOL_NAMES)
    return world, dp, gas


def _product(text: str) -> int:
    """'8192*512' → 4194304 (integers joined by '*'; also plain integers and 1e6-style floats)."""
    try:
        return math.prod(int(float(part)) for part in text.replace("×", "*").split("*"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or a product like 8192*512, "
                                         f"got {text!r}") from None


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _fraction(text: str) -> float:
    """--mfu: a fraction in (0, 1]; a percentage (40, 40%) is refused with its fraction."""
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.4, got {text!r}") \
            from None
    if text.endswith("%") or value > 1:
        raise argparse.ArgumentTypeError(f"a fraction in (0, 1], got {text} (for {value:g}% "
                                         f"pass {value / 100:g})")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="debertav3-large", choices=list(PRESETS))
    p.add_argument("--seq-length", type=_positive(int), help="default: the preset's")
    p.add_argument("--vocab-size", type=_positive(int), help="default: the preset's")
    p.add_argument("--mask-prob", type=float, help="default: the preset's")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field, as pretrain.py's --set (e.g. rtd.objective=mlm: the "
                        "masked-LM control); repeatable")
    p.add_argument("--tokens-per-step", type=_product,
                   help="e.g. 8192*512; default: the preset's global batch × sequence length")
    p.add_argument("--steps", type=_positive(int), help="default: the preset's train_iters")
    p.add_argument("--tokens-per-s", type=_positive(float),
                   help="measured throughput of the whole job (TensorBoard "
                        "throughput/tokens_per_s); needs --gpus")
    p.add_argument("--gpus", type=_positive(int), help="GPUs in the job")
    p.add_argument("--nodes", type=_positive(int),
                   help="nodes in the job: GPUs = nodes × --gpus-per-node, and the layout and "
                        "batch arithmetic the Slurm scripts print are printed too")
    p.add_argument("--gpus-per-node", type=_positive(int), default=8,
                   help="ranks per node (#SBATCH --ntasks-per-node); default 8")
    p.add_argument("--tp", type=_positive(int), default=1, help="tensor-parallel size (RTD_TP)")
    p.add_argument("--global-batch-size", type=_positive(int),
                   help="sequences per step (RTD_GLOBAL_BATCH); default: the preset's")
    p.add_argument("--micro-batch-size", type=_positive(int),
                   help="sequences per rank per forward (RTD_MICRO_BATCH); default: the preset's")
    p.add_argument("--mfu", type=_fraction,
                   help="assumed model FLOPs utilisation, a fraction, e.g. 0.4")
    p.add_argument("--peak-tflops", type=_positive(float),
                   help="peak dense TFLOPs per GPU at the training precision, e.g. 989 (H100 "
                        "SXM bf16) or 312 (A100 bf16)")
    p.add_argument("--memory", action="store_true",
                   help="print the memory per GPU at each ZeRO stage (ds_configs/zero*.json) and "
                        "the largest micro-batch that fits; needs --gpus and --gpu-memory")
    p.add_argument("--gpu-memory", type=_positive(float),
                   help="GB of memory per GPU, e.g. 80 (H100) or 141 (H200); with --memory")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="with --memory: the training precision (the regime's bf16, default)")
    p.add_argument("--recompute-activations", action="store_true",
                   help="with --memory: megatron-core's full-layer recompute in both models")
    args = p.parse_args(argv)
    if args.memory and (args.gpus is None or args.gpu_memory is None):
        p.error("--memory plans for a cluster: also pass --gpus and --gpu-memory")
    if args.gpu_memory is not None and not args.memory:
        p.error("--gpu-memory is read with --memory only")
    if args.tokens_per_s is not None and args.gpus is None:
        p.error("--tokens-per-s is the whole job's throughput: also pass --gpus")
    if (args.mfu is None) != (args.peak_tflops is None):
        p.error("--mfu and --peak-tflops go together")
    if args.nodes is not None:
        gpus = args.nodes * args.gpus_per_node
        if args.gpus is not None and args.gpus != gpus:
            p.error(f"--gpus {args.gpus} differs from --nodes {args.nodes} × --gpus-per-node "
                    f"{args.gpus_per_node} = {gpus}; pass one of them")
        args.gpus = gpus
    if args.tokens_per_s is not None and args.mfu is not None:
        p.error("pass --tokens-per-s (measured) or --mfu with --peak-tflops (assumed), not both")
    return args


# what CUDA's max_memory_allocated does not count: the CUDA context with cuBLAS and NCCL's
# buffers (TODO(verify): measure on the GPU, torch.cuda.mem_get_info before and after start-up),
# and the caching allocator's slack between reserved and allocated memory
CUDA_RUNTIME_GB = 2.0
ALLOCATOR_SLACK = 0.10
ZERO_CONFIGS = (("ZeRO-0", "zero0.json"), ("ZeRO-1", "zero1.json"), ("ZeRO-2", "zero2.json"),
                ("ZeRO-3", "zero3.json"), ("ZeRO-3 + offload", "zero3_offload.json"))
DS_CONFIGS = Path(__file__).resolve().parents[1] / "ds_configs"


def memory_plan(cfg: RunConfig, *, gpus: int, gpu_memory_gb: float, tp: int, global_batch: int,
                seq_length: int, bf16: bool, recompute: bool, print_fn=print) -> list[tuple]:
    """For each of ``ZERO_CONFIGS``: (name, largest micro-batch that fits or None, its
    accumulation, its MemoryEstimate), printed as a table. The micro-batch divides the rank's
    share of ``global_batch`` (global / DP); it fits when the estimate's device bytes, plus the
    allocator's slack, are under ``gpu_memory_gb`` less ``CUDA_RUNTIME_GB``."""
    import json
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    from rtd_scale import memory

    dp = gpus // tp
    whole = memory.config_parameter_counts(cfg)
    mine = whole.per_rank(tp, 1)
    room = (gpu_memory_gb - CUDA_RUNTIME_GB) * 1e9
    share = global_batch // dp
    micro_batches = [b for b in range(share, 0, -1) if share % b == 0]
    rows = []
    print_fn(f"memory per GPU: {whole.total / 1e6:.1f}M parameters ({mine.total / 1e6:.1f}M per "
             f"rank at TP {tp}), {gpus} GPUs = TP {tp} × DP {dp}, "
             f"{'bf16' if bf16 else 'fp32'}, sequence {seq_length}"
             f"{', full-layer recompute' if recompute else ''}; room {room / 1e9:.1f} GB of "
             f"{gpu_memory_gb:g} (CUDA context and NCCL ~{CUDA_RUNTIME_GB:g} GB, allocator "
             f"slack {100 * ALLOCATOR_SLACK:.0f}% on top of the estimate)")
    for name, file in ZERO_CONFIGS:
        with open(DS_CONFIGS / file, encoding="utf-8") as f:
            zero = memory.ZeroSettings.from_ds_config(json.load(f))

        def at(b: int):
            layout = memory.RankLayout(tp=tp, dp=dp, zero=zero, bf16=bf16, micro_batch_size=b,
                                       seq_length=seq_length, recompute=recompute,
                                       device="cuda")
            return memory.estimate(cfg, mine, layout)

        fits = next((b for b in micro_batches
                     if at(b).device_bytes * (1 + ALLOCATOR_SLACK) <= room), None)
        est = at(fits or 1)
        rows.append((name, fits, share // fits if fits else None, est))
        parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in est.parts.items() if v >= 5e7)
        host = sum(est.host.values())
        if fits is None:
            verdict = f"does not fit even at micro-batch 1 ({est.device_bytes / 1e9:.1f} GB)"
        else:
            verdict = (f"micro-batch {fits:>3} × accumulation {share // fits:>3} × DP {dp} = "
                       f"global {global_batch}: {est.device_bytes / 1e9:5.1f} GB")
        print_fn(f"  {name:<17} {verdict} ({parts}"
                 f"{f'; host {host / 1e9:.1f} GB per rank' if host else ''})")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cfg = preset(args.preset)
    try:
        for assignment in args.set:
            apply_override(cfg, assignment)
        cfg.validate()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seq = args.seq_length or cfg.data.seq_length
    per_token = rtd_flops_per_token(cfg, seq_length=seq, vocab_size=args.vocab_size,
                                    mask_prob=args.mask_prob)
    global_batch = args.global_batch_size or cfg.train.global_batch_size
    tokens_per_step = args.tokens_per_step or global_batch * seq
    micro = args.micro_batch_size or cfg.train.micro_batch_size
    layout = None
    if args.nodes is not None:
        try:
            layout = batch_layout(args.nodes, args.gpus_per_node, args.tp, global_batch, micro)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    steps = args.steps or cfg.train.train_iters
    total_tokens = float(tokens_per_step) * steps
    total = per_token.total * total_tokens
    m = cfg.model
    masked_lm = cfg.rtd.objective is Objective.MLM
    models = (f"masked LM (rtd.objective=mlm) {m.discriminator.num_layers} × "
              f"{m.discriminator.hidden_size} (FFN {m.discriminator.ffn_hidden_size})"
              if masked_lm else
              f"generator {m.generator.num_layers} × {m.generator.hidden_size} "
              f"(FFN {m.generator.ffn_hidden_size}), discriminator {m.discriminator.num_layers} × "
              f"{m.discriminator.hidden_size} (FFN {m.discriminator.ffn_hidden_size})")
    print(f"{args.preset}: {models}, table width "
          f"{m.embedding_size}, vocab {args.vocab_size or m.vocab_size}, sequence {seq}, mask "
          f"{cfg.rtd.mask_prob if args.mask_prob is None else args.mask_prob:g}")
    dims = flops.dims_of(cfg, seq_length=seq)
    if dims.discriminator.gated or dims.discriminator.local_layers:
        print(f"modern block: {m.mlp_activation.value} FFN; sliding window {m.window_size} "
              f"({flops.attended_keys(seq, m.window_size):.1f} keys per query on average) in "
              f"{dims.generator.local_layers} of {m.generator.num_layers} generator and "
              f"{dims.discriminator.local_layers} of {m.discriminator.num_layers} "
              "discriminator layers")
    print("model FLOPs per token (forward + backward):")
    for f in fields(per_token):
        value, name = getattr(per_token, f.name), f.name
        if masked_lm:  # one encoder (in the generator's slot), no discriminator or RTD head
            if name.startswith("discriminator") or name == "rtd_head":
                continue
            name = name.replace("generator", "encoder")
        print(f"  {name:<24} {value:12.4e}  {100 * value / per_token.total:5.1f}%")
    print(f"  {'total':<24} {per_token.total:12.4e}")
    print(f"per step:  {tokens_per_step:,} tokens × {per_token.total:.4e} = "
          f"{per_token.total * tokens_per_step:.4e} FLOPs")
    print(f"regime:    {steps:,} steps, {total_tokens:.4e} tokens, {total:.4e} FLOPs")
    if not masked_lm:
        mlm = masked_lm_flops_per_token(cfg, seq_length=seq, vocab_size=args.vocab_size,
                                        mask_prob=args.mask_prob)
        print(f"equal compute: the masked-LM control (--set rtd.objective=mlm, "
              f"{mlm.total:.4e} FLOPs per token) takes {steps * per_token.total / mlm.total:,.0f} "
              f"steps of {tokens_per_step:,} tokens for these {total:.4e} FLOPs")
    if layout is not None:
        world, dp, gas = layout
        print(f"layout:    {args.nodes} node(s) × {args.gpus_per_node} GPUs = {world} ranks = "
              f"TP {args.tp} × DP {dp}")
        print(f"batch:     micro-batch {micro} × accumulation {gas} × data-parallel {dp} = "
              f"global {global_batch} (TP {args.tp})")
    if args.tokens_per_s is not None or args.mfu is not None:
        gpu_h, wall_h = gpu_hours(total, total_tokens, tokens_per_s=args.tokens_per_s,
                                  gpus=args.gpus, mfu=args.mfu, peak_tflops=args.peak_tflops)
        line = f"cost:      {gpu_h:,.0f} GPU-hours"
        if wall_h is not None:
            line += f" = {wall_h:,.1f} h ({wall_h / 24:.1f} days) on {args.gpus} GPUs"
        if args.tokens_per_s is not None:
            implied = total / (gpu_h * 3600.0) / 1e12
            line += f"; implies {implied:.0f} model TFLOPs per GPU"
        print(line)
    if args.memory:
        if args.gpus % args.tp or global_batch % (args.gpus // args.tp):
            print(f"error: global batch {global_batch} does not divide over DP "
                  f"{args.gpus // args.tp} (--gpus {args.gpus} / --tp {args.tp}); change "
                  "--global-batch-size or --gpus", file=sys.stderr)
            return 2
        if args.vocab_size:
            cfg.model.vocab_size = args.vocab_size
        memory_plan(cfg, gpus=args.gpus, gpu_memory_gb=args.gpu_memory, tp=args.tp,
                    global_batch=global_batch, seq_length=seq, bf16=args.precision == "bf16",
                    recompute=args.recompute_activations)
    return 0


if __name__ == "__main__":
    sys.exit(main())
