#!/usr/bin/env python
"""A large preset through the user's whole path at its real shapes, on this machine's 2 ranks:

    python bench/rehearse.py debertav3-large --data-path data/sample/wiki_text_document \\
        --tokenizer-model data/sample/spm.model

1. train 2 steps at sequence 512, micro-batch 1, global batch 2, the sample tokenizer padded to
   the preset's real table (``--make-vocab-size-divisible-by`` the preset's padded vocabulary:
   128,128 rows for DeBERTaV3, 30,592 for ELECTRA, 50,432 for ModernBERT), ``--save``;
2. ``--load`` it at another layout (ZeRO stage or offload on 2 ranks, or, where no second
   layout fits 2 ranks, one rank) and train a third step;
3. ``tools/export_hf.py`` the checkpoint;
4. load the export with transformers (``AutoModel.from_pretrained``).

The layouts are the two cheapest of ``LAYOUTS`` whose estimate (rtd_scale/memory.py, the function
pretrain.py prints at start) for 2 ranks fits the memory the machine has available now, less
``--reserve-gb`` for others; when only one fits 2 ranks, the resume takes the cheapest that fits
one rank. Prints one table row: preset, layouts, estimated and measured peak
per rank (the largest rank's resident size), s/step, checkpoint and export sizes, the load.
Every command and its output go to ``--log-dir``.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (name, ds_config, extra flags): bf16 with full-layer recompute, the cheapest on the CPU
LAYOUTS = (
    ("ZeRO-3 bf16 recompute", "ds_configs/zero3.json", ["--bf16", "--recompute-activations"]),
    ("ZeRO-3 + offload bf16 recompute", "ds_configs/zero3_offload.json",
     ["--bf16", "--recompute-activations"]),
    ("ZeRO-2 bf16 recompute", "ds_configs/zero2.json", ["--bf16", "--recompute-activations"]),
    ("ZeRO-1 bf16 recompute", "ds_configs/zero1.json", ["--bf16", "--recompute-activations"]),
    # each rank half of every matrix and table (TP 2 × DP 1: ZeRO has one rank to shard over)
    ("TP 2 ZeRO-1 bf16 recompute", "ds_configs/zero1.json",
     ["--bf16", "--recompute-activations", "--tensor-model-parallel-size", "2"]),
    ("TP 2 ZeRO-3 + offload bf16 recompute", "ds_configs/zero3_offload.json",
     ["--bf16", "--recompute-activations", "--tensor-model-parallel-size", "2"]),
    # each rank one pipeline stage (DP 1): half the layers, the tables on the first
    ("PP 2 ZeRO-1 bf16 recompute", "ds_configs/zero1.json",
     ["--bf16", "--recompute-activations", "--pipeline-model-parallel-size", "2"]),
)
PEAK = re.compile(r"memory per rank: peak ([0-9.]+) GB")
ESTIMATE = re.compile(r"memory per rank: estimate ([0-9.]+) GB")
STEP_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
# the resume's conversion to the layout-free state (rtd_scale/resume.py's line)
CONVERTED = re.compile(r"in ([0-9.]+) s, \d+ process(?:es)? [^,]+, the largest ([0-9.]+) GB "
                       r"resident at its peak")


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def estimate_gb(cfg, ds_file: str, flags: list[str], runtime_gb: float, ranks: int = 2) -> float:
    """One rank's estimate (GB) at ``ranks`` ranks, micro-batch 1, sequence 512, with
    ``flags``."""
    import json

    from rtd_scale import memory

    cfg.train.precision = type(cfg.train.precision)("bf16" if "--bf16" in flags else "fp32")
    cfg.model.recompute_activations = "--recompute-activations" in flags
    cfg.train.micro_batch_size, cfg.data.seq_length = 1, 512
    with open(REPO / ds_file) as f:
        ds = json.load(f)
    counts = memory.config_parameter_counts(cfg)  # the whole model
    pp = 2 if "--pipeline-model-parallel-size" in flags else 1
    tp = 2 if "--tensor-model-parallel-size" in flags else 1
    if ranks < tp * pp:
        return float("inf")
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.parallel.tensor_model_parallel_size = tp
    # the largest rank's share: half of every matrix and table at TP 2; the first pipeline
    # stage's tables and half the layers at PP 2
    counts = counts.per_rank(tp, pp)
    est = memory.estimate(cfg, counts, memory.layout_of(cfg, ds, dp=ranks // (tp * pp),
                                                        device="cpu"),
                          runtime_bytes=runtime_gb * 1e9)
    return est.total / 1e9


def table_flags(rows: int, flags: list[str]) -> list[str]:
    """``--make-vocab-size-divisible-by`` giving the preset's real table of ``rows`` at the
    layout of ``flags``: Megatron-LM pads to a multiple of the flag × TP, so at TP 2 the flag is
    half the rows (the whole of it there doubled the table: 256,256 rows for DeBERTaV3)."""
    tp = 2 if "--tensor-model-parallel-size" in flags else 1
    if rows % tp:
        raise ValueError(f"{rows} rows do not split over TP {tp}")
    return ["--make-vocab-size-divisible-by", str(rows // tp)]


def run(cmd: list[str], log: Path) -> tuple[int, str, float]:
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    return rc, log.read_text(), time.perf_counter() - start


def size_gb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset", choices=("debertav3-large", "electra-large", "modernbert-large",
                                      "debertav3-base", "electra-base", "modernbert-base"))
    p.add_argument("--data-path", default="data/sample/wiki_text_document")
    p.add_argument("--tokenizer-model", default="data/sample/spm.model")
    p.add_argument("--log-dir", default="runs/rehearse")
    p.add_argument("--reserve-gb", type=float, default=5.0,
                   help="memory left to the rest of the machine")
    p.add_argument("--runtime-gb", type=float, default=0.55,
                   help="one rank's process memory before the model (measured: 0.51 GB)")
    p.add_argument("--port", type=int, default=29900)
    p.add_argument("--num-workers", type=int, default=None,
                   help="pretrain.py's --num-workers (default: the preset's)")
    args = p.parse_args(argv)

    import warnings

    warnings.filterwarnings("ignore")
    from rtd_scale.presets import preset

    cfg = preset(args.preset)
    rows = cfg.model.padded_vocab_size(1)  # the real table's rows
    room = available_gb() - args.reserve_gb
    fits = []
    for name, ds_file, flags in LAYOUTS:
        est = estimate_gb(preset(args.preset), ds_file, flags, args.runtime_gb)
        print(f"{name}: estimate {est:.2f} GB per rank, {2 * est:.2f} GB for 2 ranks "
              f"(room {room:.1f} GB)", flush=True)
        if 2 * est <= room:
            fits.append((name, ds_file, flags, est))
    fits.sort(key=lambda f: f[3])  # the two cheapest that fit
    load_ranks = 2
    if len(fits) == 1:  # the resume on one rank (another layout: DP 2 → 1), the cheapest
        one = sorted(((name, ds_file, flags,
                       estimate_gb(preset(args.preset), ds_file, flags, args.runtime_gb, 1))
                      for name, ds_file, flags in LAYOUTS), key=lambda f: f[3])
        print(f"one rank: {', '.join(f'{f[0]} {f[3]:.2f} GB' for f in one)}", flush=True)
        if one[0][3] <= room:
            fits.append((f"{one[0][0]}, 1 rank", *one[0][1:]))
            load_ranks = 1
    if len(fits) < 2:
        print(f"error: fewer than two layouts fit in {room:.1f} GB now; free memory or lower "
              "--reserve-gb", file=sys.stderr)
        return 2
    (train_name, train_ds, train_flags, train_est), (load_name, load_ds, load_flags, load_est) \
        = fits[:2]
    out = Path(args.log_dir) / args.preset
    out.mkdir(parents=True, exist_ok=True)
    save = out / "run"
    ds_bin = str(Path(sys.executable).parent / "deepspeed")
    common = ["rtd_scale/pretrain.py", "--preset", args.preset, "--data-path", args.data_path,
              "--tokenizer-model", args.tokenizer_model, "--seq-length", "512",
              "--micro-batch-size", "1", "--global-batch-size", "2", "--eval-iters", "0",
              *(["--num-workers", str(args.num_workers)] if args.num_workers is not None else []),
              "--log-interval", "1", "--save", str(save), "--save-interval", "2"]
    result = {"preset": args.preset, "layout": f"{train_name} → {load_name}"}
    rc, text, _ = run([ds_bin, "--num_gpus", "2", "--master_port", str(args.port), *common,
                       "--ds_config", train_ds, *train_flags, *table_flags(rows, train_flags),
                       "--train-iters", "2"],
                      out / "train.log")
    steps = [float(m) / 1000 for m in STEP_MS.findall(text)]
    result.update(train_rc=rc, train_peak=_last(PEAK, text), train_estimate=_last(ESTIMATE, text),
                  s_step=steps[-1] if steps else None,
                  checkpoint_gb=size_gb(save / "global_step2") if (save / "global_step2").is_dir()
                  else None)
    if rc == 0:
        rc, text, _ = run([ds_bin, "--num_gpus", str(load_ranks), "--master_port",
                           str(args.port + 1),
                           *common, "--ds_config", load_ds, *load_flags,
                           # the checkpoint's own flag: --load refuses another (a model
                           # setting), so a resume at TP 1 after TP 2 has half the rows
                           *table_flags(rows, train_flags), "--load", str(save),
                           "--train-iters", "3"], out / "resume.log")
        conversion = CONVERTED.findall(text)
        result.update(resume_rc=rc, resume_peak=_last(PEAK, text),
                      resume_estimate=_last(ESTIMATE, text),
                      resumed="resumed from" in text,
                      conversion_s=float(conversion[-1][0]) if conversion else None,
                      conversion_peak=float(conversion[-1][1]) if conversion else None)
    export = out / "hf"
    if rc == 0:
        rc, text, _ = run([sys.executable, "tools/export_hf.py", "--load", str(save), "--output",
                           str(export), "--overwrite"], out / "export.log")
        result.update(export_rc=rc, export_gb=size_gb(export) if export.is_dir() else None)
    if rc == 0:
        rc, text, _ = run([sys.executable, "-c",
                           "import sys; from transformers import AutoModel; "
                           "m = AutoModel.from_pretrained(sys.argv[1]); "
                           "print('loaded', type(m).__name__, "
                           "sum(p.numel() for p in m.parameters()))", str(export)],
                          out / "load.log")
        result.update(load=text.strip().splitlines()[-1] if rc == 0 else f"failed rc {rc}")
    print(result, flush=True)

    def gb(v):
        return f"{v:.2f}" if isinstance(v, float) else "—"

    print("| preset | layout (train → resume) | estimate GB per rank | peak GB per rank "
          "(train, resume) | conversion s, peak GB per process | s/step | checkpoint GB | "
          "export GB | transformers |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.preset} | {result['layout']} | {gb(result.get('train_estimate'))}, "
          f"{gb(result.get('resume_estimate'))} | {gb(result.get('train_peak'))}, "
          f"{gb(result.get('resume_peak'))} | {gb(result.get('conversion_s'))}, "
          f"{gb(result.get('conversion_peak'))} | {gb(result.get('s_step'))} | "
          f"{gb(result.get('checkpoint_gb'))} | {gb(result.get('export_gb'))} | "
          f"{result.get('load', 'not reached')} |")
    return 0 if rc == 0 else 1


def _last(pattern: re.Pattern, text: str):
    found = pattern.findall(text)
    return float(found[-1]) if found else None


if __name__ == "__main__":
    sys.exit(main())
