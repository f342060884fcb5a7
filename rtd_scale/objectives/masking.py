"""Dynamic, reproducible masking for the generator's masked-language-model input.

Which positions are masked, and what a masked slot receives, are pure functions of
(seed, global sample index, position) through ``counter_rng``: a sample is masked identically on
every tensor-parallel rank, at every data-parallel size, and after a resume (STYLE rule 8).

Rules (BERT, arXiv 1810.04805 §3.1; ELECTRA arXiv 2003.10555 §2; DeBERTaV3 arXiv 2111.09543 §3.1):
- each maskable position is selected independently with probability ``mask_prob``;
  [PAD], [CLS], [SEP] (and every other special id) are never selected;
- a selected slot receives [MASK] with probability ``mask_token_prob``, a uniformly random
  non-special token with probability ``random_token_prob``, and keeps its token otherwise
  (the 80/10/10 rule of BERT, also the default of DeBERTa's released code). ELECTRA's released
  code uses 85% [MASK], 15% kept (``mask_token_prob=0.85, random_token_prob=0.0``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rtd_scale.objectives import counter_rng as rng


@dataclass(frozen=True)
class MaskedBatch:
    """Result of ``mask_tokens``.

    Attributes:
        generator_input: [b, s] int64 — the original ids with masked slots replaced.
        masked: [b, s] bool — positions the generator must predict (and the sampler fills).
    """

    generator_input: torch.Tensor
    masked: torch.Tensor


def random_non_special_ids(
    u: torch.Tensor, vocab_size: int, special_ids: Sequence[int]
) -> torch.Tensor:
    """Map uniforms in (0, 1) to ids uniform over [0, vocab_size) without ``special_ids``.

    Args:
        u: float tensor of any shape, values in (0, 1).
        vocab_size: number of real (unpadded) ids.
        special_ids: ids never returned.
    Returns:
        int64 tensor of u's shape.
    """
    specials = sorted({int(i) for i in special_ids if 0 <= int(i) < vocab_size})
    n = vocab_size - len(specials)
    ids = torch.clamp((u * n).to(torch.int64), max=n - 1)
    for s in specials:  # ascending: shift every id at or past a special one up by one
        ids = ids + (ids >= s).to(torch.int64)
    return ids


def mask_tokens(
    input_ids: torch.Tensor,
    sample_index: torch.Tensor,
    *,
    seed: int,
    mask_prob: float,
    mask_token_prob: float,
    random_token_prob: float,
    mask_id: int,
    vocab_size: int,
    special_ids: Sequence[int],
) -> MaskedBatch:
    """Select masked positions and build the generator's input.

    Args:
        input_ids: [b, s] int64 original token ids (may contain [PAD]).
        sample_index: [b] int64 global index of each sample in the dataset.
        seed: run seed.
        mask_prob: probability that a maskable position is selected.
        mask_token_prob: probability that a selected slot receives [MASK].
        random_token_prob: probability that a selected slot receives a random non-special id.
        mask_id: id of [MASK].
        vocab_size: number of real ids (random replacements are drawn below it).
        special_ids: ids never selected and never drawn as random replacements.
    Returns:
        MaskedBatch with ``generator_input`` [b, s] and ``masked`` [b, s].
    """
    b, s = input_ids.shape
    pos = torch.arange(s, device=input_ids.device, dtype=torch.int64).view(1, s)
    sample = sample_index.to(device=input_ids.device, dtype=torch.int64).view(b, 1)
    maskable = torch.ones_like(input_ids, dtype=torch.bool)
    for sid in special_ids:
        maskable &= input_ids != sid
    masked = maskable & (rng.uniform(seed, rng.STREAM_MASK, sample, pos) < mask_prob)

    action = rng.uniform(seed, rng.STREAM_MASK_ACTION, sample, pos)
    to_mask = masked & (action < mask_token_prob)
    to_random = masked & (action >= mask_token_prob) & (action < mask_token_prob + random_token_prob)
    random_ids = random_non_special_ids(
        rng.uniform(seed, rng.STREAM_RANDOM_TOKEN, sample, pos), vocab_size, special_ids
    )
    generator_input = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    generator_input = torch.where(to_random, random_ids, generator_input)
    return MaskedBatch(generator_input=generator_input, masked=masked)
