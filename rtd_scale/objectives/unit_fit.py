"""Whether whole-word and span masking can reach ``mask_prob`` on the run's text, measured at start.

``mask_tokens`` gives a sample round(mask_prob · s) + ``UNIT_SLACK_TOKENS`` MLM slots and drops a
unit (word or span) that would pass them (``masking.select_units``). On space-separated text
(English: ~2.3 pieces per word with a 1,000-piece vocabulary) that drops almost nothing. On text without spaces
(Chinese, Japanese) a SentencePiece model marks a word start ("▁") only where the input had a space,
so a "word" is a whole clause or document: at s = 64 the CJK case in ``tests/data/cases`` has
words of ~50 tokens against 18 slots, and ``whole_word`` masks 0.2% of tokens instead of 15%
(``tests/unit/test_unit_fit.py``). Training would go on silently with almost no MLM signal.

``measure_unit_fit`` runs the run's own masking (same seed, same sample indices) over the first
training samples on the host, before training; ``unit_fit_warning`` turns a masked fraction well
below mask_prob into one line naming the measured numbers and the fix (``--mask-strategy token``,
or text pre-segmented into space-separated words).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from rtd_scale.config import MaskStrategy, RTDConfig
from rtd_scale.objectives.masking import mask_tokens, prediction_budget, word_starts

# Tokens measured at start (CHECK_TOKENS // s samples, 16 … 256 of them): the masked fraction of
# English then has a standard error under 0.005 (systematic sampling keeps each sample within one
# unit of mask_prob · m), and the check takes about a second of host time.
CHECK_TOKENS = 32768


def check_samples(seq_length: int) -> int:
    """Samples ``warn_if_units_overflow`` measures at sequence length ``seq_length``."""
    return max(16, min(256, CHECK_TOKENS // seq_length))


# Warn below this share of mask_prob. On English (tests/data/wiki_sample.jsonl) the measured
# fraction is mask_prob within 0.015 at s = 64, 128 and 512 for both strategies
# (tests/unit/test_unit_fit.py::test_english_reaches_mask_prob_and_gives_no_warning), so 0.8
# never fires there; the CJK case measures below 0.07 of mask_prob.
WARN_BELOW_SHARE = 0.8


@dataclass(frozen=True)
class UnitFit:
    """What ``mask_tokens`` did to the measured samples.

    Attributes:
        strategy: the mask strategy measured.
        samples: how many samples; seq_length: their length s.
        mask_prob: the fraction asked for.
        masked_fraction: masked tokens / maskable tokens.
        mean_word_tokens: maskable tokens / words (word starts, ``masking.word_starts``).
        slots: MLM slots per sample, ``prediction_budget(mask_prob, s, strategy)``.
        empty_fraction: share of samples (with a maskable token) that mask nothing.
        dropped_fraction: share of samples in which the slots dropped a chosen unit.
    """

    strategy: MaskStrategy
    samples: int
    seq_length: int
    mask_prob: float
    masked_fraction: float
    mean_word_tokens: float
    slots: int
    empty_fraction: float
    dropped_fraction: float


def measure_unit_fit(input_ids: torch.Tensor, sample_index: torch.Tensor, rtd: RTDConfig, *,
                     seed: int, vocab_size: int, mask_id: int, special_ids: Sequence[int],
                     word_start_table: torch.Tensor | np.ndarray) -> UnitFit:
    """Mask ``input_ids`` exactly as the run will (``mask_tokens`` with ``rtd``'s settings) and
    measure the result, on the host.

    Args:
        input_ids: [n, s] int64; sample_index: [n] int64 their global sample indices.
        rtd: the run's ``RTDConfig`` (mask_prob, mask_strategy, span settings).
        seed, vocab_size, mask_id, special_ids: as the run passes them to ``mask_tokens``.
        word_start_table: [V] bool (``Tokenizer.word_start_table``).
    Returns:
        UnitFit.
    """
    table = torch.as_tensor(word_start_table, dtype=torch.bool)
    strategy = rtd.mask_strategy

    def mask(unit_budget=None):
        return mask_tokens(input_ids, sample_index, seed=seed, mask_prob=rtd.mask_prob,
                           mask_token_prob=rtd.mask_token_prob,
                           random_token_prob=rtd.random_token_prob, mask_id=mask_id,
                           vocab_size=vocab_size, special_ids=special_ids, strategy=strategy,
                           word_start_table=table, span_geometric_p=rtd.span_geometric_p,
                           span_max_words=rtd.span_max_words, unit_budget=unit_budget).masked

    masked = mask()  # what the run masks
    unbounded = mask(unit_budget=input_ids.shape[1]) if strategy is not MaskStrategy.TOKEN \
        else masked  # the same choice of units with no slot limit
    maskable = ~torch.isin(input_ids, torch.as_tensor(list(special_ids), dtype=input_ids.dtype))
    m = maskable.sum(1)
    words = word_starts(input_ids, maskable, table).sum().item()
    has = m > 0
    return UnitFit(strategy=strategy, samples=input_ids.shape[0], seq_length=input_ids.shape[1],
                   mask_prob=rtd.mask_prob,
                   masked_fraction=masked.sum().item() / max(1, m.sum().item()),
                   mean_word_tokens=m.sum().item() / max(1, words),
                   slots=prediction_budget(rtd.mask_prob, input_ids.shape[1], strategy),
                   empty_fraction=((masked.sum(1) == 0) & has).sum().item()
                   / max(1, has.sum().item()),
                   dropped_fraction=(unbounded & ~masked).any(1).double().mean().item())


def unit_fit_warning(fit: UnitFit) -> str | None:
    """One line when ``fit.masked_fraction`` is below ``WARN_BELOW_SHARE`` · mask_prob (the
    measured numbers, why, and the fix); None otherwise."""
    if fit.strategy is MaskStrategy.TOKEN or fit.masked_fraction >= WARN_BELOW_SHARE * fit.mask_prob:
        return None
    unit = "word" if fit.strategy is MaskStrategy.WHOLE_WORD else "span"
    slack = fit.slots - max(1, int(fit.mask_prob * fit.seq_length + 0.5))
    return (f"--mask-strategy {fit.strategy.value} masks {fit.masked_fraction:.1%} of the "
            f"maskable tokens of the first {fit.samples} training samples, not --mask-prob "
            f"{fit.mask_prob:g}: their words average {fit.mean_word_tokens:.1f} tokens against "
            f"{fit.slots} MLM slots per sample (round(mask_prob · {fit.seq_length}) + {slack}), "
            f"so a chosen {unit} that does not fit is dropped ({fit.empty_fraction:.0%} of "
            "samples mask nothing). The tokenizer marks few word starts, as on text without "
            "spaces (Chinese, Japanese); use --mask-strategy token, or pre-segment the text "
            "into space-separated words before training the tokenizer")


def warn_if_units_overflow(rtd: RTDConfig, train_data, tokenizer, *, seed: int,
                           samples: int | None = None) -> UnitFit | None:
    """Measure the first ``samples`` training samples (default ``check_samples(s)``;
    ``train_data[k]`` for k = 0 … samples − 1 of a ``BlendedDataset``: the run's first samples
    and their mask keys) and ``warnings.warn`` the line of ``unit_fit_warning`` if any. Nothing
    for ``--mask-strategy token``.

    Returns:
        the UnitFit measured, or None for the token strategy.
    """
    if rtd.mask_strategy is MaskStrategy.TOKEN:
        return None
    n = check_samples(train_data.seq_length) if samples is None else samples
    batch = train_data[np.arange(n, dtype=np.int64)]
    fit = measure_unit_fit(batch.input_ids, batch.sample_index, rtd, seed=seed,
                           vocab_size=tokenizer.vocab_size, mask_id=tokenizer.mask_id,
                           special_ids=tokenizer.special_ids,
                           word_start_table=tokenizer.word_start_table())
    line = unit_fit_warning(fit)
    if line:
        warnings.warn(line, stacklevel=2)
    return fit
