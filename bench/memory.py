#!/usr/bin/env python
"""Memory per rank: rtd_scale/memory.py's estimate beside each rank's measured peak, one cell
per (preset, ds_config, precision), each the user's command through the real launcher:

    deepspeed --num_gpus 2 rtd_scale/pretrain.py --ds_config ds_configs/zeroN.json --preset P \\
        --data-path D --tokenizer-model T --seq-length 512 --micro-batch-size 1 \\
        --global-batch-size 2 --make-vocab-size-divisible-by 128128 --train-iters 1 [--bf16]

(the sample tokenizer's vocabulary padded to DeBERTaV3's 128,128-row table). The estimate is
pretrain.py's ``memory per rank:`` line; the peak is its summary's (the largest rank's peak
resident size on the CPU, ``max_memory_allocated`` on a GPU). Prints one table row per cell:
estimate, peak, their ratio, s/step.

    python bench/memory.py --data-path data/sample/wiki_text_document \\
        --tokenizer-model data/sample/spm.model --presets electra-base debertav3-base \\
        modernbert-base --configs zero0 zero1 zero2 zero3 zero3_offload --precisions fp32 bf16

A base model's cell takes 8–14 GB per rank on the CPU: check ``free -g`` first.

``--saved``: instead, what autograd keeps for the backward pass of one micro-batch, per layer
and per s·b·h, for each attention family (one process, no DeepSpeed): the counts behind
memory.py's ``C_HIDDEN`` / ``C_FFN`` (two depths and two lengths, so that what a layer keeps is
told apart from what the embeddings and heads keep and from what does not grow with s).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ESTIMATE = re.compile(r"memory per rank: estimate ([0-9.]+) GB")
PEAK = re.compile(r"memory per rank: peak ([0-9.]+) GB")
STEP_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def run_cell(preset: str, config: str, precision: str, args, port: int) -> dict:
    """One launch; returns its estimate, peak (GB) and s/step, or its error's last line."""
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(args.ranks),
           "--master_port", str(port), "rtd_scale/pretrain.py",
           "--ds_config", f"ds_configs/{config}.json", "--preset", preset,
           "--data-path", args.data_path, "--tokenizer-model", args.tokenizer_model,
           "--seq-length", str(args.seq_length), "--micro-batch-size", "1",
           "--global-batch-size", str(args.ranks), "--make-vocab-size-divisible-by",
           str(args.vocab_multiple), "--train-iters", str(args.steps), "--eval-iters", "0",
           "--log-interval", "1", *(["--bf16"] if precision == "bf16" else [])]
    log = Path(args.log_dir) / f"{preset}_{config}_{precision}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    text = log.read_text()
    est, peak = ESTIMATE.search(text), PEAK.search(text)
    steps = [float(m) for m in STEP_MS.findall(text)]
    out = {"rc": rc, "log": str(log), "wall_s": time.perf_counter() - start,
           "estimate": float(est.group(1)) if est else None,
           "peak": float(peak.group(1)) if peak else None,
           "s_step": steps[-1] / 1000 if steps else None}
    if rc != 0:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        out["error"] = lines[-1][:160] if lines else "no output"
    return out


def table(args) -> int:
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    print(f"| preset | ds_config | precision | estimate GB | peak GB | peak / estimate | s/step |")
    print("|---|---|---|---|---|---|---|")
    port = args.port
    for preset in args.presets:
        for config in args.configs:
            for precision in args.precisions:
                r = run_cell(preset, config, precision, args, port)
                port += 1
                if r.get("peak") is None or r.get("estimate") is None:
                    print(f"| {preset} | {config} | {precision} | "
                          f"{r.get('estimate') or '—'} | failed (rc {r['rc']}: "
                          f"{r.get('error', '')}) | | |", flush=True)
                    continue
                print(f"| {preset} | {config} | {precision} | {r['estimate']:.2f} | "
                      f"{r['peak']:.2f} | {r['peak'] / r['estimate']:.2f} | "
                      f"{r['s_step']:.1f} |", flush=True)
    return 0


def saved(args) -> int:
    """What autograd keeps, per layer and per s·b·h, for each attention family (fp32, b 1)."""
    sys.path.insert(0, str(REPO))
    import dataclasses

    import torch

    from bench.common import world_one
    from rtd_scale import distributed
    from rtd_scale.model.build import build_model
    from rtd_scale.presets import preset

    ctx = world_one()

    class Ids:
        special_ids, pad_id, mask_id = (0, 1, 2, 3, 4), 0, 4

    def kept(cfg, s: int) -> float:
        model = build_model(cfg, ctx, Ids())
        distributed.seed_after_build(ctx, 1)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        ids = torch.randint(5, 900, (1, s))
        ids[:, 0], ids[:, -1] = 1, 2
        storages: dict[int, int] = {}

        def pack(t):
            st = t.untyped_storage()
            if st.data_ptr() not in params:
                storages[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, torch.arange(1), has_padding=False)
        return float(sum(storages.values()))

    h, heads = args.hidden, args.heads
    print("| family | FFN / h | layer bytes per s·b·h (s 256 → 512) | outside the layers, MB at s 512 |")
    print("|---|---|---|---|")
    for name, family in (("tiny", "bert"), ("debertav3-tiny", "disentangled"),
                         ("modernbert-tiny", "rotary")):
        for ffn in (4, 2):
            got = {}
            for layers in (1, 2):
                for s in (256, 512):
                    cfg = preset(name)
                    cfg.model.vocab_size, cfg.model.embedding_size = 1024, h
                    cfg.model.max_position_embeddings = 512
                    if family == "rotary":
                        cfg.model.window_size = 128
                    for attr in ("generator", "discriminator"):
                        setattr(cfg.model, attr, dataclasses.replace(
                            getattr(cfg.model, attr), num_layers=layers, hidden_size=h,
                            num_attention_heads=heads, ffn_hidden_size=ffn * h))
                    got[layers, s] = kept(cfg, s)
            per_layer = {s: (got[2, s] - got[1, s]) / 2 for s in (256, 512)}
            slope = (per_layer[512] - per_layer[256]) / (256 * h)
            outside = got[1, 512] - 2 * per_layer[512]
            print(f"| {family} | {ffn} | {slope:.0f} | {outside / 1e6:.1f} |", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", default="data/sample/wiki_text_document")
    p.add_argument("--tokenizer-model", default="data/sample/spm.model")
    p.add_argument("--presets", nargs="+", default=["electra-base", "debertav3-base",
                                                    "modernbert-base"])
    p.add_argument("--configs", nargs="+",
                   default=["zero0", "zero1", "zero2", "zero3", "zero3_offload"])
    p.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"),
                   default=["fp32", "bf16"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--vocab-multiple", type=int, default=128128)
    p.add_argument("--port", type=int, default=29800)
    p.add_argument("--log-dir", default="runs/bench_memory")
    p.add_argument("--saved", action="store_true",
                   help="count what autograd keeps per layer instead (one process)")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return saved(args) if args.saved else table(args)


if __name__ == "__main__":
    sys.exit(main())
