"""Masking, labels, loss normalisation and the sampler (pure torch, one process)."""
from __future__ import annotations

import math

import pytest
import torch

from rtd_scale.objectives.losses import replaced_labels, rtd_loss, total_loss
from rtd_scale.objectives.masking import mask_tokens, random_non_special_ids
from rtd_scale.objectives.sampling import sample_from_logits

SPECIAL = (0, 1, 2, 3, 4)
V = 1000


def _batch(b=64, s=128, pad_from=None):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, V, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    if pad_from is not None:
        ids[:, pad_from:] = 0
    return ids


def _mask(ids, sample_index, seed=7, **kw):
    args = dict(seed=seed, mask_prob=0.15, mask_token_prob=0.8, random_token_prob=0.1,
                mask_id=4, vocab_size=V, special_ids=SPECIAL)
    args.update(kw)
    return mask_tokens(ids, sample_index, **args)


def test_special_tokens_never_masked_and_rate_and_split():
    ids = _batch(pad_from=100)
    ids[:, 50] = 2  # a [SEP] between documents
    m = _mask(ids, torch.arange(ids.shape[0]), mask_prob=0.5)
    for sid in (0, 1, 2):
        assert not m.masked[ids == sid].any()
    maskable = (ids > 4)
    rate = m.masked.sum().item() / maskable.sum().item()
    assert abs(rate - 0.5) < 0.02
    got = m.generator_input[m.masked]
    orig = ids[m.masked]
    frac_mask = (got == 4).float().mean().item()
    frac_keep = (got == orig).float().mean().item()
    assert abs(frac_mask - 0.8) < 0.03
    # kept ≈ 10%, plus random draws that hit the original (1/995 of 10%)
    assert abs(frac_keep - 0.1) < 0.03
    # random replacements are never special ids
    assert not torch.isin(got, torch.tensor([0, 1, 2, 3])).any()
    # unmasked positions are untouched
    assert torch.equal(m.generator_input[~m.masked], ids[~m.masked])


def test_mask_is_pure_function_of_seed_and_sample_index():
    ids = _batch(b=8)
    a = _mask(ids, torch.arange(100, 108))
    # same samples in another order, inside another batch: identical rows
    perm = torch.tensor([3, 1, 7, 0, 2, 6, 5, 4])
    b = _mask(ids[perm], torch.arange(100, 108)[perm])
    assert torch.equal(a.masked[perm], b.masked)
    assert torch.equal(a.generator_input[perm], b.generator_input)
    # another sample index or seed: different mask
    c = _mask(ids, torch.arange(200, 208))
    d = _mask(ids, torch.arange(100, 108), seed=8)
    assert not torch.equal(a.masked, c.masked)
    assert not torch.equal(a.masked, d.masked)


def test_random_non_special_ids_cover_exactly_the_non_special_ids():
    u = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000
    ids = random_non_special_ids(u, 12, (0, 3, 11))
    assert sorted(set(ids.tolist())) == [1, 2, 4, 5, 6, 7, 8, 9, 10]
    counts = torch.bincount(ids, minlength=12)[[1, 2, 4, 5, 6, 7, 8, 9, 10]]
    assert counts.min() >= 1100 and counts.max() <= 1123


def test_c01_correct_sample_is_labelled_original():
    """C01: a sampled id equal to the original counts as original (0)."""
    original = torch.tensor([[1, 10, 11, 12, 13, 2]])
    masked = torch.tensor([[False, True, True, True, False, False]])
    corrupted = original.clone()
    corrupted[0, 1] = 10  # the generator guessed right
    corrupted[0, 2] = 99  # wrong guess
    corrupted[0, 3] = 12  # right again
    labels = replaced_labels(corrupted, original)
    assert labels.tolist() == [[0.0, 0.0, 1.0, 0.0, 0.0, 0.0]]
    assert torch.equal(labels, (corrupted != original).float())
    # replaced fraction counts only real changes: 1 of 3 masked, 1 of 6 tokens
    assert labels[masked].sum().item() == 1.0
    assert labels.mean().item() == pytest.approx(1 / 6)


def test_rtd_loss_ignores_padding_exactly():
    """C03/C22: padded positions contribute nothing, even when their logits are inf/nan."""
    logits = torch.tensor([[2.0, -1.0, 0.5, float("nan"), float("inf")]])
    labels = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]])
    valid = torch.tensor([[True, True, True, False, False]])
    loss = rtd_loss(logits, labels, valid)
    sp = lambda x: math.log1p(math.exp(x))  # noqa: E731 — softplus
    expected = (sp(-2.0) + sp(-1.0) + sp(-0.5)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    logits.requires_grad_(True)
    rtd_loss(logits, labels, valid).backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 3:].abs().sum().item() == 0.0
    assert rtd_loss(logits, labels, torch.zeros_like(valid)).item() == 0.0


def test_total_loss_weights_rtd_by_lambda():
    assert total_loss(torch.tensor(2.0), torch.tensor(0.5), 50.0).item() == 27.0


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampler_matches_softmax(temperature):
    """Gumbel-max with counter noise draws from softmax(logits / T); specials and padded ids
    never appear."""
    v_real, v_padded = 20, 24
    logits_row = torch.linspace(-2.0, 2.0, v_padded)
    sampleable = torch.arange(v_padded) < v_real
    sampleable[:5] = False
    n = 20_000
    ids = sample_from_logits(logits_row.expand(n, -1), seed=3, step=11,
                             sample_index=torch.arange(n) // 128, position=torch.arange(n) % 128,
                             vocab_start=0, sampleable=sampleable, temperature=temperature)
    p = torch.softmax((logits_row / temperature).masked_fill(~sampleable, float("-inf")), -1)
    emp = torch.bincount(ids, minlength=v_padded).double() / n
    assert (emp - p.double()).abs().max().item() < 0.01
    assert not torch.isin(ids, torch.tensor([0, 1, 2, 3, 4, 20, 21, 22, 23])).any()


def test_sampler_disallow_correct_and_never_argmax():
    n, v = 5000, 16
    logits = torch.zeros(n, v)
    logits[:, 7] = 3.0  # the argmax, but not always sampled
    original = torch.full((n,), 7)
    sampleable = torch.ones(v, dtype=torch.bool)
    args = dict(seed=1, step=0, sample_index=torch.arange(n), position=torch.zeros(n, dtype=torch.long),
                vocab_start=0, sampleable=sampleable)
    free = sample_from_logits(logits, **args)
    frac7 = (free == 7).double().mean().item()
    p7 = math.exp(3) / (math.exp(3) + 15)
    assert abs(frac7 - p7) < 0.02
    banned = sample_from_logits(logits, disallow_ids=original, **args)
    assert not (banned == 7).any()
    # the same keys give the same draws (counter-based noise)
    assert torch.equal(free, sample_from_logits(logits, **args))
