"""Disentangled attention on flashdeberta's Triton kernels (``pip install .[gpu]``).

flashdeberta (Knowledgator/FlashDeBERTa, PyPI ``flashdeberta``, pinned in pyproject.toml) ships
forward and backward Triton kernels of DeBERTa's attention (arXiv 2006.03654 §3.1) behind two
autograd Functions, ``flashdeberta.ops.flash_attention.flash_attention_with_disentangled``
(fixed length, right padding) and
``flashdeberta.ops.flash_attention_varlen.flash_attention_with_disentangled_varlen``
(packed sequences of several lengths). They compute c2p = q · Pkᵀ and p2c = k · Pqᵀ as
[·, r] matmuls and gather them at δ(i, j) inside the kernel, so no [b, n, s, s] tensor is
written, and return the gradients of q, k, v and both projected relative tables.

Their attention is ours (``disentangled.py``) up to four rules, adapted here at the boundary
(file and line are of flashdeberta 0.0.8):

- **relative rows**: they read the whole table of 2·span rows (``ops/position.py``,
  ``position_table``, line 97: "expected 2 * att_span"), we project only the rows a length
  reads (``used_rows``): the rows are zero-padded back into place, which changes no score and
  hands the used rows their gradients.
- **head size**: their kernels tile the head dimension whole (``tl.arange(0, BLOCK_DMODEL)``
  with ``BLOCK_DMODEL = D``, ``ops/flash_attention.py`` line 194), which Triton allows for
  powers of two only, and ``tl.dot`` wants at least 16: q, k, v and the tables are zero-padded
  to the next such size (no dot product changes), the scale stays 1/√(3d) of the true d.
- **[PAD] queries**: their kernels leave rows past a sample's length at zero
  (``ops/flash_attention.py`` line 174, ``o = torch.zeros_like(q)``, and the masked store of
  line 128); ours masks a [PAD] query's scores whole, so it averages the values of every key
  (Hugging Face's ``get_attention_mask``): those rows are set to that mean here, with the same
  gradients.
- **padding and documents**: their fixed-length kernel takes one length per sample (keys from
  it on are masked), the varlen kernel contiguous sequences. So key padding must be right
  padding, and a document mask must be ``document_mask.document_keys``' compact form
  ([b, s], each token's document, -1 at [PAD]) whose documents are contiguous runs, as
  ``PackedDataset.sample`` makes them: each run (the padding a run of its own) becomes one
  sequence of the varlen kernel. Both are checked on the device (``torch._assert_async``, no
  host wait); the varlen kernel needs the runs' lengths on the host, one sync per encoder
  forward (flashdeberta's own launcher makes more: ``get_mid_cached``'s ``tolist``).

The log buckets are theirs (``ops/position.py`` line 20, ``make_log_bucket_position``:
"Same formula as transformers' DeBERTa-v2"), the slot clamp(bucket(i − j) + span, 0, 2·span −
1) too (line 47): both equal ``relative_position.relative_position_index``
(tests/unit/test_flash_core.py compares every distance at the presets' 256 / 512).

No attention-probability dropout: the core refuses a dropout probability above 0.

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 set before Triton is
imported: tests/conftest.py), which is how the tests prove them exact. Its launcher enters
``torch.cuda.device(q.device.index)`` around every kernel (``ops/flash_attention.py`` lines
195, 514, 568; ``ops/flash_attention_varlen.py`` lines 284, 599, 660), which fails for a CPU
tensor (index None): on the interpreter only, the calls run with ``torch.cuda.device`` replaced
by a null context, forward and backward
(:class:`_OnInterpreter`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

_FIXED = "flashdeberta.ops.flash_attention"
_VARLEN = "flashdeberta.ops.flash_attention_varlen"
_noted: set[str] = set()


def _note_once(line: str) -> None:
    if line not in _noted:
        _noted.add(line)
        warnings.warn(line, stacklevel=3)


def _kernels():
    """flashdeberta's two kernel modules, or None where it (or Triton) is not installed."""
    try:
        import importlib

        return importlib.import_module(_FIXED), importlib.import_module(_VARLEN)
    except ImportError:
        return None


def on_interpreter() -> bool:
    """flashdeberta's kernels, and Triton's own library functions they call (``tl.zeros`` …),
    were built for Triton's interpreter: TRITON_INTERPRET=1 when Triton was imported. Imports
    flashdeberta only where the variable is set or it is already imported."""
    if os.environ.get("TRITON_INTERPRET") != "1" and _FIXED not in sys.modules:
        return False
    mods = _kernels()
    if mods is None:
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return all(isinstance(f, InterpretedFunction)
               for f in (mods[0]._fwd_kernel_deberta_disentangled_attention, tl.zeros))


def runs_on(device: torch.device) -> bool:
    """Whether the flash core runs on ``device``: flashdeberta installed and the device CUDA (or
    its kernels in Triton's interpreter). Otherwise one note, once, and the caller keeps the
    core it would have picked without ``flash``."""
    if device.type == "cuda":
        if _kernels() is not None:
            return True
        _note_once("the flash attention core needs flashdeberta (pip install '.[gpu]'); "
                   "running the sdpa core")
        return False
    if on_interpreter():
        return True
    _note_once(f"the flash attention core runs on CUDA (flashdeberta's Triton kernels); "
               f"running the explicit core on {device.type}")
    return False


@contextlib.contextmanager
def _null_cuda_device():
    """``torch.cuda.device`` as a null context (the interpreter's launches; module docstring)."""
    saved = torch.cuda.device
    torch.cuda.device = lambda index: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.device = saved


class _OnInterpreter(torch.autograd.Function):
    """``fn(*tensors)`` with ``torch.cuda.device`` null in its forward and its backward (Triton's
    interpreter on a CPU: the module docstring)."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        with torch.enable_grad(), _null_cuda_device():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            out = fn(*leaves)
        ctx.leaves, ctx.out = leaves, out
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        wanted = [t for t in ctx.leaves if t.requires_grad]
        with _null_cuda_device():
            got = iter(torch.autograd.grad(ctx.out, wanted, grad, allow_unused=True))
        return (None, *(next(got) if t.requires_grad else None for t in ctx.leaves))


def _call(fn, *tensors):
    if tensors[0].is_cuda:
        return fn(*tensors)
    return _OnInterpreter.apply(fn, *tensors)


def _kernel_head_size(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


# the last compact mask seen and its varlen plan: every layer of an encoder gets the same mask
_plan_cache: tuple = (None, None)


def _varlen_plan(keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [runs + 1], longest run) of the flattened [b·s] tokens: a sequence
    starts at each sample's first token and wherever the document (or [PAD]) changes."""
    global _plan_cache
    ref, plan = _plan_cache
    if ref is not None and ref() is keys:
        return plan
    b, s = keys.shape
    start = torch.ones_like(keys, dtype=torch.bool)
    start[:, 1:] = keys[:, 1:] != keys[:, :-1]
    at = start.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat((at, at.new_tensor([b * s]))).to(torch.int32)
    plan = (cu, int((cu[1:] - cu[:-1]).max().item()))  # the host sync of varlen lengths
    _plan_cache = (weakref.ref(keys), plan)
    return plan


def _right_padded(pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(lengths int32 [b], whether every sample's [PAD] is a suffix) of ``pad`` [b, s]."""
    lengths = (~pad).sum(-1, dtype=torch.int32)
    pos = torch.arange(pad.shape[1], device=pad.device)
    return lengths, (pad == (pos >= lengths.unsqueeze(1))).all()


def flash_disentangled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 pos_q: torch.Tensor, pos_k: torch.Tensor,
                                 mask: Optional[torch.Tensor], *, scale: float, first_row: int,
                                 position_buckets: int, max_relative_positions: int,
                                 dropout_p: float = 0.0) -> torch.Tensor:
    """``disentangled.disentangled_attention`` on flashdeberta's kernels.

    Args:
        q, k, v: [b, n, s, d] (CUDA, or CPU under Triton's interpreter).
        pos_q, pos_k: [n, r, d] rows ``first_row`` … ``first_row + r − 1`` of the relative
            table (2·span rows, span = ``position_buckets`` or without buckets
            ``max_relative_positions``) projected by the query / key weights.
        mask: None; bool [b, 1, 1, s], True at [PAD] (right padding); or int [b, s], the
            compact document mask (``document_mask.document_keys``: contiguous runs, -1 at
            [PAD], the padding last). A score is masked when its key or its query is [PAD], or
            they are in different documents.
        scale: 1 / sqrt(3·d).
        position_buckets: k (> 0) or -1; max_relative_positions: resolved (> 0).
    Returns:
        [b, n, s, d].
    Raises:
        ValueError: ``dropout_p`` > 0, or a query × key mask ([b, 1, s, s]).
    """
    if dropout_p > 0:
        raise ValueError("the flash attention core has no attention-probability dropout: set "
                         "model.generator.attention_dropout and model.discriminator."
                         "attention_dropout to 0, or use the sdpa core")
    if mask is not None and mask.dim() == 4 and mask.shape[-2] != 1:
        raise ValueError("the flash attention core takes key padding [b, 1, 1, s] or the compact "
                         "document mask [b, s] (document_mask.document_keys), not [b, 1, s, s]")
    fixed, varlen = _kernels()
    b, n, s, d = q.shape
    span = position_buckets if position_buckets > 0 else max_relative_positions
    rows = pos_q.shape[1]
    dk = _kernel_head_size(d)
    # whole table rows, head size a power of two ≥ 16: zeros change no dot product
    pos_q, pos_k = (F.pad(t, (0, dk - d, first_row, 2 * span - first_row - rows))
                    for t in (pos_q, pos_k))
    q, k, v = (F.pad(t, (0, dk - d)) if dk != d else t for t in (q, k, v))
    rule = dict(sm_scale=scale, position_buckets=position_buckets,
                max_relative_distance=max_relative_positions)
    pad = None
    if mask is None:
        out = _call(lambda *t: fixed.flash_attention_with_disentangled(
            t[0], t[1], t[2], None, t[4], t[3], False, **rule), q, k, v, pos_q, pos_k)
    elif mask.dim() == 4:  # key padding
        pad = mask.reshape(b, s)
        lengths, right = _right_padded(pad)
        torch._assert_async(right, "the flash attention core needs right padding: a [PAD] "
                                   "token sits before a real one in some sample")
        out = _call(lambda *t: fixed.flash_attention_with_disentangled(
            t[0], t[1], t[2], lengths, t[4], t[3], False, **rule), q, k, v, pos_q, pos_k)
    else:  # the compact document mask: one varlen sequence per run
        pad = mask < 0
        _, right = _right_padded(pad)
        rising = ((mask[:, 1:] >= mask[:, :-1]) | pad[:, 1:]).all()
        torch._assert_async(right & rising, "the flash attention core needs each sample's "
                                            "documents as contiguous runs, [PAD] last")
        cu, longest = _varlen_plan(mask)

        def packed(qq, kk, vv, pq, pk):  # [b, n, s, d] -> tokens [b·s, n, d] and back
            qq, kk, vv = (t.transpose(1, 2).reshape(b * s, n, dk) for t in (qq, kk, vv))
            o = varlen.flash_attention_with_disentangled_varlen(
                qq, kk, vv, pk, pq, cu, cu, longest, longest, False, **rule)
            return o.view(b, s, n, dk).transpose(1, 2)

        out = _call(packed, q, k, v, pos_q, pos_k)
    if pad is not None:
        # a [PAD] query's scores are masked whole: it averages every key's value
        out = torch.where(pad.view(b, 1, s, 1), v.mean(dim=2, keepdim=True), out)
    return out[..., :d] if dk != d else out

