"""The known-answer language's optimum (``verify/known_answer.py``), the scoring of a run's
dump (``verify.known_answer.score_known_answer``) and the shuffled-labels negative control
(``objectives/losses.shuffled_labels``), each against values worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rtd_scale.objectives.losses import shuffled_labels
from rtd_scale.training.diagnostics import roc_auc
from verify.known_answer import MarkovLanguage, score_known_answer, word_ids_of_tokens


@pytest.fixture(scope="module")
def lang():
    return MarkovLanguage.make(1, num_words=64, num_successors=3)


def _chain(lang, n):
    """The most likely path of n words from the most likely word."""
    t, pi = lang.transition, lang.stationary
    path = [int(pi.argmax())]
    while len(path) < n:
        path.append(int(t[path[-1]].argmax()))
    return path


def test_the_chain_and_its_entropies(lang):
    t, pi = lang.transition, lang.stationary
    assert len(set(lang.words)) == 64 and all(len(w) == 4 for w in lang.words)
    assert ((t > 0).sum(axis=1) == 3).all() and np.allclose(t.sum(axis=1), 1.0)
    assert np.allclose(pi @ t, pi, atol=1e-12) and pi.sum() == pytest.approx(1.0)
    assert lang.unigram_entropy() == pytest.approx(-(pi * np.log(pi)).sum())
    assert lang.unigram_entropy() == pytest.approx(3.9055, abs=1e-4)  # seed 1's chain
    assert lang.bigram_entropy() == pytest.approx(0.8666, abs=1e-4)
    # the same seed, the same chain; its documents follow it
    again = MarkovLanguage.make(1, num_words=64, num_successors=3)
    assert again.words == lang.words and (again.transition == lang.transition).all()
    for doc in lang.documents(20, seed=5, min_words=3, max_words=9):
        assert 3 <= len(doc) <= 9 and all(t[a, b] > 0 for a, b in zip(doc, doc[1:]))


def test_masked_floor_is_the_posterior_given_both_neighbours(lang):
    t, pi = lang.transition, lang.stationary
    a, b, c, d = _chain(lang, 4)
    words = np.array([[0, a, b, c, d, 0]])
    boundary = np.array([[True, False, False, False, False, True]])
    one = np.array([[False, False, False, True, False, False]])  # "a b [MASK] d"
    post = t[b] * t[:, d]
    assert lang.masked_cross_entropy(words, one, boundary).tolist() == pytest.approx(
        [-math.log(post[c] / post.sum())], abs=1e-12)
    # "[MASK] b c d": the first word of a segment has the stationary prior
    first = np.array([[False, True, False, False, False, False]])
    post = pi * t[:, b]
    assert lang.masked_cross_entropy(words, first, boundary).tolist() == pytest.approx(
        [-math.log(post[a] / post.sum())], abs=1e-12)
    # "a b c [MASK]": the last word before a boundary has no right-hand constraint
    last = np.array([[False, False, False, False, True, False]])
    assert lang.masked_cross_entropy(words, last, boundary).tolist() == pytest.approx(
        [-math.log(t[c, d])], abs=1e-12)
    # two masked neighbours "a [MASK] [MASK] d": p(b | a, d) sums over the hidden c
    two = np.array([[False, False, True, True, False, False]])
    joint = t[a][:, None] * t * t[:, d][None, :]  # [b', c'] ∝ p(b'|a) p(c'|b') p(d|c')
    joint /= joint.sum()
    got = lang.masked_cross_entropy(words, two, boundary)
    assert got.tolist() == pytest.approx([-math.log(joint[b].sum()), -math.log(joint[:, c].sum())],
                                         abs=1e-12)


def test_oracle_scores_the_markov_blanket(lang):
    t = lang.transition
    a, b, c, d = _chain(lang, 4)
    impossible = int(np.flatnonzero(t[b] == 0)[0])
    boundary = np.array([[True, False, False, False, False, True]])
    scores = lang.oracle_scores(np.array([[0, a, b, impossible, d, 0]]), boundary)
    assert scores[0, 3] == math.inf  # the chain cannot put it after b
    joint = t[a] * t[:, impossible]
    want = -math.log(joint[b] / joint.sum()) if joint[b] > 0 else math.inf
    assert scores[0, 2] == pytest.approx(want)
    assert scores[0, 0] == scores[0, 5] == 0.0  # boundaries are not scored


def test_score_known_answer_on_a_hand_made_dump(lang):
    token_to_word = {5 + w: w for w in range(64)}  # vocab.txt: five specials, then the words
    assert word_ids_of_tokens(lang, lambda word: [5 + lang.words.index(word)]) == token_to_word
    with pytest.raises(ValueError, match="2 of the language's 64 words are not one token each"):
        word_ids_of_tokens(lang, lambda word: [1, 2] if word in lang.words[:2] else [7])
    path = _chain(lang, 8)
    ids = torch.tensor([[1, *[5 + w for w in path], 2]])
    t = lang.transition
    # a word the chain cannot put after path[2] but can put before path[4]
    wrong = int(np.flatnonzero((t[path[2]] == 0) & (t[:, path[4]] > 0))[0])
    corrupted = ids.clone()
    corrupted[0, 4] = 5 + wrong  # position 4 holds path[3]: replaced by an impossible successor
    masked = torch.zeros_like(ids, dtype=torch.bool)
    masked[0, 4] = True
    logits = torch.zeros(ids.shape)
    logits[0, 4] = 3.0  # the discriminator points at the replacement
    got = score_known_answer(lang, token_to_word, {"input_ids": ids, "masked": masked,
                                                   "corrupted_ids": corrupted,
                                                   "rtd_logits": logits})
    post = t[path[2]] * t[:, path[4]]
    assert got["masked_floor"] == pytest.approx(-math.log(post[path[3]] / post.sum()))
    assert got["auc"] == 1.0
    # the oracle sees an impossible pair (path[2], wrong) and cannot tell which of the two was
    # replaced: both score +inf, a tie with one of the 7 originals
    assert got["oracle_auc"] == pytest.approx(1 - 0.5 / 7)
    assert got["replaced_fraction"] == pytest.approx(1 / 8)  # [CLS] and [SEP] not counted


def test_roc_auc_takes_infinite_scores():
    s = torch.tensor([0.1, math.inf, 0.2, math.inf], dtype=torch.float64)
    assert roc_auc(s, torch.tensor([0, 1, 0, 0])) == pytest.approx((2 + 0.5) / 3)


def test_shuffled_labels_keep_each_count_and_lose_the_positions():
    b, s = 64, 32
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(b, s, generator=g) < 0.15).float()
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[:, -5:] = False  # padding at the end of each sample
    labels[~valid] = 0.0
    idx = torch.arange(1000, 1000 + b)
    out = shuffled_labels(labels, valid, seed=3, step=7, sample_index=idx)
    assert (out.sum(1) == labels.sum(1)).all()  # each sample keeps its replaced count
    assert (out[~valid] == 0).all()  # nothing moves into the padding
    agree = ((out == 1) & (labels == 1)).sum() / labels.sum()
    assert 0.05 < float(agree) < 0.3  # about the replaced fraction: the positions are lost
    # a function of (seed, step, sample index): the same for a sample wherever it sits
    half = shuffled_labels(labels[10:20], valid[10:20], seed=3, step=7, sample_index=idx[10:20])
    assert torch.equal(half, out[10:20])
    assert not torch.equal(shuffled_labels(labels, valid, seed=3, step=8, sample_index=idx), out)
