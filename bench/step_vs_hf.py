#!/usr/bin/env python
"""One RTD training step, rtd_scale vs the Hugging Face recipe, side by side in one process.

Both implementations train the same dimensions on the same batches (micro-batch 8 × 128 by
default) with the same AdamW, interleaved in one run (rounds alternate which goes first), one
thread on CPU by default, or on CUDA when present (``--device``):

- **HF recipe**, the RTD step as a ``transformers`` user writes it: ``ElectraForMaskedLM``
  generator (``labels=-100`` outside the masked slots, so the vocabulary projection runs at every
  position) and ``ElectraForPreTraining`` discriminator, its embedding layer tied to the
  generator's as rtd_scale ties its own (``bench.common.share_hf_embeddings``: under ES it holds
  the generator's embedding modules, under GDES its token and position lookups are
  ``embedding(ids, E.detach() + E_Δ)`` of the generator's tables); masking with ``torch.bernoulli``;
  replacements by Gumbel-max over the full vocabulary at the masked rows
  (``argmax(logits - log(-log(torch.rand)))``); ``L_MLM + 50 · L_RTD``.
- **rtd_scale**: ``RTDModel`` forward, backward, AdamW (``training.optimizer.build_optimizer``, the
  same optimizer the HF side gets) — the model's own step without DeepSpeed.

Dimensions are rtd_scale's presets (``electra-small``: vocab 30,522; ``debertav3-xsmall``: vocab
128,100, run by the HF side with ELECTRA's classes at those dimensions). CPU: fp32. CUDA: bf16
autocast on both sides, fused AdamW.

It prints one table: dims, rtd_scale ms, HF ms (medians of interleaved per-step times), the ratio
ours / HF, and where rtd_scale's step goes — a ``torch.profiler`` run of a few steps with named
ranges around the encoders, the MLM head + loss, the sampler, the masking, the discriminator head
and the optimizer, each backward op charged to the range of the forward op that created it
(autograd sequence numbers). Informational only: nothing here asserts a time.

    python bench/step_vs_hf.py                        # both dims, CPU (or CUDA when present)
    python bench/step_vs_hf.py --dims electra-small --rounds 7
    python bench/step_vs_hf.py --tiny                 # seconds; what tests/tools/test_bench_step.py runs
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import (SEED, Step, cuda_bf16_autocast, hf_electra,  # noqa: E402
                          hf_rtd_run, interleaved_ms, ours, run_config, sync)

DIMS = ("electra-small", "debertav3-xsmall")
# The profile's ranges, in the table's order; "other" is what no range holds (gradient
# accumulation into .grad, the loss sum, the batch copy).
PARTS = ("encoders", "mlm head + loss", "sampling", "masking", "discriminator head",
         "optimizer", "other")


# ----------------------------------------------------------------------------------------------
# The two steps (rtd_scale's: bench.common.ours)
# ----------------------------------------------------------------------------------------------

def hf(cfg, device: torch.device) -> Step:
    """The HF recipe (module docstring; the models: ``common.hf_electra``, masking, sampling and
    loss: ``common.hf_rtd_run``), with the same optimizer as rtd_scale's step."""
    from rtd_scale.training.optimizer import build_optimizer

    torch.manual_seed(SEED)
    pair = hf_electra(cfg, device)
    pair.modules.train()
    opt = build_optimizer(pair.modules, cfg.optim)
    run = hf_rtd_run(cfg, device, pair.gen, pair.rtd_loss, opt, lambda: cuda_bf16_autocast(device))
    return Step(run, None, opt)


# ----------------------------------------------------------------------------------------------
# Timing and profile
# ----------------------------------------------------------------------------------------------

class _Ranges:
    """Named ``record_function`` ranges around pieces of rtd_scale's step, for the profile.

    Module forwards get ranges through forward hooks; the masking, the sampler and the two heads
    are wrapped where ``RTDModel`` calls them (instance attributes and ``rtd_scale.model.rtd``'s
    imported names), and restored on exit.
    """

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.undo: list[Callable[[], None]] = []

    @staticmethod
    def _wrap(fn, name):
        def wrapped(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return wrapped

    def _attr(self, obj, attr, name):
        old = getattr(obj, attr)
        had = attr in vars(obj)
        setattr(obj, attr, self._wrap(old, name))
        self.undo.append(lambda: setattr(obj, attr, old) if had else delattr(obj, attr))

    def _module(self, module, name):
        stack = []

        def pre(_m, _args):
            rf = torch.profiler.record_function(name)
            rf.__enter__()
            stack.append(rf)

        def post(_m, _args, _out):
            stack.pop().__exit__(None, None, None)

        h1, h2 = module.register_forward_pre_hook(pre), module.register_forward_hook(post)
        self.undo += [h1.remove, h2.remove]

    def __enter__(self):
        m = self.model
        self._attr(m, "mask", "masking")
        self._module(m.generator, "encoders")
        self._module(m.discriminator, "encoders")
        self._attr(m, "generator_head", "mlm head + loss")
        if hasattr(m, "sampler"):
            self._module(m.sampler, "sampling")
        self._attr(m, "discriminator_head", "discriminator head")
        self._attr(self.optimizer, "step", "optimizer")
        self._attr(self.optimizer, "zero_grad", "optimizer")
        return self

    def __exit__(self, *exc):
        for undo in reversed(self.undo):
            undo()


def _part_of(event, seq_range: dict[int, str]) -> str:
    """The part an event's own time belongs to: its nearest enclosing named range, or for a
    backward op the range of the forward op that created it (``seq_range``: autograd sequence
    number -> range), else "other"."""
    e = event
    while e is not None:
        if e.name in PARTS:
            return e.name
        if e.name.startswith("autograd::engine::evaluate_function"):
            part = seq_range.get(e.sequence_nr, "other")
            return "other" if part == "optimizer" else part
        e = e.cpu_parent
    return "other"


def _in_backward(event) -> bool:
    """Whether an event runs inside the autograd engine (a backward op or its children)."""
    e = event
    while e is not None:
        if e.name.startswith("autograd::engine"):
            return True
        e = e.cpu_parent
    return False


def profile_split(step: Step, device: torch.device, *, start: int, steps: int) -> dict[str, float]:
    """Share of rtd_scale's step time per part (``PARTS``), from ``torch.profiler``.

    Every event's own (exclusive) time counts once: forward ops for the range they run in, a
    backward op ("autograd::engine::evaluate_function: ...") for the range of the forward op with
    the same autograd sequence number. Gradient accumulation and ops outside every range are
    "other". CPU: shares of CPU time; CUDA: shares of device (kernel) time.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _Ranges(step.model, step.optimizer):
        step.run(start)  # warm the wrappers
        sync(device)
        with profile(activities=acts) as prof:
            for k in range(steps):
                step.run(start + 1 + k)
            sync(device)
    events = list(prof.events())
    # An op records the sequence number the next autograd node will get; the op that creates
    # that node is the last one (in time) to record it, so later ops overwrite earlier ones.
    seq_range: dict[int, str] = {}
    for e in sorted(events, key=lambda e: e.time_range.start):
        if e.sequence_nr >= 0 and not _in_backward(e):
            seq_range[e.sequence_nr] = _part_of(e, {})
    total: dict[str, float] = defaultdict(float)
    for e in events:
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        if t > 0:
            total[_part_of(e, seq_range)] += t
    s = sum(total.values()) or 1.0
    return {p: total.get(p, 0.0) / s for p in PARTS}


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------

def measure(dims: str, args, device: torch.device) -> dict:
    cfg = run_config(dims, micro_batch=args.micro_batch, seq_length=args.seq_length,
                     tiny=args.tiny)
    steps = {"ours": ours(cfg, device), "hf": hf(cfg, device)}
    times = interleaved_ms(steps, device, warmup=args.warmup, rounds=args.rounds,
                           steps_per_round=args.steps_per_round)
    med = {k: {c: statistics.median(v[c]) for c in v} for k, v in times.items()}
    split = profile_split(steps["ours"], device, start=10_000, steps=args.profile_steps)
    m = cfg.model
    return {"dims": dims, "vocab": m.vocab_size, "micro_batch": args.micro_batch,
            "seq_length": args.seq_length, "ours_ms": med["ours"]["wall"],
            "hf_ms": med["hf"]["wall"], "ratio": med["ours"]["wall"] / med["hf"]["wall"],
            "ours_cpu_ms": med["ours"]["cpu"], "hf_cpu_ms": med["hf"]["cpu"],
            "cpu_ratio": med["ours"]["cpu"] / med["hf"]["cpu"],
            "split": split, "times_ms": times,
            "shape": f"D {m.discriminator.num_layers}x{m.discriminator.hidden_size}, "
                     f"G {m.generator.num_layers}x{m.generator.hidden_size}, "
                     f"E {m.embedding_size}, {m.sharing.value.upper()}"}


def table(results: list[dict], cpu_columns: bool) -> str:
    short = {"encoders": "enc", "mlm head + loss": "mlm", "sampling": "samp", "masking": "mask",
             "discriminator head": "disc", "optimizer": "opt", "other": "other"}
    head = ["dims", "vocab", "ours ms", "HF ms", "ours/HF"]
    head += ["ours CPU ms", "HF CPU ms", "CPU ours/HF"] if cpu_columns else []
    head += [short[p] + " %" for p in PARTS]
    rows = []
    for r in results:
        row = [r["dims"], f"{r['vocab']:,}", f"{r['ours_ms']:.0f}", f"{r['hf_ms']:.0f}",
               f"{r['ratio']:.2f}"]
        if cpu_columns:
            row += [f"{r['ours_cpu_ms']:.0f}", f"{r['hf_cpu_ms']:.0f}", f"{r['cpu_ratio']:.2f}"]
        rows.append(row + [f"{100 * r['split'][p]:.1f}" for p in PARTS])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dims", default=",".join(DIMS),
                   help=f"comma-separated presets (default {','.join(DIMS)})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    p.add_argument("--steps-per-round", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="test-size models (seconds)")
    p.add_argument("--json", help="write the results (per-step times included) here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.set_num_threads(args.threads)
    dims = [d.strip() for d in args.dims.split(",") if d.strip()]
    results = []
    for d in dims:
        results.append(measure(d, args, device))
        r = results[-1]
        print(f"{d}: ours {r['ours_ms']:.1f} ms, HF {r['hf_ms']:.1f} ms, ratio {r['ratio']:.2f} "
              f"(CPU time {r['cpu_ratio']:.2f}) ({r['shape']})", flush=True)
    print(f"\ndevice {device}, {torch.get_num_threads()} thread(s), micro-batch "
          f"{args.micro_batch} x {args.seq_length}, medians of {args.rounds} interleaved rounds "
          f"x {args.steps_per_round} steps; rtd_scale's profile split in % of its step")
    print(table(results, cpu_columns=device.type == "cpu"))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), "args": vars(args),
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
