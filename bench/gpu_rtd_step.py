#!/usr/bin/env python
"""One RTD training step on one GPU: Hugging Face transformers as users write it vs rtd_scale.

In one run (≤ 8 minutes on one H200) this prints, side by side:

1. the bf16 matmul ceiling (8192³ ``torch.mm`` timed with CUDA events), the MFU denominator;
2. per workload (ELECTRA-large, ELECTRA-base, DeBERTaV3-large dimensions): the RTD step written
   the way a transformers user writes it (generator ``*ForMaskedLM`` + discriminator sharing the
   generator's token table, 15% masking, sampling from the softmax, λ = 50, fused AdamW, bf16
   autocast), also under ``torch.compile`` for ELECTRA-large, and rtd_scale's step — the
   product's own ``training/step.py::train_step`` on the ``RTDModel`` of
   ``model/build.py::build_model`` in a DeepSpeed engine with bf16 weights and fp32 master
   weights, as ``pretrain.py --bf16`` runs it, at ZeRO-1 and for ELECTRA-large also at ZeRO-0;
   and the same model under plain autocast + fused AdamW without DeepSpeed, which isolates the
   engine's cost);
3. the 24 × 1024 layer stack alone: HF ``ElectraEncoder`` (SDPA) vs rtd_scale's megatron-core
   layer spec (forward + backward, bf16 weights);
4. where the time goes: a torch.profiler summary by kernel family for rtd_scale's and HF's
   ELECTRA-large steps and for both stacks, the forward / backward / optimizer split, the
   operations of rtd_scale's step that synchronise the host, and the sampler's and masking's
   own cost.

With ``--cores`` (``bench/device_check.sh``'s kernel table) rtd_scale's row is run once per
attention core its workload has (``gpu/workloads.py`` ``CORES``; ``--workloads`` may add
ModernBERT-base at 1,024 tokens against HF's ModernBert), HF compiled once per workload, and the
best row again with its phase split and kernel families.

One table: workload, implementation, micro-batch, tokens/s, TFLOP/s, MFU (of the measured
ceiling, and of 989 dense bf16 TFLOP/s), peak memory, target. FLOPs: ``rtd_scale/flops.py`` (formula in bench/README.md).
Warm-up steps are excluded; timed steps run back to back and the host waits for the device
only at measurement boundaries. Each row has a time budget, the whole run a deadline (rows that
no longer fit are reported as skipped), and an out-of-memory error or any other failure of a
row is reported in the table instead of ending the run. ``torch.compile`` runs in a child
process so that a slow compilation can be cut off at the deadline.

    python bench/gpu_rtd_step.py                      # on the GPU machine (bench/README.md)
    python bench/gpu_rtd_step.py --device cpu --tiny  # the same code paths, tiny, on CPU
    python bench/gpu_rtd_step.py --print-setup        # how to build and carry the wheels

This file is the command (flags, the run, the report); what it times lives in ``bench/gpu/``
(``bench/gpu/__init__.py`` lists the modules).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import common  # noqa: E402
from bench.gpu.report import (SETUP, diagnostics_text, header, profile_table,  # noqa: E402
                              results_table)
from bench.gpu.run import Bench, Item, plan  # noqa: E402
from bench.gpu.timing import matmul_ceiling  # noqa: E402
from bench.gpu.workloads import (CORES, DEFAULT_WORKLOADS, IMPL_TITLES, WORKLOADS,  # noqa: E402
                                 Settings)


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


def best_row(bench: Bench):
    """rtd_scale's engine row with the highest MFU, or None."""
    ok = [r for r in bench.rows if r.impl == "rtd-engine" and r.status == "ok" and r.mfu_peak]
    return max(ok, key=lambda r: r.mfu_peak) if ok else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--tiny", action="store_true",
                   help="tiny sizes (hidden 64, seq 64, 2 timed steps): the CPU smoke run")
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help=f"comma-separated subset of {', '.join(WORKLOADS)} (default: "
                        f"{', '.join(DEFAULT_WORKLOADS)})")
    every = sorted({c for cs in CORES.values() for c in cs})
    p.add_argument("--cores", default="",
                   help=f"comma-separated attention cores of {', '.join(every)}: rtd_scale's "
                        "row once per core its workload's attention has, HF compiled for "
                        "every workload, and the best row's phase split (bench/README.md)")
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
    args = p.parse_args(argv)
    unknown = set(filter(None, args.workloads.split(","))) - set(WORKLOADS)
    if unknown:
        p.error(f"--workloads: unknown {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    args.cores = tuple(c for c in args.cores.split(",") if c)
    if set(args.cores) - set(every):
        p.error(f"--cores: unknown {sorted(set(args.cores) - set(every))}; choose from "
                f"{', '.join(every)}")
    parts = {"stack", "profile", "extras", "rtd-compile", "hf-compile"}
    bad = set(filter(None, args.skip.split(","))) - parts
    if bad:
        p.error(f"--skip: unknown {sorted(bad)}; choose from {', '.join(sorted(parts))}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.print_setup:
        print(SETUP, end="")
        return 0
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    s = settings_from(args)
    bench = Bench(s)
    print(header(s), flush=True)
    bench.ceiling = matmul_ceiling(s)
    print(f"bf16 matmul ceiling ({s.matmul_size}^3 torch.mm): {bench.ceiling / 1e12:.1f} TFLOP/s",
          flush=True)
    workloads = [w for w in args.workloads.split(",") if w]
    for item in plan(s, workloads, set(filter(None, args.skip.split(","))), args.cores):
        bench.run(item)
        sys.stdout.flush()
    best = best_row(bench) if args.cores else None
    if best is not None and bench.left() > 40:
        # the fastest of rtd_scale's rows again, with the phase split and kernel families
        item = Item(best.workload, best.impl, frozenset({"families", "phases"}),
                    core=best.core, min_left_s=0.0)
        bench.log(f"-- best step (MFU {100 * best.mfu_peak:.1f}% of 989): profiling it")
        again = bench.run(item)
        bench.rows.remove(again)
        if again.status == "ok":
            bench.best = (again, f"{again.workload}|{again.impl}")
    common.teardown_world()
    order = list(IMPL_TITLES)

    def ours_first(k: str):
        return (0 if "|rtd" in k or "mcore" in k else 1, order.index(k.split("|")[1]))

    large = sorted([k for k in bench.profiles if k.startswith("electra-large")], key=ours_first)
    best = getattr(bench, "best", None)
    best_phases = ""
    if best is not None:
        row, key = best
        phases = bench.phases.get(f"{row.workload} / {row.title}", {})
        best_phases = (f"== The best step: {row.workload} / {row.title}, "
                       f"{row.tokens_per_s / 1e3:.1f}k tokens/s, MFU {100 * row.mfu_peak:.1f}% "
                       f"of 989 TFLOP/s ==\nphases (ms): " + ", ".join(
                           f"{k} {v:.1f}" for k, v in phases.items()) + "\n"
                       + profile_table(bench, [key]))
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
        best_phases,
    ]))
    print("\n" + report, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "ceiling_flops_per_s": bench.ceiling,
            "rows": [dataclasses.asdict(r) for r in bench.rows],
            "profiles": {k: dataclasses.asdict(v) for k, v in bench.profiles.items()},
            "phases_ms": bench.phases, "host_syncs": bench.syncs,
            "best": None if best is None else dataclasses.asdict(best[0]),
            "objective_pieces": bench.samplers,
            "settings": {k: str(v) for k, v in dataclasses.asdict(s).items()},
            "report": report,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
