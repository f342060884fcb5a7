"""The replaced-token-detection objective (arXiv 2111.09543 §3.1, ELECTRA arXiv 2003.10555 §2).

    L = L_MLM + rtd_lambda · L_RTD

- L_MLM: the generator's cross-entropy, averaged over the masked positions of the micro-batch
  (computed vocab-parallel by the model; see ``rtd_scale/model/heads.py``).
- L_RTD: binary cross-entropy of the discriminator's one logit per token against
  label = (corrupted id != original id), averaged over every non-pad token of the micro-batch
  ([CLS] and [SEP] included; they are never replaced, so their label is 0). A generator sample
  equal to the original counts as original (label 0), as in ELECTRA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def replaced_labels(corrupted_ids: torch.Tensor, original_ids: torch.Tensor) -> torch.Tensor:
    """RTD labels: 1.0 where the discriminator's input differs from the original, else 0.0.

    Args:
        corrupted_ids: [b, s] int64 discriminator input.
        original_ids: [b, s] int64 original ids.
    Returns:
        [b, s] float32 labels.
    """
    return (corrupted_ids != original_ids).to(torch.float32)


def rtd_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy over valid (non-pad) tokens.

    Args:
        logits: [b, s] discriminator logits (any float dtype; computed in fp32).
        labels: [b, s] float 0/1 RTD labels.
        valid: [b, s] bool, True at non-pad tokens.
    Returns:
        scalar fp32 loss: sum of per-token BCE over valid tokens / number of valid tokens
        (0 when there are none). Pad positions contribute exactly nothing, not even NaN.
    """
    # Zero the pad logits *before* the loss: a non-finite value there must not reach the
    # gradient (torch.where alone would still back-propagate NaN · 0 = NaN).
    safe_logits = torch.where(valid, logits.float(), torch.zeros((), device=logits.device))
    per_token = F.binary_cross_entropy_with_logits(safe_logits, labels.float(), reduction="none")
    per_token = torch.where(valid, per_token, torch.zeros((), device=logits.device))
    return per_token.sum() / valid.sum().clamp(min=1)


def total_loss(mlm: torch.Tensor, rtd: torch.Tensor, rtd_lambda: float) -> torch.Tensor:
    """L_MLM + rtd_lambda · L_RTD (arXiv 2111.09543 §3.1, eq. for L = L_MLM + λ L_RTD)."""
    return mlm + rtd_lambda * rtd
