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

On the CPU the mask is explicit, [b, 1, s, s] bool. :func:`attention_mask` is the one place a
CUDA path plugs in — FlexAttention's block mask (``create_block_mask`` with
``document_ids[b, q] == document_ids[b, kv]``, and a sliding window where the layer has one) or
varlen attention over ``cu_seqlens`` taken from the runs — so that no [b, s, s] tensor is
written; neither is built yet (both want a device to be tested on).
"""
from __future__ import annotations

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
