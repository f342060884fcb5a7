"""Disentangled attention as one fused FlexAttention kernel (CUDA).

The c2p and p2c terms of DeBERTa's attention (arXiv 2006.03654 §3.1) read a [s, r] table per
head at the relative row δ(i, j) — a gather. The explicit core (``disentangled.py``)
materialises both gathers as [b, n, s, s] tensors, and autograd's backward of a gather is a
scatter-add of the same size; on one H200 at DeBERTaV3-large dims those two account for about a
fifth of the step (its ``relative_terms="shift"`` avoids both with larger matmuls). Here the two
tables are computed as [b, n, s, r] matmuls and PyTorch's
FlexAttention (``torch.nn.attention.flex_attention``) reads them inside its kernel through a
score modification::

    score(i, j) = (q_i · k_j) / sqrt(3d) + c2p[i, δ(i, j)] + p2c[j, δ(i, j)]

so nothing of size [b, n, s, s] is written, and the tables' gradients are accumulated inside the
backward kernel (FlexAttention's gradients of captured tensors).

Limits: FlexAttention has no attention-probability dropout, so this core requires
``attention_dropout`` 0 (it raises otherwise); its backward exists on CUDA only. Keys at [PAD]
get a score of -inf; a query at [PAD] still attends to the real keys (its output is never read).
"""
from __future__ import annotations

from typing import Optional

import torch

# Triton tile sizes tried in turn: the autotuner's first choice for head size 64 asks for more
# shared memory than an H100 / H200 block has once the two tables are captured.
_KERNEL_OPTIONS = (
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_stages": 2,
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
     "bwd_num_stages": 1},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1},
)
_compiled = None
_working: Optional[dict] = None


def compiled_flex_attention():
    """``torch.compile``d ``flex_attention`` (static shapes), compiled once a process."""
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def flex_disentangled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                pos_q: torch.Tensor, pos_k: torch.Tensor, index: torch.Tensor,
                                key_pad: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """The attention core of ``disentangled.disentangled_attention`` in one FlexAttention call.

    Args:
        q, k, v: [b, n, s, d] on CUDA.
        pos_q, pos_k: [n, r, d] the relative rows projected by the query / key weights.
        index: [s, s] int64, δ(i, j) relative to the first row of ``pos_q`` / ``pos_k``.
        key_pad: bool [b, 1, 1, s], True at [PAD], or None.
        scale: 1 / sqrt(3d).
    Returns:
        [b, n, s, d].
    Raises:
        RuntimeError: no tile configuration compiles on this device.
    """
    global _working
    b, n, s, d = q.shape
    c2p = torch.matmul(q * scale, pos_k.transpose(-1, -2))  # [b, n, s, r]
    p2c = torch.matmul(k * scale, pos_q.transpose(-1, -2))  # [b, n, s, r]
    pad = None if key_pad is None else key_pad.reshape(b, s)

    def score_mod(score, bi, hi, qi, kj):
        r = index[qi, kj]
        score = score + c2p[bi, hi, qi, r] + p2c[bi, hi, kj, r]
        if pad is not None:
            score = torch.where(pad[bi, kj], -float("inf"), score)
        return score

    flex = compiled_flex_attention()
    if _working is not None:
        return flex(q, k, v, score_mod=score_mod, scale=scale, kernel_options=_working)
    last: Optional[Exception] = None
    for options in _KERNEL_OPTIONS:
        try:
            out = flex(q, k, v, score_mod=score_mod, scale=scale, kernel_options=options)
        except Exception as e:  # a tile configuration that does not fit: try the next
            last = e
            continue
        _working = options
        return out
    raise RuntimeError(f"FlexAttention compiled with none of {len(_KERNEL_OPTIONS)} tile "
                       f"configurations on this device: {last}")
