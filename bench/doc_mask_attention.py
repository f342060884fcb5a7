"""The document-masked attention of the modern block: the explicit mask against FlexAttention.

One attention core at ModernBERT-base's heads (12 × 64), bf16 on CUDA, over packed samples of
documents (lengths drawn around ``--doc-len``), in a global layer and in a local one (a window of
``--window`` tokens, query i seeing |i − j| ≤ window / 2):

* ``explicit``: the CPU path, ``model/document_mask.attention_mask``'s [b, 1, s, s] bool with
  the window's [s, s] band, then SDPA (``model/attention.SDPACoreAttention``);
* ``flex``: the CUDA path, the compact [b, s] ids and ``document_mask.block_mask`` (tiles from
  document ranges), then compiled FlexAttention (``attention.flex_masked_attention``).

Per sequence length and layer kind: ms per forward + backward (forward only on CPU, where
FlexAttention has no backward), the peak memory above the inputs, the largest difference of the
outputs at real queries, and the share of 128 × 128 tiles the block mask lists.

    python bench/doc_mask_attention.py --device cuda --seq 1024 8192 --batch 8 2
    python bench/doc_mask_attention.py --device cpu --tiny          # plumbing, forward only
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rtd_scale.cli_errors import OneLineArgumentParser, run_cli  # noqa: E402

# torch and the model's modules (megatron-core) are imported after the flags are checked, so
# that a wrong flag is its one line at once: ``_imports``
torch = F = document_mask = flex_masked_attention = window_keep = None


def _imports() -> None:
    global torch, F, document_mask, flex_masked_attention, window_keep
    import torch
    import torch.nn.functional as F

    from rtd_scale.model import document_mask
    from rtd_scale.model.attention import flex_masked_attention, window_keep


def packed_documents(b: int, s: int, doc_len: int, seed: int = 0) -> torch.Tensor:
    """[b, s] document ids: runs of lengths drawn uniformly in [doc_len / 4, 7 doc_len / 4]."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        lengths = torch.randint(max(1, doc_len // 4), max(2, 7 * doc_len // 4), (s,),
                                generator=g)
        rows.append(torch.repeat_interleave(torch.arange(s), lengths)[:s])
    return torch.stack(rows)


def explicit(q, k, v, keys, window, scale):
    keep = ~document_mask.expand(keys)
    if window is not None:
        keep = keep & window_keep(q.shape[2], window, q.device)
    keep = keep | ~keep.any(dim=-1, keepdim=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)


def time_one(fn, q, k, v, keys, window, scale, *, backward: bool, steps: int, warmup: int):
    """(ms per call, peak bytes above the inputs, the output)."""
    cuda = q.is_cuda
    out = None
    for i in range(warmup + steps):
        if i == warmup:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            t0 = time.perf_counter()
        out = fn(q, k, v, keys, window, scale)
        if backward:
            out.float().square().mean().backward()
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    return ms, peak, out.detach()


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backward = device.type == "cuda"
    rows = []
    for s, b in zip(args.seq, args.batch):
        docs = packed_documents(b, s, args.doc_len).to(device)
        keys = document_mask.document_keys(None, docs, (b, s), device)
        g = torch.Generator(device="cpu").manual_seed(1)
        q, k, v = (torch.randn(b, args.heads, s, args.head_dim, generator=g).to(device, dtype)
                   .requires_grad_(backward) for _ in range(3))
        scale = args.head_dim ** -0.5
        for kind, window in (("global", None), ("local", (args.window // 2, args.window // 2))):
            mask = document_mask.block_mask(keys, window)
            listed = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
            t = -(-s // document_mask.FLEX_BLOCK)
            row = {"seq": s, "batch": b, "layer": kind, "tiles listed": listed / (b * t * t)}
            outs = {}
            for name, fn in (("explicit", explicit), ("flex", flex_masked_attention)):
                try:
                    ms, peak, outs[name] = time_one(fn, q, k, v, keys, window, scale,
                                                    backward=backward, steps=args.steps,
                                                    warmup=args.warmup)
                    row[f"{name} ms"] = ms
                    row[f"{name} peak MiB"] = None if peak is None else peak / 2**20
                except torch.OutOfMemoryError:
                    row[f"{name} ms"] = row[f"{name} peak MiB"] = "OOM"
                    torch.cuda.empty_cache()
                if q.grad is not None:
                    for x in (q, k, v):
                        x.grad = None
            if len(outs) == 2:
                row["max abs diff"] = (outs["flex"] - outs["explicit"]).abs().max().item()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    cols = ["seq", "batch", "layer", "tiles listed", "explicit ms", "flex ms",
            "explicit peak MiB", "flex peak MiB", "max abs diff"]
    fmt = lambda x: "—" if x is None else (f"{x:.3g}" if isinstance(x, float) else str(x))  # noqa
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 2],
                   help="one per --seq (the same tokens a step at 8 × 1,024 and 2 × 8,192 ... "
                   "give more at 8,192 if memory allows)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--doc-len", type=int, default=700,
                   help="mean document length in tokens")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="test size: s 256, 2 heads of 16")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.batch, args.heads, args.head_dim = [256], [2], 2, 16
        args.window, args.doc_len, args.steps, args.warmup = 32, 60, 1, 1
    if len(args.batch) != len(args.seq):
        p.error(f"--batch: one per --seq ({len(args.seq)}), got {len(args.batch)}")
    _imports()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (--device cpu --tiny checks the plumbing)")
    rows = run(args)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(run_cli(main))
