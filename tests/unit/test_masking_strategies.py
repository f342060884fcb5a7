"""Whole-word and span masking (``--mask-strategy``): the masked fraction, whole words never split,
SpanBERT's span lengths, masks as a pure function of (seed, sample index, position), the static
budget, no host synchronisation, the tokenizer's word-start tables, and the token strategy
unchanged bit for bit."""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from rtd_scale.config import ConfigError, MaskStrategy, RTDConfig
from rtd_scale.presets import preset
from rtd_scale.data.packed import PackedDataset
from rtd_scale.data.tokenizer import Tokenizer, TokenizerModelError
from rtd_scale.objectives.masking import (expected_span_length, mask_tokens, masked_positions,
                                          prediction_budget, span_lengths, span_starts,
                                          word_starts)
from tests.helpers import byo_tokenizers as byo

P = 0.15


@pytest.fixture(scope="module")
def wiki(wiki_shards):
    """(tokenizer, word-start table [V] bool, packed samples [n, 128] of real English text)."""
    model, prefix = wiki_shards
    tok = Tokenizer(model)
    ds = PackedDataset([prefix], seq_length=128)
    ids = torch.from_numpy(np.stack([ds[i] for i in range(len(ds))]))
    return tok, torch.from_numpy(tok.word_start_table()), ids


def _mask(tok, table, ids, sample_index, strategy, seed=7, **kw):
    return mask_tokens(ids, sample_index, seed=seed, mask_prob=kw.pop("mask_prob", P),
                       mask_token_prob=0.8, random_token_prob=0.1, mask_id=tok.mask_id,
                       vocab_size=tok.vocab_size, special_ids=tok.special_ids,
                       strategy=MaskStrategy(strategy), word_start_table=table, **kw)


def _maskable(tok, ids):
    return ~torch.isin(ids, torch.tensor(tok.special_ids))


def _words(tok, row: list[int]) -> list[list[int]]:
    """The words of a sample by the SentencePiece rule itself (not the table): a piece starting
    with "▁" begins a word, special ids separate words; lists of positions."""
    words, current = [], []
    for pos, i in enumerate(row):
        if i in tok.special_ids:
            current = []
            continue
        if not current or tok.id_to_piece(i).startswith("▁"):
            current = [pos]
            words.append(current)
        else:
            current.append(pos)
    return words


@pytest.mark.parametrize("strategy", ["whole_word", "span"])
def test_masked_fraction_is_mask_prob_in_expectation(wiki, strategy):
    """Over repeated passes of 575 real samples the masked fraction is mask_prob within four
    standard errors of the estimate (computed from the per-sample deviations, and below 0.002
    so the check has power); no sample passes the static budget."""
    tok, table, ids = wiki
    maskable = _maskable(tok, ids)
    n = ids.shape[0]
    for p, passes in ((P, 4), (0.3, 2)):
        masked = torch.cat([_mask(tok, table, ids, torch.arange(n) + r * n, strategy,
                                  mask_prob=p).masked for r in range(passes)])
        m = maskable.sum(1).repeat(passes).double()
        deviation = masked.sum(1).double() - p * m  # per sample: masked − mask_prob · m
        error = deviation.std().item() * math.sqrt(len(m)) / m.sum().item()
        fraction = masked.sum().item() / m.sum().item()
        assert error < 0.002 and abs(fraction - p) < 4 * error, (p, fraction, error)
        assert masked.sum(1).max().item() <= prediction_budget(p, 128, strategy)
        assert not (masked & ~maskable.repeat(passes, 1)).any()


@pytest.mark.parametrize("strategy", ["whole_word", "span"])
def test_whole_words_are_never_split(wiki, strategy):
    tok, table, ids = wiki
    rows = ids[:60]
    masked = _mask(tok, table, rows, torch.arange(60), strategy).masked
    checked = 0
    for r in range(rows.shape[0]):
        for word in _words(tok, rows[r].tolist()):
            state = masked[r, word]
            assert state.all() or not state.any(), (r, word, state)
            checked += int(state.any())
    assert checked > 200  # many masked words, several of more than one token
    assert (masked.sum().item() > checked)


def test_span_lengths_follow_the_truncated_geometric_distribution(wiki):
    """SpanBERT (arXiv 1907.10529 §3.1): P(l) ∝ p(1-p)^(l-1), l = 1..10, p = 0.2, mean 3.8 words."""
    q, n = 0.8, 10
    closed = (1 - (n + 1) * q ** n + n * q ** (n + 1)) / (1 - q) ** 2 / ((1 - q ** n) / (1 - q))
    assert expected_span_length(0.2, 10) == pytest.approx(closed, rel=1e-12)
    assert round(closed, 1) == 3.8
    u = (torch.arange(200_000, dtype=torch.float64) + 0.5) / 200_000  # a quadrature of (0, 1)
    lengths = span_lengths(u, 0.2, 10)
    freq = torch.bincount(lengths, minlength=11)[1:].double() / len(u)
    expected = torch.tensor([0.2 * q ** (k - 1) for k in range(1, 11)], dtype=torch.float64)
    assert torch.allclose(freq, expected / expected.sum(), atol=1e-4)

    # the tiling: span lengths in words between consecutive span starts of long rows of words
    starts = torch.ones((32, 4096), dtype=torch.bool)
    spans = span_starts(starts, torch.arange(32).view(-1, 1), seed=3, geometric_p=0.2, max_words=10)
    lengths = torch.cat([torch.diff(torch.nonzero(row).view(-1)) for row in spans]).double()
    assert len(lengths) > 30_000  # standard error of the mean ≈ 0.015
    assert abs(lengths.mean().item() - closed) < 0.05, lengths.mean().item()

    # real samples: a span is cut short at the sample's end (that one is left out here, so the
    # rest are slightly shorter on average: the cut one is the size-biased one)
    tok, table, ids = wiki
    maskable = _maskable(tok, ids)
    starts = word_starts(ids, maskable, table)
    spans = span_starts(starts, torch.arange(ids.shape[0]).view(-1, 1), seed=3,
                        geometric_p=0.2, max_words=10)
    word = starts.long().cumsum(1) - 1
    lengths = []
    for r in range(ids.shape[0]):
        first_words = word[r][spans[r]].tolist()
        lengths += [b - a for a, b in zip(first_words, first_words[1:])]  # the last is cut short
    assert len(lengths) > 3000 and min(lengths) == 1 and max(lengths) == 10
    assert abs(np.mean(lengths) - closed) < 0.2, np.mean(lengths)

    # the spans chosen are a uniform choice among them: their mean length is the same
    masked = _mask(tok, table, ids, torch.arange(ids.shape[0]), "span", seed=3).masked
    chosen = []
    for r in range(ids.shape[0]):
        first = word[r][spans[r]].tolist()
        ends = first[1:] + [int(word[r].max()) + 1]
        taken = masked[r][spans[r]].tolist()  # a span is chosen iff its first token is masked
        chosen += [b - a for a, b, t in list(zip(first, ends, taken))[:-1] if t]
    assert len(chosen) > 500 and abs(np.mean(chosen) - np.mean(lengths)) < 0.25, np.mean(chosen)


@pytest.mark.parametrize("strategy", ["whole_word", "span"])
def test_mask_is_a_pure_function_of_seed_sample_and_position(wiki, strategy):
    """A sample gets the same mask alone, inside another batch, at another place in it, and
    when another rank's share of the batch is computed elsewhere."""
    tok, table, ids = wiki
    rows, index = ids[:8], torch.arange(500, 508)
    together = _mask(tok, table, rows, index, strategy)
    for r in range(8):
        alone = _mask(tok, table, rows[r:r + 1], index[r:r + 1], strategy)
        assert torch.equal(alone.masked[0], together.masked[r])
        assert torch.equal(alone.generator_input[0], together.generator_input[r])
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    shuffled = _mask(tok, table, torch.cat([ids[40:44], rows[perm]]),
                     torch.cat([torch.arange(4), index[perm]]), strategy)
    assert torch.equal(shuffled.masked[4:], together.masked[perm])
    halves = [_mask(tok, table, rows[h::2], index[h::2], strategy) for h in (0, 1)]  # two "ranks"
    assert torch.equal(halves[0].masked, together.masked[0::2])
    assert torch.equal(halves[1].masked, together.masked[1::2])
    # another seed or another sample index gives another mask
    assert not torch.equal(_mask(tok, table, rows, index, strategy, seed=8).masked, together.masked)
    assert not torch.equal(_mask(tok, table, rows, index + 8, strategy).masked, together.masked)


def test_token_strategy_is_unchanged_bitwise():
    """The masks and generator inputs of the token strategy, pinned from before the strategies
    existed (the same digest with and without strategy="token")."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, 1000, (16, 96), generator=g)
    ids[:, 0], ids[:, -1], ids[3, 60:], ids[5, 30] = 1, 2, 0, 2
    kw = dict(seed=11, mask_prob=0.15, mask_token_prob=0.8, random_token_prob=0.1, mask_id=4,
              vocab_size=1000, special_ids=(0, 1, 2, 3, 4))
    for m in (mask_tokens(ids, torch.arange(1000, 1016), **kw),
              mask_tokens(ids, torch.arange(1000, 1016), strategy=MaskStrategy.TOKEN, **kw)):
        digest = hashlib.sha256(m.masked.numpy().tobytes() + m.generator_input.numpy().tobytes())
        assert digest.hexdigest()[:16] == "91eb7be3fa68aee4" and m.masked.sum().item() == 219
    assert prediction_budget(0.15, 512) == 77 == prediction_budget(0.15, 512, "token")
    assert prediction_budget(0.15, 512, "whole_word") == 85
    assert prediction_budget(0.15, 512, "span") == 101


def test_unit_strategies_need_the_table_and_wait_for_no_device(wiki):
    from tests.helpers.sync import SyncRecorder

    tok, table, ids = wiki
    with pytest.raises(ValueError, match="needs the tokenizer's word-start table"):
        _mask(tok, None, ids[:2], torch.arange(2), "whole_word")
    for strategy in ("whole_word", "span"):
        rec = SyncRecorder()
        with rec:
            m = _mask(tok, table, ids[:4], torch.arange(4), strategy)
        assert rec.ops == [] and m.masked.any()
        k = prediction_budget(P, 128, strategy)
        positions, valid = masked_positions(m.masked, k)
        assert valid.sum().item() == m.masked.sum().item()


def test_model_masks_with_the_configured_strategy(single_process_group, wiki):
    """RTDModel.mask passes the strategy and its table; the forward's MLM rows hold every
    masked position of the larger budget."""
    from rtd_scale import distributed
    from tests.helpers.tiny_model import build

    tok, table, ids = wiki
    cfg = preset("tiny")
    cfg.model.vocab_size = tok.vocab_size
    cfg.rtd.mask_strategy = MaskStrategy.SPAN
    cfg.validate()
    model = build(cfg, seed=5, tok=tok)  # the word-start table is the tokenizer's, as in a run
    distributed.seed_after_build(single_process_group, 5)
    rows, index = ids[:2], torch.arange(2)
    out = model(rows, index)
    expected = _mask(tok, table, rows, index, "span", seed=5)
    assert torch.equal(out.masked, expected.masked)
    assert out.counts["masked"].item() == expected.masked.sum().item() > 0
    assert math.isfinite(out.loss.item())
    assert "word_start_table" not in model.state_dict()


def test_config_refuses_unknown_strategies_and_bad_span_settings():
    assert RTDConfig().mask_strategy is MaskStrategy.TOKEN
    assert RTDConfig(mask_strategy="span").mask_strategy is MaskStrategy.SPAN  # typed when built
    for kw, message in ((dict(mask_strategy="words"), "^rtd.mask_strategy 'words': choose one "
                         "of token, whole_word, span$"),
                        (dict(span_geometric_p=0.0), "rtd.span_geometric_p must be in"),
                        (dict(span_max_words=0), "rtd.span_max_words must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            RTDConfig(**kw).validate()


def test_word_start_tables_of_each_tokenizer_kind(wiki, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok, table, _ = wiki
    assert table.shape == (tok.vocab_size,)
    piece = tok.id_to_piece
    assert all(bool(table[i]) == piece(i).startswith("▁") for i in range(5, tok.vocab_size))
    for path in (byo.wordpiece_vocab(tmp_path), byo.wordpiece_json(tmp_path)):
        wp = Tokenizer(path)
        t = wp.word_start_table()
        pieces = {wp.id_to_piece(i): bool(t[i]) for i in range(wp.vocab_size)}
        assert any(p.startswith("##") for p in pieces)
        assert all(start == (not p.startswith("##")) for p, start in pieces.items())
    texts = byo.wiki_texts(200)
    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"]
    for name, pre in (("bytelevel", pre_tokenizers.ByteLevel(add_prefix_space=True)),
                      ("metaspace", pre_tokenizers.Metaspace()),
                      ("whitespace", pre_tokenizers.Whitespace())):
        hf = HFTokenizer(models.BPE(unk_token="[UNK]"))
        hf.pre_tokenizer = pre
        hf.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
        hf.save(str(tmp_path / f"{name}.json"))
        t = Tokenizer(tmp_path / f"{name}.json")
        if name == "whitespace":
            with pytest.raises(TokenizerModelError, match="marks no word boundaries.*--mask-strategy token"):
                t.word_start_table()
            continue
        marker = "Ġ" if name == "bytelevel" else "▁"
        table_ = t.word_start_table()
        ids = t.encode("Replaced token detection trains encoders")
        starts = [bool(table_[i]) for i in ids]
        assert sum(starts) == 5 and starts[0]
        assert all(s == t.id_to_piece(i).startswith(marker) for s, i in zip(starts, ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("strategy", ["whole_word", "span"])
def test_cuda_masks_equal_cpu_masks_without_host_waits(wiki, strategy):
    """On a GPU the unit strategies give the CPU's masks bit for bit, and run without one host
    synchronisation (torch.cuda.set_sync_debug_mode("error") raises on any)."""
    tok, table, ids = wiki
    rows, index = ids[:64], torch.arange(64)
    cpu = _mask(tok, table, rows, index, strategy)
    rows, index, table = rows.cuda(), index.cuda(), table.cuda()
    _mask(tok, table, rows, index, strategy)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = _mask(tok, table, rows, index, strategy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu.masked.cpu(), cpu.masked)
    assert torch.equal(gpu.generator_input.cpu(), cpu.generator_input)
