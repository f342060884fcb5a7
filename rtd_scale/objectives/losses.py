"""The replaced-token-detection objective (arXiv 2111.09543 §3.1, ELECTRA arXiv 2003.10555 §2).

    L = L_MLM + rtd_lambda · L_RTD

Both losses are normalised over the *global* batch (DESIGN.md §3, "Losses are normalised over
the global batch"; Megatron-LM's ``--calculate-per-token-loss``):

- L_MLM: the generator's cross-entropy summed over every masked position of the global batch
  (all micro-batches, all data-parallel ranks) and divided by their number (computed
  vocab-parallel by the model; see ``rtd_scale/model/heads.py``).
- L_RTD: binary cross-entropy of the discriminator's one logit per token against
  label = (corrupted id != original id), summed over every non-pad token of the global batch
  ([CLS] and [SEP] included; they are never replaced, so their label is 0) and divided by their
  number. A generator sample equal to the original counts as original (label 0), as in ELECTRA.

A micro-batch computes its own sums, so it divides them by ``micro_batch_normaliser``: the
global count / the number of micro-batches in the global batch (gradient accumulation steps ×
data-parallel size). DeepSpeed's ``engine.backward`` divides each micro-batch's loss by the
accumulation steps and its gradient reduction averages over the data-parallel ranks (and
megatron-core's pipeline schedule divides by its number of micro-batches), which together
divide by exactly that number again: the update is the gradient of sum / global count, whatever
the split (micro-batch size × accumulation × DP), mask strategy or padding. The per-micro-batch
losses the step returns average, over the global batch's micro-batches, to L_MLM and L_RTD.
When every micro-batch holds the same count (token masking without padding) this is the
micro-batch's own mean. Without a normaliser a micro-batch is its own global batch.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rtd_scale.objectives import counter_rng

# Rows of the [2] count vector ``loss_counts`` returns and the step all-reduces.
MLM_COUNT, RTD_COUNT = 0, 1


def loss_counts(masked: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """What a micro-batch's losses are summed over: [2] int64 (masked positions, non-pad
    tokens), indexed by ``MLM_COUNT`` / ``RTD_COUNT``; on the tensors' device, no host sync.

    Args:
        masked: [b, s] bool, the masked positions (``masking.MaskedBatch.masked``).
        valid: [b, s] bool, True at non-pad tokens.
    """
    return torch.stack([masked.sum(), valid.sum()]).to(torch.int64)


def micro_batch_normaliser(global_counts: torch.Tensor, num_micro_batches: int) -> torch.Tensor:
    """What one micro-batch divides its summed losses by.

    Args:
        global_counts: [2] int64 — masked positions and non-pad tokens of the whole global batch
            (every micro-batch of every data-parallel rank; ``MLM_COUNT``, ``RTD_COUNT``).
        num_micro_batches: micro-batches in the global batch (accumulation steps × DP size).
    Returns:
        [2] fp32: max(count, 1) / num_micro_batches (a count of 0 means the sums are 0 too).
    """
    assert num_micro_batches >= 1, num_micro_batches
    return global_counts.to(torch.float64).clamp(min=1.0).div(num_micro_batches).to(torch.float32)


def replaced_labels(corrupted_ids: torch.Tensor, original_ids: torch.Tensor) -> torch.Tensor:
    """RTD labels: 1.0 where the discriminator's input differs from the original, else 0.0.

    Args:
        corrupted_ids: [b, s] int64 discriminator input.
        original_ids: [b, s] int64 original ids.
    Returns:
        [b, s] float32 labels.
    """
    return (corrupted_ids != original_ids).to(torch.float32)


def shuffled_labels(labels: torch.Tensor, valid: torch.Tensor, *, seed: int, step: int,
                    sample_index: torch.Tensor) -> torch.Tensor:
    """The shuffled-labels negative control (``rtd.shuffle_labels``): each sample's labels
    permuted over its valid (non-pad) positions, so a sample keeps its replaced count but the
    labels no longer say where its replacements are. The permutation is a function of (seed,
    step, global sample index) (``counter_rng``), the same at any parallel layout.

    Args:
        labels: [b, s] float RTD labels; valid: [b, s] bool; sample_index: [b] int64.
    Returns:
        [b, s] float labels (unchanged at invalid positions).
    """
    b, s = labels.shape
    pos = torch.arange(s, device=labels.device).view(1, s)
    u = counter_rng.uniform(counter_rng.STREAM_SHUFFLE_LABELS, seed, step,
                            sample_index.view(b, 1), pos)
    invalid = (~valid).to(torch.float64)
    src = torch.sort(u + 2.0 * invalid, dim=1).indices  # valid positions in random order first
    dst = torch.sort(invalid, dim=1, stable=True).indices  # valid positions in order first
    return torch.empty_like(labels).scatter_(1, dst, labels.gather(1, src))


def rtd_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
             normaliser: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Binary cross-entropy summed over valid (non-pad) tokens, divided by ``normaliser``.

    Args:
        logits: [b, s] discriminator logits (any float dtype; computed in fp32).
        labels: [b, s] float 0/1 RTD labels.
        valid: [b, s] bool, True at non-pad tokens.
        normaliser: scalar fp32, ``micro_batch_normaliser(...)[RTD_COUNT]`` (the global batch's
            non-pad tokens / its micro-batches); None: this micro-batch's valid tokens.
    Returns:
        scalar fp32 loss: sum of per-token BCE over valid tokens / normaliser (without one: the
        mean over valid tokens, 0 when there are none). Pad positions contribute exactly
        nothing, not even NaN.
    """
    # Zero the pad logits *before* the loss: a non-finite value there must not reach the
    # gradient (torch.where alone would still back-propagate NaN · 0 = NaN).
    safe_logits = torch.where(valid, logits.float(), torch.zeros((), device=logits.device))
    per_token = F.binary_cross_entropy_with_logits(safe_logits, labels.float(), reduction="none")
    per_token = torch.where(valid, per_token, torch.zeros((), device=logits.device))
    if normaliser is None:
        normaliser = valid.sum().clamp(min=1)
    return per_token.sum() / normaliser


def total_loss(mlm: torch.Tensor, rtd: torch.Tensor, rtd_lambda: float) -> torch.Tensor:
    """L_MLM + rtd_lambda · L_RTD (arXiv 2111.09543 §3.1, eq. for L = L_MLM + λ L_RTD)."""
    return mlm + rtd_lambda * rtd
