"""Dynamic, reproducible masking for the generator's masked-language-model input.

Which positions are masked, and what a masked slot receives, are pure functions of
(seed, global sample index, position) through ``counter_rng``: a sample is masked identically on
every tensor-parallel rank, at every data-parallel size, and after a resume (STYLE rule 8).

Rules (BERT, arXiv 1810.04805 §3.1; ELECTRA arXiv 2003.10555 §2; DeBERTaV3 arXiv 2111.09543 §3.1):
- a sample with m maskable positions has exactly max(1, round(mask_prob · m)) of them selected
  (rounding half up; none when m = 0), uniformly at random: the fixed count of BERT's
  ``create_pretraining_data.py`` (``num_to_predict``, there counted over all tokens), not an
  independent coin per position. Its ``max_predictions_per_seq`` is ``prediction_budget``: no
  sample has more, so the MLM head works on a static [b, budget] set of rows and needs no host
  synchronisation (``masked_positions``). [PAD], [CLS], [SEP] (and every other special id) are
  never selected;
- a selected slot receives [MASK] with probability ``mask_token_prob``, a uniformly random
  non-special token with probability ``random_token_prob``, and keeps its token otherwise
  (the 80/10/10 rule of BERT, also the default of DeBERTa's released code). ELECTRA's released
  code uses 85% [MASK], 15% kept (``mask_token_prob=0.85, random_token_prob=0.0``).
"""
from __future__ import annotations

import math
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


def prediction_budget(mask_prob: float, seq_length: int) -> int:
    """Most positions ``mask_tokens`` selects in one sample of ``seq_length`` tokens:
    max(1, round(mask_prob · seq_length)) (BERT's ``max_predictions_per_seq``), at most
    ``seq_length``."""
    return min(seq_length, max(1, math.floor(mask_prob * seq_length + 0.5)))


def select_masked(maskable: torch.Tensor, key_hash: torch.Tensor, mask_prob: float) -> torch.Tensor:
    """The masked positions: in each row, the max(1, round(mask_prob · m)) maskable positions
    with the smallest hashes (m = the row's maskable count; ties broken by position), so a
    uniformly random subset of that size. Static shapes, no host synchronisation.

    Args:
        maskable: [b, s] bool.
        key_hash: [b, s] int64 in [0, 2**32), a counter-based hash per position.
        mask_prob: the fraction to select.
    Returns:
        [b, s] bool, at most ``prediction_budget(mask_prob, s)`` True per row.
    """
    b, s = maskable.shape
    assert s <= 1 << 16, "positions are packed into 16 bits of the selection key"
    budget = prediction_budget(mask_prob, s)
    pos = torch.arange(s, device=maskable.device, dtype=torch.int64)
    key = torch.where(maskable, (key_hash << 16) | pos, torch.full((), 1 << 62,
                                                                   device=maskable.device))
    order = key.topk(budget, dim=1, largest=False).indices  # [b, budget], smallest key first
    m = maskable.sum(dim=1, keepdim=True)  # [b, 1]
    count = (m.double() * mask_prob + 0.5).floor().clamp(min=1).to(torch.int64)
    count = torch.where(m > 0, count, torch.zeros_like(count)).clamp(max=budget)
    chosen = torch.arange(budget, device=maskable.device).view(1, -1) < count
    return torch.zeros_like(maskable).scatter(1, order, chosen)


def masked_positions(masked: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked positions of each row as a static [b, budget] index, without a host sync.

    Args:
        masked: [b, s] bool with at most ``budget`` True per row (``mask_tokens`` guarantees
            ``prediction_budget``).
        budget: the number of slots per row.
    Returns:
        positions: [b, budget] int64, each row's masked positions in ascending order, then
            (in unused slots) unmasked positions; valid: [b, budget] bool, True at masked ones.
    """
    s = masked.shape[1]
    pos = torch.arange(s, device=masked.device, dtype=torch.int64)
    key = pos + s * (~masked).to(torch.int64)  # masked positions first, each group in order
    first = key.topk(min(budget, s), dim=1, largest=False).values
    return first % s, first < s


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
    masked = select_masked(maskable, rng.hash_keys(seed, rng.STREAM_MASK, sample, pos),
                           mask_prob)

    action = rng.uniform(seed, rng.STREAM_MASK_ACTION, sample, pos)
    to_mask = masked & (action < mask_token_prob)
    to_random = masked & (action >= mask_token_prob) & (action < mask_token_prob + random_token_prob)
    random_ids = random_non_special_ids(
        rng.uniform(seed, rng.STREAM_RANDOM_TOKEN, sample, pos), vocab_size, special_ids
    )
    generator_input = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    generator_input = torch.where(to_random, random_ids, generator_input)
    return MaskedBatch(generator_input=generator_input, masked=masked)
