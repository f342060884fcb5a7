"""The report: the results table, the kernel-family tables, the diagnostics and the header
(with how to build and carry the wheels, ``SETUP``)."""
from __future__ import annotations

import platform
from typing import TYPE_CHECKING

import torch

from bench.common import RTD_LAMBDA
from bench.gpu.census import FAMILIES
from bench.gpu.timing import Row, fmt_k
from bench.gpu.workloads import IMPL_TITLES, MASK_PROB, SHORT, WORKLOADS, Settings

if TYPE_CHECKING:
    from bench.gpu.run import Bench

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
            f"{100 * r.mfu_peak:.1f}%" if r.mfu_peak is not None else "-",
            f"{r.peak_mem_gib:.1f}" if r.peak_mem_gib is not None else "-",
            (f">= {fmt_k(r.target_tokens_per_s)}" + meets) if r.target_tokens_per_s else "-",
            vs, fmt_k(r.anchor_tokens_per_s),
        ])
    head = ["workload", "implementation", "micro-batch", "tokens/s", "TFLOP/s", "MFU",
            "MFU of 989", "peak GiB", "target (rtd_scale)", "vs HF", "H200 anchor"]
    out = table(head, lines, right={2, 3, 4, 5, 6, 7, 9, 10})
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
