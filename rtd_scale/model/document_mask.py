"""Document-masked packing in the model: the attention mask and the position ids of packed
samples whose documents must not see each other.

A packed sample holds several documents back to back (``data/packed.py``). Under
document-masked packing (``DataConfig.document_masking``, ``--reset-attention-mask``; ModernBERT,
arXiv 2412.13663 §2.1.3; Megatron-LM's ``--reset-attention-mask`` with ``--reset-position-ids``)
the data path gives each micro-batch its ``document_ids`` [b, s] (``PackedDataset.sample``:
contiguous runs counted from 0, [CLS] in the first, the padding a run of its own), and here:

- a query attends only to keys of its own document (and never to [PAD]): :func:`attention_mask`;
- positions restart at 0 with each document (:func:`document_position_ids`): BERT / ELECTRA's
  learned absolute table reads them, and so does the modern block's rotary attention
  (``model/modern.py``; its scores depend on i − j alone, so the restart changes them only by
  float rounding of the angles, and its sliding window is i − j too). DeBERTa's relative
  positions need nothing: a score depends on i − j only, which is the same inside a document
  wherever it sits, and every cross-document score is masked.

So a token's output is the one it has when its document is run alone from position 0
(tests/unit/test_document_mask.py, at 2,048 tokens, both layouts).

On the CPU the mask is explicit, [b, 1, s, s] bool. On CUDA the layers whose core is
``SDPACoreAttention`` (BERT attention and the modern block) take the mask in its compact form
instead, :func:`document_keys` ([b, s]: each token's document, -1 at [PAD]), and the core builds
a FlexAttention block mask from it (:func:`block_mask`: document × padding × the layer's window)
from per-tile document ranges, so nothing of [b, s, s] is written: at s 8,192 and FlexAttention's
128-token tiles the mask is [b, 64, 64] tile lists and a ``mask_mod`` reading the [b, s] ids
(``tests/unit/test_document_mask.py`` bounds every tensor its construction makes). Tiles that no
pair of the mask reaches are skipped by the kernel, and tiles that every pair reaches run without
``mask_mod`` (FlexAttention's full blocks).
"""
from __future__ import annotations

import os
from typing import Optional

import torch


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids that restart at 0 with each document: int64 [b, s], i − (the first position
    of i's run) for ``document_ids`` [b, s] (runs of equal ids, ``PackedDataset.sample``)."""
    b, s = document_ids.shape
    pos = torch.arange(s, device=document_ids.device).expand(b, s)
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return pos - torch.cummax(torch.where(first, pos, 0), dim=1).values


def attention_mask(pad_mask: Optional[torch.Tensor],
                   document_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The attention mask of a micro-batch, True = masked (megatron-core's convention).

    Args:
        pad_mask: [b, s] bool, True at [PAD], or None (no padding).
        document_ids: [b, s] (``MicroBatch.document_ids``) under document-masked packing, else
            None.
    Returns:
        None (neither: attention without a mask, flash kernels on GPU); [b, 1, 1, s] (padded
        keys); or, with documents, [b, 1, s, s]: key j masked for query i when j is [PAD] or in
        another document than i. DeBERTa's attention also masks [PAD] queries (its core ORs the
        mask with its transpose, Hugging Face's ``get_attention_mask``).
    """
    if document_ids is None:
        return None if pad_mask is None else pad_mask.view(pad_mask.shape[0], 1, 1, -1)
    masked = document_ids.unsqueeze(-1) != document_ids.unsqueeze(-2)  # [b, s, s]
    if pad_mask is not None:
        masked = masked | pad_mask.unsqueeze(-2)
    return masked.unsqueeze(1)


# Set to 0 to keep the explicit mask on CUDA too (as Transformer Engine's NVTE_FLASH_ATTN=0
# turns a kernel off): the FlexAttention path has been checked on the CPU only so far.
FLEX_ENV = "RTD_SCALE_FLEX_ATTENTION"


def compact_on(device: torch.device) -> bool:
    """Whether the encoder hands SDPACoreAttention the compact mask (FlexAttention): on CUDA,
    where FlexAttention compiles to a fused kernel with a backward (the CPU's has neither),
    unless ``RTD_SCALE_FLEX_ATTENTION=0``."""
    return device.type == "cuda" and os.environ.get(FLEX_ENV, "1") != "0"


# FlexAttention's tile (torch.nn.attention.flex_attention's default BLOCK_SIZE)
FLEX_BLOCK = 128


def document_keys(pad_mask: Optional[torch.Tensor], document_ids: Optional[torch.Tensor],
                  shape: tuple[int, int], device=None) -> torch.Tensor:
    """The compact attention mask: int32 [b, s], each token's document (0 for every token
    without ``document_ids``), -1 at [PAD]. Query i may attend key j when both hold the same
    value ≥ 0 (and j is inside i's window in a local layer): what :func:`attention_mask` writes
    out as [b, 1, s, s] (:func:`expand`), up to [PAD] queries, which see no key here (their
    outputs are read by no loss)."""
    if document_ids is not None:
        keys = document_ids.to(torch.int32)
    else:
        keys = torch.zeros(shape, dtype=torch.int32, device=device)
    if pad_mask is not None:
        keys = keys.masked_fill(pad_mask, -1)
    return keys


def expand(keys: torch.Tensor) -> torch.Tensor:
    """:func:`document_keys`' mask written out: [b, 1, s, s] bool, True = masked."""
    return ((keys.unsqueeze(-1) != keys.unsqueeze(-2)) | (keys < 0).unsqueeze(-2)).unsqueeze(1)


def _tile_ranges(keys: torch.Tensor, block: int) -> tuple[torch.Tensor, ...]:
    """Per tile of ``block`` tokens: the least and greatest document id of its real tokens
    ([b, t]; an all-[PAD] tile gets (max, -1), an empty range) and whether it is one document
    without [PAD] and inside the sequence (a tile whose pairs all share the same document)."""
    b, s = keys.shape
    t = -(-s // block)
    tiles = torch.nn.functional.pad(keys, (0, t * block - s), value=-1).view(b, t, block)
    real = tiles >= 0
    big = torch.iinfo(keys.dtype).max
    lo = torch.where(real, tiles, big).amin(-1)
    hi = torch.where(real, tiles, -1).amax(-1)
    whole = real.all(-1) & (lo == hi)
    return lo, hi, whole


def block_mask(keys: torch.Tensor, window_size: Optional[tuple[int, int]] = None,
               block: int = FLEX_BLOCK):
    """FlexAttention's ``BlockMask`` of the compact mask ``keys`` [b, s] (:func:`document_keys`)
    and a sliding window (query i sees keys i − left … i + right) or none, for every head.

    Built from tile ranges ([b, t, t] with t = ⌈s / block⌉), never from the [b, s, s] mask: a
    tile pair is needed when its query tile's document range meets its key tile's and some
    offset j − i of the pair lies in the window; it is full (no ``mask_mod`` in the kernel) when
    both tiles are one and the same document without [PAD] and every offset lies in the window.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, s = keys.shape
    lo, hi, whole = _tile_ranges(keys, block)
    t = lo.shape[1]
    needed = (lo.unsqueeze(-1) <= hi.unsqueeze(-2)) & (lo.unsqueeze(-2) <= hi.unsqueeze(-1))
    full = (whole.unsqueeze(-1) & whole.unsqueeze(-2)
            & (lo.unsqueeze(-1) == lo.unsqueeze(-2)))  # [b, t(q), t(kv)]
    if window_size is not None:
        left, right = window_size
        start = torch.arange(t, device=keys.device) * block
        # offsets j − i over a tile pair: [kv start − q end, kv end − q start]
        least = start.view(1, t) - (start.view(t, 1) + block - 1)
        most = start.view(1, t) + block - 1 - start.view(t, 1)
        needed = needed & ((most >= -left) & (least <= right))
        full = full & ((least >= -left) & (most <= right))
    partial = needed & ~full

    def tile_lists(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # per query tile: how many key tiles, and their indices first (a stable sort keeps order)
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return (m.sum(-1).to(torch.int32).unsqueeze(1),
                order.to(torch.int32).unsqueeze(1))  # [b, 1, t], [b, 1, t, t]

    def mask_mod(bi, hi_, qi, kj):
        same = (keys[bi, qi] == keys[bi, kj]) & (keys[bi, kj] >= 0)
        if window_size is None:
            return same
        return same & (kj - qi >= -window_size[0]) & (kj - qi <= window_size[1])

    kv_num, kv_idx = tile_lists(partial)
    full_num, full_idx = tile_lists(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(s, s))
