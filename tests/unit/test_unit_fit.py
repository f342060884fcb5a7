"""The start-up check of whole-word and span masking (``objectives/unit_fit.py``): on text without
spaces a SentencePiece word is a clause, longer than the MLM slots, so the masked fraction falls
far below mask_prob and the run warns once, in one line, naming the fix; on space-separated
English it reaches mask_prob and says nothing."""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import MaskStrategy, RTDConfig
from rtd_scale.data.blend import build_split
from rtd_scale.data.tokenizer import Tokenizer
from rtd_scale.objectives.unit_fit import (WARN_BELOW_SHARE, UnitFit, check_samples,
                                           measure_unit_fit, unit_fit_warning,
                                           warn_if_units_overflow)
from tests.helpers.env import REPO
from rtd_scale.cli_errors import EXIT_USER_ERROR


def _train(prefix: str, seq_length: int):
    """The training split as pretrain.py builds it (default --split, seed 1234)."""
    return build_split([(1.0, [prefix])], seq_length=seq_length, split=(969, 30, 1), part=0,
                       seed=1234)


def _mean_word_tokens(tok: Tokenizer, ids: np.ndarray) -> float:
    """Tokens per word by the SentencePiece rule itself (not the table): a piece starting with
    "▁" begins a word, and so does the first non-special token of a sample or after a special."""
    specials, tokens, words = set(tok.special_ids), 0, 0
    for row in ids.tolist():
        prev_special = True
        for i in row:
            if i in specials:
                prev_special = True
                continue
            tokens += 1
            words += prev_special or tok.id_to_piece(i).startswith("▁")
            prev_special = False
    return tokens / words


@pytest.mark.parametrize("strategy, slots, slack", [("whole_word", 18, 8), ("span", 34, 24)])
def test_text_without_spaces_overflows_the_slots_and_warns_once(cjk_shards, strategy, slots,
                                                                slack):
    """The CJK case at s = 64: words of ~50 tokens against 18 (whole words) or 34 (spans) slots;
    the first 256 training samples mask under 1% of tokens (0.2% and 0.1% measured) instead of
    15%, nearly every sample masks nothing, and one warning line gives those numbers and the
    fix. The token strategy on the same samples masks 15%."""
    tok_path, prefix = cjk_shards
    tok = Tokenizer(tok_path)
    data = _train(prefix, 64)
    rtd = RTDConfig(mask_strategy=strategy)
    with pytest.warns(UserWarning) as record:
        fit = warn_if_units_overflow(rtd, data, tok, seed=1234)
    assert fit.samples == check_samples(64) == 256 and fit.slots == slots
    assert fit.masked_fraction < 0.01
    assert fit.empty_fraction > 0.95
    assert fit.dropped_fraction > 0.05  # the chosen words were dropped, not never chosen
    ids = data[np.arange(256)].input_ids.numpy()
    assert fit.mean_word_tokens == pytest.approx(_mean_word_tokens(tok, ids), rel=1e-9)
    assert 40 < fit.mean_word_tokens < 60

    lines = [str(w.message) for w in record if "MLM slots" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0] == (
        f"--mask-strategy {strategy} masks {fit.masked_fraction:.1%} of the maskable tokens of "
        f"the first 256 training samples, not --mask-prob 0.15: their words average "
        f"{fit.mean_word_tokens:.1f} tokens against {slots} MLM slots per sample "
        f"(round(mask_prob · 64) + {slack}), so a chosen "
        f"{'word' if strategy == 'whole_word' else 'span'} that does not fit is dropped "
        f"({fit.empty_fraction:.0%} of samples mask nothing). The tokenizer marks few word "
        "starts, as on text without spaces (Chinese, Japanese); use --mask-strategy token, or "
        "pre-segment the text into space-separated words before training the tokenizer")

    batch = data[np.arange(256)]
    token = measure_unit_fit(batch.input_ids, batch.sample_index, RTDConfig(), seed=1234,
                             vocab_size=tok.vocab_size, mask_id=tok.mask_id,
                             special_ids=tok.special_ids, word_start_table=tok.word_start_table())
    assert abs(token.masked_fraction - 0.15) < 0.005 and token.empty_fraction == 0.0
    assert unit_fit_warning(token) is None
    assert warn_if_units_overflow(RTDConfig(), data, tok, seed=1234) is None


@pytest.mark.parametrize("seq_length", [64, 128, 512])
@pytest.mark.parametrize("strategy", ["whole_word", "span"])
def test_english_reaches_mask_prob_and_gives_no_warning(wiki_shards, strategy, seq_length):
    """Space-separated English (tests/data/wiki_sample.jsonl, 1,000 pieces, ~2.3 tokens per word):
    the masked fraction of the checked samples is mask_prob within 0.015, the slots drop a unit
    in under 1% of samples, and nothing is warned (warnings are errors here)."""
    tok_path, prefix = wiki_shards
    tok = Tokenizer(tok_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = warn_if_units_overflow(RTDConfig(mask_strategy=strategy),
                                     _train(prefix, seq_length), tok, seed=1234)
    assert fit.samples == {64: 256, 128: 256, 512: 64}[seq_length]
    assert abs(fit.masked_fraction - 0.15) < 0.015, fit
    assert fit.dropped_fraction < 0.01, fit
    assert 2.0 < fit.mean_word_tokens < 2.6, fit


def test_warning_threshold_is_a_share_of_mask_prob():
    """At WARN_BELOW_SHARE · mask_prob nothing is said; just below it the line names the
    measured numbers; the token strategy never warns."""
    fit = UnitFit(strategy=MaskStrategy.WHOLE_WORD, samples=256, seq_length=128, mask_prob=0.3,
                  masked_fraction=WARN_BELOW_SHARE * 0.3, mean_word_tokens=12.25, slots=46,
                  empty_fraction=0.25, dropped_fraction=0.5)
    assert unit_fit_warning(fit) is None
    low = dataclasses.replace(fit, masked_fraction=0.2)
    assert unit_fit_warning(low).startswith(
        "--mask-strategy whole_word masks 20.0% of the maskable tokens of the first 256 training "
        "samples, not --mask-prob 0.3: their words average 12.2 tokens against 46 MLM slots per "
        "sample (round(mask_prob · 128) + 8), so a chosen word that does not fit is dropped (25% "
        "of samples mask nothing).")
    assert unit_fit_warning(dataclasses.replace(low, strategy=MaskStrategy.TOKEN)) is None


def test_pretrain_warns_once_at_start_before_building_anything(cjk_shards, tmp_path, capsys,
                                                                monkeypatch):
    """pretrain.main on the CJK case with --mask-strategy span: the warning comes once, before
    distributed start-up (stopped there by a stand-in ``distributed.initialize``)."""
    from rtd_scale import distributed, pretrain

    def stop_here(*args, **kwargs):
        raise UserInputError("stopped after the start-up checks")

    tok_path, prefix = cjk_shards
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "initialize", stop_here)
    argv = ["--ds_config", str(REPO / "ds_configs" / "zero0.json"), "--preset", "tiny",
            "--data-path", prefix, "--tokenizer-model", tok_path, "--save", str(tmp_path / "run"),
            "--train-iters", "5", "--seq-length", "64", "--micro-batch-size", "8",
            "--global-batch-size", "8", "--mask-strategy", "span"]
    with pytest.warns(UserWarning) as record:
        assert pretrain.main(argv) == EXIT_USER_ERROR
    assert capsys.readouterr().err.strip() == "error: stopped after the start-up checks"
    found = [w for w in record if "MLM slots" in str(w.message)]
    assert len(found) == 1, [str(w.message) for w in record]
    lines = [str(found[0].message)]
    assert lines[0].startswith("--mask-strategy span masks 0.")
    assert "34 MLM slots per sample (round(mask_prob · 64) + 24)" in lines[0]
    assert "use --mask-strategy token, or pre-segment the text" in lines[0]
    # attributed to run.py (run.check_before_start), a file of the package:
    # cli_errors.one_line_warnings shows it as one "warning: …" line when pretrain.py runs as a
    # program
    assert found[0].filename.endswith("rtd_scale/run.py")
