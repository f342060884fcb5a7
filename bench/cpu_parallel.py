"""CPU table: the `tiny` preset through the real entry point at several parallel layouts.

Informational, never a test. For each layout it launches
`deepspeed --num_gpus N rtd_scale/pretrain.py --preset tiny ...` on shards of
tests/data/wiki_sample.jsonl (built once into --workdir), and reads the run's TensorBoard:
tokens/s (non-pad tokens per second over all ranks) and ms per optimizer step, both averaged
after the first --warmup steps.

Pipeline bubble, measured: 1 − (T_PP1 / PP) / T_PP, where T_PP1 is the step time of the same
global batch on one stage (one process) and T_PP the step time with PP stages — the share of the
pipelined step not explained by splitting the work PP ways (bubble plus point-to-point traffic).
The 1F1B schedule's ideal bubble (PP − 1) / (m + PP − 1) for m micro-batches is printed beside it.

    python bench/cpu_parallel.py [--steps 12] [--warmup 2] [--workdir /tmp/rtd_bench]
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.tiny_data import wiki_sample_data  # noqa: E402
from rtd_scale.launch_env import free_port  # noqa: E402


def run(layout: dict, data: tuple[str, str], workdir: Path, steps: int, warmup: int,
        port: int) -> dict:
    tok, prefix = data
    save = workdir / f"run_{layout['name']}"
    ranks = layout["tp"] * layout["pp"]
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(ranks),
           "--master_port", str(port), "rtd_scale/pretrain.py",
           "--ds_config", layout["ds_config"], "--preset", "tiny", "--data-path", prefix,
           "--tokenizer-model", tok, "--save", str(save), "--train-iters", str(steps),
           "--seq-length", "128", "--micro-batch-size", str(layout["mb"]),
           "--global-batch-size", str(layout["gb"]), "--log-interval", "1",
           "--save-interval", str(10 * steps),
           "--tensor-model-parallel-size", str(layout["tp"]),
           "--pipeline-model-parallel-size", str(layout["pp"])]
    subprocess.run(["rm", "-rf", str(save)], check=True)
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1][:80]}
    ms = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", r.stdout)]
    tps = [float(m) for m in re.findall(r"tokens/s: ([0-9.]+)", r.stdout)]
    return {"ms": sum(ms[warmup:]) / len(ms[warmup:]), "tokens_s": sum(tps[warmup:]) / len(tps[warmup:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/rtd_bench")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    data = wiki_sample_data(workdir, vocab_size=2000)
    layouts = [
        dict(name="tp1", tp=1, pp=1, mb=16, gb=16, ds_config="ds_configs/zero0.json"),
        dict(name="tp2", tp=2, pp=1, mb=16, gb=16, ds_config="ds_configs/zero0.json"),
        dict(name="pp1_m4", tp=1, pp=1, mb=4, gb=16, ds_config="ds_configs/zero1.json"),
        dict(name="pp2_m4", tp=1, pp=2, mb=4, gb=16, ds_config="ds_configs/zero1.json"),
        dict(name="pp1_m16", tp=1, pp=1, mb=1, gb=16, ds_config="ds_configs/zero1.json"),
        dict(name="pp2_m16", tp=1, pp=2, mb=1, gb=16, ds_config="ds_configs/zero1.json"),
    ]
    results = {}
    for lay in layouts:
        results[lay["name"]] = run(lay, data, workdir, args.steps, args.warmup, free_port())
    print(f"\ntiny preset, seq 128, global batch 16, {os.cpu_count()} CPU cores, gloo "
          f"({args.steps} steps, first {args.warmup} excluded)\n")
    print("| layout | ranks | micro-batches per step | ms / step | tokens/s | bubble (measured) "
          "| bubble (1F1B ideal) |")
    print("|---|---|---|---|---|---|---|")
    for lay in layouts:
        res = results[lay["name"]]
        m = lay["gb"] // lay["mb"]
        if "error" in res:
            print(f"| {lay['name']} | {lay['tp'] * lay['pp']} | {m} | error: {res['error']} | | | |")
            continue
        bubble = ideal = "—"
        if lay["pp"] > 1:
            base = results[f"pp1_m{m}"]
            if "ms" in base:
                bubble = f"{1 - (base['ms'] / lay['pp']) / res['ms']:.2f}"
            ideal = f"{(lay['pp'] - 1) / (m + lay['pp'] - 1):.2f}"
        print(f"| TP {lay['tp']} × PP {lay['pp']} | {lay['tp'] * lay['pp']} | {m} | "
              f"{res['ms']:.0f} | {res['tokens_s']:.0f} | {bubble} | {ideal} |")


if __name__ == "__main__":
    main()
