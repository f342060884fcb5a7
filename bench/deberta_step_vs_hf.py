#!/usr/bin/env python
"""One DeBERTaV3 RTD training step, rtd_scale vs a Hugging Face ``DebertaV2`` recipe, in one
process on the same batches.

What is timed is the whole step — generator and discriminator forward, backward and AdamW — for:

- **rtd_scale**: ``RTDModel`` with disentangled attention (``model/disentangled.py``), once per
  attention core in ``--impls``: "explicit" (scores [b, n, s, s] = c2c + c2p + p2c, softmax,
  @ V; c2p and p2c gathered, or with ``--relative-terms shift`` skewed into place from one
  matmul per distance) and "sdpa" (the same c2p + p2c as one float bias given to PyTorch's
  ``scaled_dot_product_attention``; on GPU its memory-efficient kernel, which takes a bias with
  gradient), and "flex" (one FlexAttention kernel reading the c2p / p2c tables in a score
  modification, ``model/disentangled_flex.py``; CUDA only, timed without attention dropout,
  which it lacks), and "flash" (flashdeberta's Triton kernels, ``model/disentangled_flash.py``;
  CUDA only, without attention dropout, which it lacks too).
- **HF**: the RTD step as a ``transformers`` user writes it with DeBERTaV3's classes (eager
  attention, the only one ``DebertaV2`` has): ``DebertaV2ForMaskedLM`` generator
  (``labels=-100`` outside the masked slots), ``DebertaV2Model`` discriminator with ELECTRA's
  discriminator head (dense → GELU → 1 logit, BCE), GDES as a token lookup of
  ``E_G.detach() + E_Δ`` (``bench.common.share_hf_embeddings``); configs from rtd_scale's export
  (``rtd_scale.hf.convert.hf_config``), so both sides have the same shapes and dropout.

Timing is ``bench/step_vs_hf.py``'s (``bench.common.interleaved_ms``): interleaved rounds,
per-step wall and thread-CPU times, medians. CPU: fp32, one thread by default. ``--bf16``
(CUDA): the HF recipe under autocast; rtd_scale as ``pretrain.py --bf16`` trains it under
DeepSpeed — bf16 parameters, fp32 master weights, no autocast (``bench.common.BF16Master``) —
or also under autocast (``--ours-bf16``).
Prints one table (ms per step, tokens/s, ratio to HF); nothing here asserts a time.

    python bench/deberta_step_vs_hf.py                      # debertav3-xsmall dims, CPU
    python bench/deberta_step_vs_hf.py --dims large --device cuda --bf16 --batch 16 --seq 512
    python bench/deberta_step_vs_hf.py --tiny --device cpu  # seconds (tests/tools/test_bench_deberta.py)
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


from bench import common  # noqa: E402


def run_config(dims: str, *, batch: int, seq: int, tiny: bool):
    """rtd_scale's config of preset ``debertav3-{dims}`` (disentangled attention, post-LN,
    GDES) at this micro-batch and length; ``tiny``: test size (hidden 32, 2 / 1 layers,
    vocab 1000, 16 position buckets so the log buckets are reached)."""
    from rtd_scale.config import AttentionType

    cfg = common.run_config(f"debertav3-{dims}", micro_batch=batch, seq_length=seq, tiny=tiny)
    cfg.model.attention_type = AttentionType.DISENTANGLED  # the preset's (run_config: BERT)
    if tiny:
        cfg.model.position_buckets = 16
    cfg.validate()
    return cfg


def ours(cfg, device: torch.device, impl: str, bf16_params: bool = False,
         relative_terms: str = "gather", bf16: bool = False):
    """rtd_scale's step (``bench.common.ours``) with attention core ``impl`` building c2p / p2c
    by ``relative_terms``; ``bf16_params``: bf16 parameters and fp32 master weights, as
    ``pretrain.py --bf16`` trains; otherwise under bf16 autocast with ``bf16`` (on CPU too,
    with ``--tiny``, so that the path is tested), fp32 without."""
    from rtd_scale.model.disentangled import DisentangledCoreAttention

    autocast = ((lambda d: torch.autocast(d.type, dtype=torch.bfloat16)) if bf16
                else (lambda _device: contextlib.nullcontext()))
    step = common.ours(cfg, device, bf16_params=bf16_params, autocast=autocast)
    cores = [m for m in step.model.modules() if isinstance(m, DisentangledCoreAttention)]
    assert cores, "no disentangled attention in the model"
    for core in cores:
        core.impl, core.relative_terms = impl, relative_terms
        if impl in ("flex", "flash"):  # neither kernel has attention-probability dropout
            core.dropout_p = 0.0
    return step


def hf(cfg, device: torch.device, bf16: bool):
    """The Hugging Face DebertaV2 recipe (module docstring; the models: ``common.hf_deberta``),
    with rtd_scale's AdamW."""
    from rtd_scale.training.optimizer import build_optimizer

    torch.manual_seed(common.SEED)
    pair = common.hf_deberta(cfg, device)
    pair.modules.train()
    opt = build_optimizer(pair.modules, cfg.optim)

    def autocast():
        return (torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                else torch.autocast(device.type, enabled=False))

    return common.Step(common.hf_rtd_run(cfg, device, pair.gen, pair.rtd_loss, opt, autocast),
                       None, opt)


def measure(args, device: torch.device) -> dict:
    cfg = run_config(args.dims, batch=args.batch, seq=args.seq, tiny=args.tiny)
    steps = {}
    for impl in args.impls:
        for terms in args.relative_terms if impl != "flex" else ["gather"]:
            name = f"ours:{impl}" + ("/shift" if terms == "shift" else "")
            if args.bf16 and args.ours_bf16 in ("params", "both"):
                steps[name] = ours(cfg, device, impl, True, terms, args.bf16)
            if not args.bf16 or args.ours_bf16 in ("autocast", "both"):
                steps[name + ("+autocast" if args.bf16 else "")] = ours(cfg, device, impl,
                                                                        False, terms, args.bf16)
    steps["hf"] = hf(cfg, device, args.bf16)
    times = common.interleaved_ms(steps, device, warmup=args.warmup, rounds=args.rounds,
                               steps_per_round=args.steps_per_round)
    tokens = args.batch * args.seq
    col = "cpu" if device.type == "cpu" else "wall"  # one CPU thread: its CPU time is the step
    rows = {}
    for name, t in times.items():
        ms = statistics.median(t[col])
        rows[name] = {"ms": ms, "tokens_per_s": tokens / ms * 1e3, "times_ms": t}
    for r in rows.values():
        r["ratio"] = r["ms"] / rows["hf"]["ms"]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"dims": f"debertav3-{args.dims}" + (" (tiny)" if args.tiny else ""),
            "device": device.type, "bf16": args.bf16, "batch": args.batch, "seq": args.seq,
            "timed": col, "rows": rows, "peak_gib": peak}


def table(res: dict) -> str:
    head = (f"{res['dims']}, {res['device']}{' bf16' if res['bf16'] else ' fp32'}, batch "
            f"{res['batch']} × seq {res['seq']}, median {res['timed']} time per step "
            "(generator + discriminator forward, backward, AdamW)")
    lines = [head, "| step | ms | tokens/s | ours/HF |", "|---|---|---|---|"]
    for name, r in res["rows"].items():
        lines.append(f"| {name} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['ratio']:.2f} |")
    if res["peak_gib"] is not None:
        lines.append(f"peak CUDA memory (all steps): {res['peak_gib']:.1f} GiB")
    return "\n".join(lines)


def parse_args(argv=None):
    from rtd_scale.cli_errors import OneLineArgumentParser

    p = OneLineArgumentParser(prog="bench/deberta_step_vs_hf.py",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default="xsmall", choices=("xsmall", "small", "base", "large"),
                   help="the debertav3-* preset whose dimensions both sides train")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--bf16", action="store_true",
                   help="bf16: HF under autocast (its recipe); ours as --ours-bf16 says")
    p.add_argument("--ours-bf16", choices=("params", "autocast", "both"), default="params",
                   help="with --bf16, how rtd_scale runs: 'params' = bf16 parameters and fp32 "
                        "master weights, as pretrain.py --bf16 trains under DeepSpeed (rows "
                        "ours:IMPL); 'autocast' = fp32 parameters under autocast, HF's way "
                        "(rows ours:IMPL+autocast); 'both': a row of each (default: params)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--impls", default="explicit,sdpa",
                   help="rtd_scale attention cores to time, comma-separated")
    p.add_argument("--relative-terms", default="gather",
                   help="how the explicit and sdpa cores build c2p / p2c, comma-separated: "
                        "gather (the default) and/or shift (rows ours:IMPL/shift); "
                        "rtd_scale/model/disentangled.py RELATIVE_TERMS")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="test-size models (seconds)")
    p.add_argument("--json", help="write the results (per-step times included) here")
    args = p.parse_args(argv)
    args.impls = [x for x in args.impls.split(",") if x]
    args.relative_terms = [x for x in args.relative_terms.split(",") if x]
    from rtd_scale.model.disentangled import IMPLEMENTATIONS, RELATIVE_TERMS

    for impl in args.impls:
        if impl not in IMPLEMENTATIONS:
            p.error(f"--impls: {impl!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    for terms in args.relative_terms:
        if terms not in RELATIVE_TERMS:
            p.error(f"--relative-terms: {terms!r} is not one of {', '.join(RELATIVE_TERMS)}")
    if "flex" in args.impls and args.device != "cuda":
        p.error("--impls flex needs --device cuda (FlexAttention has no backward on CPU); "
                "time explicit,sdpa on CPU")
    if "flash" in args.impls and args.device != "cuda":
        p.error("--impls flash needs --device cuda (flashdeberta's Triton kernels; on CPU "
                "only Triton's interpreter runs them, for the tests); time explicit,sdpa on CPU")
    if args.bf16 and args.device != "cuda" and not args.tiny:
        p.error("--bf16 is for --device cuda (on CPU both sides run fp32; --tiny allows it, "
                "to test the path)")
    if args.bf16 and args.device != "cuda" and args.ours_bf16 != "params":
        p.error(f"--ours-bf16 {args.ours_bf16} needs --device cuda (megatron-core's linear "
                "layers run their backward under autocast on CUDA only); use params on CPU")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    common.world_one()
    res = measure(args, device)
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
