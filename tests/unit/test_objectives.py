"""Masking, labels, loss normalisation and the sampler (pure torch, one process)."""
from __future__ import annotations

import math

import pytest
import torch

from rtd_scale.objectives.losses import (
    micro_batch_normaliser,
    replaced_labels,
    rtd_loss,
    total_loss,
)
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


def test_correct_sample_is_labelled_original():
    """A sampled id equal to the original counts as original (0)."""
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
    """Padded positions contribute nothing, even when their logits are inf/nan."""
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


def test_micro_batch_normaliser_by_hand():
    """count / (accumulation × DP) per loss; a global count of 0 divides as 1."""
    got = micro_batch_normaliser(torch.tensor([6, 30]), 4)
    assert got.dtype == torch.float32 and got.tolist() == [1.5, 7.5]
    assert micro_batch_normaliser(torch.tensor([0, 3]), 2).tolist() == [0.5, 1.5]


def test_rtd_loss_over_the_global_batch_by_hand():
    """Two micro-batches of one global batch, 1 and 3 non-pad tokens, label 0: logit 0 costs
    ln 2, logit ln(e − 1) costs softplus = 1. With the global normaliser 4 tokens / 2
    micro-batches = 2, the mean of the two micro-batch losses (what accumulation averages) is
    the global mean (ln 2 + 3) / 4, not the mean of the micro-batch means (ln 2 + 1) / 2."""
    one = math.log(math.e - 1)
    a_logits, a_valid = torch.tensor([[0.0, 5.0]]), torch.tensor([[True, False]])
    b_logits, b_valid = torch.tensor([[one, one, one]]), torch.ones(1, 3, dtype=torch.bool)
    norm = micro_batch_normaliser(torch.tensor([0, 4]), 2)[1]
    a = rtd_loss(a_logits, torch.zeros(1, 2), a_valid, norm)
    b = rtd_loss(b_logits, torch.zeros(1, 3), b_valid, norm)
    assert a.item() == pytest.approx(math.log(2) / 2, rel=1e-6)
    assert b.item() == pytest.approx(1.5, rel=1e-6)
    assert ((a + b) / 2).item() == pytest.approx((math.log(2) + 3) / 4, rel=1e-6)
    # without a normaliser each micro-batch is its own global batch (its mean)
    assert rtd_loss(b_logits, torch.zeros(1, 3), b_valid).item() == pytest.approx(1.0, rel=1e-6)


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


# --- static-shape masking and the two-level sampler --------------------------------------------

def test_masking_selects_a_fixed_count_per_sample_within_the_budget():
    """Exactly max(1, round(p · m)) of a sample's m maskable positions (none when m = 0), never
    more than prediction_budget(p, s), so the MLM head's [b, budget] rows hold every one."""
    from rtd_scale.objectives.masking import masked_positions, prediction_budget

    ids = _batch(b=6, s=128)
    ids[1, 40:] = 0  # padded sample: 38 maskable
    ids[2, 1:-1] = 4  # nothing maskable but [MASK] ids... which are special: m = 0
    ids[3, 20] = 2  # a [SEP] inside
    m = _mask(ids, torch.arange(6))
    maskable = ~torch.isin(ids, torch.tensor(SPECIAL))
    counts = m.masked.sum(1).tolist()
    expected = [max(1, math.floor(0.15 * k + 0.5)) if k else 0 for k in maskable.sum(1).tolist()]
    assert counts == expected == [19, 6, 0, 19, 19, 19]
    assert prediction_budget(0.15, 128) == 19 and max(counts) <= 19
    assert not (m.masked & ~maskable).any()
    positions, valid = masked_positions(m.masked, 19)
    assert positions.shape == valid.shape == (6, 19)
    assert valid.sum(1).tolist() == counts
    for r in range(6):
        got = positions[r][valid[r]].tolist()
        assert got == sorted(got) == torch.nonzero(m.masked[r]).view(-1).tolist()


def test_masked_selection_is_uniform_over_positions():
    """Every maskable position is selected with the same frequency: 8 of 30 (round(0.25 · 30)),
    each within 5 standard deviations (0.016) over 20,000 samples."""
    ids = _batch(b=20_000, s=32)
    m = _mask(ids, torch.arange(20_000), mask_prob=0.25)
    assert (m.masked.sum(1) == 8).all()
    per_position = m.masked[:, 1:-1].double().mean(0)  # 30 maskable positions
    assert (per_position - 8 / 30).abs().max().item() < 0.016


def test_hash_keys_folds_python_ints_like_tensors():
    from rtd_scale.objectives import counter_rng as rng

    t = torch.tensor([0, 5, 2**40 + 3, -7])
    for seed in (0, 1234, 2**33 + 1):
        assert torch.equal(rng.hash_keys(seed, rng.STREAM_MASK, t),
                           rng.hash_keys(torch.tensor(seed), torch.tensor(rng.STREAM_MASK), t))


def _block_case(v_padded=512, v_real=500):
    g = torch.Generator().manual_seed(1)
    logits_row = torch.randn(v_padded, generator=g) * 1.5
    logits_row[300:310] += 4.0  # a heavy block
    sampleable = torch.arange(v_padded) < v_real
    sampleable[:5] = False
    return logits_row, sampleable


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_two_level_sampler_matches_softmax(temperature):
    """Shards of whole 128-id blocks take the two-level path: 20,000 draws match
    softmax(logits / T) within 0.01 per id; specials and padded ids never appear."""
    logits_row, sampleable = _block_case()
    n = 20_000
    ids = sample_from_logits(logits_row.expand(n, -1), seed=3, step=11,
                             sample_index=torch.arange(n) // 128, position=torch.arange(n) % 128,
                             vocab_start=0, sampleable=sampleable, temperature=temperature)
    p = torch.softmax((logits_row / temperature).masked_fill(~sampleable, float("-inf")), -1)
    emp = torch.bincount(ids, minlength=512).double() / n
    assert (emp - p.double()).abs().max().item() < 0.01
    # the first stage: each 128-id block's mass
    assert (emp.view(4, 128).sum(1) - p.double().view(4, 128).sum(1)).abs().max().item() < 0.01
    assert sampleable[ids].all()


def test_two_level_sampler_disallow_and_bf16():
    logits_row, sampleable = _block_case()
    n = 4000
    args = dict(seed=1, step=0, sample_index=torch.arange(n), position=torch.zeros(n, dtype=torch.long),
                vocab_start=0, sampleable=sampleable)
    free = sample_from_logits(logits_row.expand(n, -1), **args)
    original = free.clone()  # forbid exactly what was drawn
    banned = sample_from_logits(logits_row.expand(n, -1), disallow_ids=original, **args)
    assert not (banned == original).any() and sampleable[banned].all()
    half = sample_from_logits(logits_row.to(torch.bfloat16).expand(n, -1), **args)
    assert sampleable[half].all()
    # bf16 rounding moves only a few draws
    assert (half != free).double().mean().item() < 0.05


def test_sampler_is_a_function_of_each_rows_keys():
    """Rows drawn alone, in another order or in another batch get the same ids (the noise is
    keyed by (seed, step, sample, position, id), nothing else)."""
    logits_row, sampleable = _block_case()
    g = torch.Generator().manual_seed(2)
    logits = logits_row + torch.randn(64, 512, generator=g)
    sample, pos = torch.arange(64) // 8, torch.arange(64) % 8 * 3
    args = dict(seed=9, step=4, vocab_start=0, sampleable=sampleable)
    full = sample_from_logits(logits, sample_index=sample, position=pos, **args)
    perm = torch.randperm(64, generator=g)
    shuffled = sample_from_logits(logits[perm], sample_index=sample[perm], position=pos[perm],
                                  **args)
    assert torch.equal(shuffled, full[perm])
    one = sample_from_logits(logits[5:6], sample_index=sample[5:6], position=pos[5:6], **args)
    assert one.item() == full[5].item()
    other_step = sample_from_logits(logits, sample_index=sample, position=pos,
                                    **{**args, "step": 5})
    assert not torch.equal(other_step, full)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_two_level_sampler_on_cuda_agrees_with_cpu_and_never_synchronises():
    """The GPU path draws what the CPU path draws (up to last-bit differences of exp/log in a
    near tie), matches softmax, and makes the host wait for nothing."""
    logits_row, sampleable = _block_case()
    n = 20_000
    keys = dict(seed=3, step=11, sample_index=torch.arange(n) // 128,
                position=torch.arange(n) % 128, vocab_start=0)
    cpu = sample_from_logits(logits_row.expand(n, -1), sampleable=sampleable, **keys)
    dev = torch.device("cuda")
    gpu_keys = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in keys.items()}
    logits, allowed = logits_row.to(dev).expand(n, -1), sampleable.to(dev)
    original = (torch.arange(n, device=dev) % 400) + 5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = sample_from_logits(logits, sampleable=allowed, **gpu_keys)
        banned = sample_from_logits(logits.bfloat16(), sampleable=allowed,
                                    disallow_ids=original, **gpu_keys)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (gpu.cpu() == cpu).double().mean().item() > 0.999
    p = torch.softmax(logits_row.masked_fill(~sampleable, float("-inf")), -1)
    emp = torch.bincount(gpu.cpu(), minlength=512).double() / n
    assert (emp - p.double()).abs().max().item() < 0.01
    assert not (banned == original).any() and allowed[banned].all()
