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

Strategies (``--mask-strategy``, ``rtd.mask_strategy``); the rules above are ``token``'s, the
others select *units* of several tokens instead of single tokens:
- ``whole_word``: a unit is a word, every token of it masked together (BERT's whole-word
  masking, ``create_pretraining_data.py``). A maskable token starts a word when the tokenizer's
  word-start table says so (SentencePiece: its piece begins with "▁"; WordPiece: it does not begin
  with "##"; ``Tokenizer.word_start_table``) or when the token before it is not maskable (a
  special id, or the sample's start: packed samples may begin inside a word).
- ``span``: a unit is a run of whole words, its length in *words* (as SpanBERT, arXiv 1907.10529
  §3.1) drawn from the geometric distribution p = 0.2 truncated to 1..10 words,
  P(l) ∝ p·(1-p)^(l-1) (SpanBERT's released sampler renormalises over 1..10, giving its mean of
  3.8 words). Each sample's words are tiled by consecutive spans whose lengths are the draws
  l_0, l_1, … keyed by (seed, sample index, span number); a span may enclose special tokens
  (never masked themselves), and two chosen spans may touch.
- Each unit is chosen with probability exactly ``mask_prob`` whatever its length, so a sample
  masks mask_prob · m tokens in expectation (no max(1, ·) floor) and the chosen spans have the
  length distribution above. The design is systematic sampling: the sample's units sorted by
  length (ties in the order of a counter-based hash of (seed, sample index, position of their
  first token)), then every (1 / mask_prob)-th of them from an offset keyed by (seed, sample
  index). Sorting by length first makes every length take its share, so the masked count stays
  within one unit's length of mask_prob · m (BERT's whole-word rule and SpanBERT's sampler
  instead fill a token budget, which favours short units or cuts the last span).
- Static budget: a sample never masks more than ``prediction_budget(mask_prob, s, strategy)``
  = round(mask_prob · s) + ``UNIT_SLACK_TOKENS`` tokens (8 for whole words, 24 for spans);
  units past it are dropped, which only a unit longer than the slack can cause: a rare long word
  or span on space-separated text, but nearly every unit on text without spaces, where a
  SentencePiece "word" is a clause (``unit_fit.py`` measures this at start and warns;
  ``tests/unit/test_unit_fit.py`` pins both). The MLM head works on that many rows per sample:
  the slack's cost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from rtd_scale.config import MaskStrategy
from rtd_scale.objectives import counter_rng as rng

# Stream tags of the unit strategies, distinct from counter_rng's STREAM_* tags.
STREAM_UNIT_ORDER = 0x756E6974  # "unit": the order of units of equal length
STREAM_UNIT_OFFSET = 0x6F666673  # "offs": the offset of a sample's systematic sample of units
STREAM_SPAN_LENGTH = 0x7370616E  # "span": the length of span number j of a sample

# Extra MLM slots per sample for the unit strategies (see the module docstring): the masked count
# passes mask_prob · s by less than the longest unit, so only units longer than this are dropped.
UNIT_SLACK_TOKENS = {MaskStrategy.WHOLE_WORD: 8, MaskStrategy.SPAN: 24}


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


def prediction_budget(mask_prob: float, seq_length: int,
                      strategy: MaskStrategy = MaskStrategy.TOKEN) -> int:
    """Most positions ``mask_tokens`` selects in one sample of ``seq_length`` tokens:
    max(1, round(mask_prob · seq_length)) (BERT's ``max_predictions_per_seq``), plus
    ``UNIT_SLACK_TOKENS`` for the whole-word and span strategies, at most ``seq_length``."""
    base = max(1, math.floor(mask_prob * seq_length + 0.5))
    return min(seq_length, base + UNIT_SLACK_TOKENS.get(strategy, 0))


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


def word_starts(input_ids: torch.Tensor, maskable: torch.Tensor,
                word_start_table: torch.Tensor) -> torch.Tensor:
    """Maskable positions that begin a word: the table says the token starts one, or the token
    before it is not maskable (or there is none).

    Args:
        input_ids: [b, s] int64; maskable: [b, s] bool.
        word_start_table: [V] bool, indexed by id (``Tokenizer.word_start_table``), on
            ``input_ids``' device.
    Returns:
        [b, s] bool.
    """
    prev = torch.nn.functional.pad(maskable[:, :-1], (1, 0), value=False)
    return maskable & (word_start_table[input_ids] | ~prev)


def span_lengths(u: torch.Tensor, geometric_p: float, max_words: int) -> torch.Tensor:
    """Span lengths in words from uniforms: the inverse CDF of P(l) ∝ p·(1-p)^(l-1),
    l = 1..max_words (SpanBERT's sampler, arXiv 1907.10529 §3.1).

    Args:
        u: float tensor in (0, 1), any shape.
    Returns:
        int64 tensor of u's shape, values in [1, max_words].
    """
    q = 1.0 - geometric_p
    total = 1.0 - q ** max_words if q > 0 else 1.0
    length = torch.ones_like(u, dtype=torch.int64)
    for k in range(1, max_words):  # comparisons with Python floats: no device tensor is made
        length += (u > (1.0 - q ** k) / total).to(torch.int64)
    return length


def expected_span_length(geometric_p: float, max_words: int) -> float:
    """Mean of ``span_lengths``' distribution, in words (SpanBERT's 3.8 for p = 0.2, 10 words)."""
    w = [(1.0 - geometric_p) ** (k - 1) for k in range(1, max_words + 1)]
    return sum(k * x for k, x in zip(range(1, max_words + 1), w)) / sum(w)


def span_starts(starts: torch.Tensor, sample: torch.Tensor, *, seed: int, geometric_p: float,
                max_words: int) -> torch.Tensor:
    """The word starts that begin a span: the sample's words tiled by spans of
    ``span_lengths`` words, span j's length keyed by (seed, sample index, j).

    Args:
        starts: [b, s] bool word starts (``word_starts``); sample: [b, 1] int64 sample index.
    Returns:
        [b, s] bool, a subset of ``starts`` (the first word is always a span start).
    """
    b, s = starts.shape
    j = torch.arange(s, device=starts.device, dtype=torch.int64).view(1, s)
    length = span_lengths(rng.uniform(seed, STREAM_SPAN_LENGTH, sample, j), geometric_p, max_words)
    first_word = length.cumsum(1) - length  # [b, s] word number of span j's first word
    begins = torch.zeros((b, s + 1), dtype=torch.bool, device=starts.device)
    begins.scatter_(1, first_word.clamp(max=s), True)  # word w begins a span (w < s)
    word = (starts.to(torch.int64).cumsum(1) - 1).clamp(min=0)  # word number of each position
    return starts & begins.gather(1, word)


def select_units(maskable: torch.Tensor, unit_start: torch.Tensor, order_hash: torch.Tensor,
                 offset_u: torch.Tensor, mask_prob: float, budget: int) -> torch.Tensor:
    """Masked positions made of whole units, each unit chosen with probability exactly
    ``mask_prob`` whatever its length (see the module docstring): systematic sampling, every
    (1 / mask_prob)-th unit from a random offset, over the row's units sorted by length (ties in
    hash order); nothing past ``budget`` tokens. Static shapes, no host synchronisation.

    Args:
        maskable: [b, s] bool; unit_start: [b, s] bool, the maskable positions that begin a unit
            (the first maskable position of a row must be one); a unit runs to the next start.
        order_hash: [b, s] int64 in [0, 2**32), read at unit starts.
        offset_u: [b, 1] float64 uniforms in (0, 1), one per row.
        mask_prob: each unit's probability; budget: most tokens per row.
    Returns:
        [b, s] bool, a union of whole units, at most ``budget`` True per row.
    """
    b, s = maskable.shape
    assert s <= 1 << 16, "positions are packed into 16 bits of the order key"
    dev = maskable.device
    pos = torch.arange(s, device=dev, dtype=torch.int64).view(1, s)
    unit = (unit_start.to(torch.int64).cumsum(1) - 1).clamp(min=0)  # [b, s] unit number
    spill = torch.full_like(unit, s)  # slot s collects what belongs to no unit; dropped
    size = torch.zeros((b, s + 1), dtype=torch.int64, device=dev).scatter_add_(
        1, torch.where(maskable, unit, spill), maskable.to(torch.int64))[:, :s]  # tokens per unit
    never = 1 << 62
    key = torch.full((b, s + 1), never, dtype=torch.int64, device=dev).scatter_(
        1, torch.where(unit_start, unit, spill), (order_hash << 16) | pos)[:, :s]
    order = key.argsort(dim=1)  # units in hash order, then no-unit slots
    length = torch.where(key.gather(1, order) < never, size.gather(1, order), s + 1)
    order = order.gather(1, length.argsort(dim=1, stable=True))  # by length, ties in hash order
    size = size.gather(1, order)  # 0 in slots that hold no unit (all at the end)
    rank = pos.to(torch.float64)
    take = ((rank + 1) * mask_prob + offset_u).floor() > (rank * mask_prob + offset_u).floor()
    take &= size > 0
    take &= (size * take).cumsum(1) <= budget
    chosen = torch.zeros_like(maskable).scatter_(1, order, take)  # per unit number
    return maskable & chosen.gather(1, unit)


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
    strategy: MaskStrategy = MaskStrategy.TOKEN,
    word_start_table: torch.Tensor | None = None,
    span_geometric_p: float = 0.2,
    span_max_words: int = 10,
    unit_budget: int | None = None,
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
        strategy: ``token``, ``whole_word`` or ``span`` (see the module docstring).
        word_start_table: [V] bool on ``input_ids``' device, whether each id begins a word
            (``Tokenizer.word_start_table``); needed by ``whole_word`` and ``span``.
        span_geometric_p, span_max_words: the span length distribution (``span``).
        unit_budget: most tokens per sample for ``whole_word`` and ``span`` (default
            ``prediction_budget``; ``unit_fit.measure_unit_fit`` passes s to count what the
            slots drop).
    Returns:
        MaskedBatch with ``generator_input`` [b, s] and ``masked`` [b, s].
    Raises:
        ValueError: ``whole_word`` or ``span`` without ``word_start_table``.
    """
    b, s = input_ids.shape
    pos = torch.arange(s, device=input_ids.device, dtype=torch.int64).view(1, s)
    sample = sample_index.to(device=input_ids.device, dtype=torch.int64).view(b, 1)
    maskable = torch.ones_like(input_ids, dtype=torch.bool)
    for sid in special_ids:
        maskable &= input_ids != sid
    if strategy is MaskStrategy.TOKEN:
        masked = select_masked(maskable, rng.hash_keys(seed, rng.STREAM_MASK, sample, pos),
                               mask_prob)
    else:
        if word_start_table is None:
            raise ValueError(f"mask strategy {strategy.value!r} needs the tokenizer's word-start "
                             "table (Tokenizer.word_start_table()); pass word_start_table")
        units = word_starts(input_ids, maskable, word_start_table)
        if strategy is MaskStrategy.SPAN:
            units = span_starts(units, sample, seed=seed, geometric_p=span_geometric_p,
                                max_words=span_max_words)
        masked = select_units(maskable, units, rng.hash_keys(seed, STREAM_UNIT_ORDER, sample, pos),
                              rng.uniform(seed, STREAM_UNIT_OFFSET, sample), mask_prob,
                              prediction_budget(mask_prob, s, strategy) if unit_budget is None
                              else unit_budget)

    action = rng.uniform(seed, rng.STREAM_MASK_ACTION, sample, pos)
    to_mask = masked & (action < mask_token_prob)
    to_random = masked & (action >= mask_token_prob) & (action < mask_token_prob + random_token_prob)
    random_ids = random_non_special_ids(
        rng.uniform(seed, rng.STREAM_RANDOM_TOKEN, sample, pos), vocab_size, special_ids
    )
    generator_input = torch.where(to_mask, torch.full_like(input_ids, mask_id), input_ids)
    generator_input = torch.where(to_random, random_ids, generator_input)
    return MaskedBatch(generator_input=generator_input, masked=masked)
