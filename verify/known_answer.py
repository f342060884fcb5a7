"""A known-answer language: a seeded sparse Markov chain over made-up words, whose optimum is
computable, so a test or a benchmark can tell a run that learns the language from one that learns
only its token frequencies.

Text: documents of words ``w_1 … w_n`` with ``w_1 ~ π`` (the chain's stationary distribution)
and ``w_{t+1} ~ P(· | w_t)``, where every word has ``num_successors`` possible successors with
Dirichlet(1) weights. Document lengths are drawn independently of the words. The language's
WordPiece ``vocab.txt`` (``tools/make_known_answer_corpus.py``) holds every word as one token, so
word-level numbers are token-level numbers (``word_ids_of_tokens`` checks it).

What a run must approach, computed from the chain alone:

- ``unigram_entropy``: H(π), the masked-LM loss of a model that knows only the token frequencies.
- ``bigram_entropy``: H(w_{t+1} | w_t), the loss of a left-to-right predictor.
- ``masked_floor`` (``masked_cross_entropy``): the expected masked-LM loss of the Bayes-optimal
  generator on given samples and masks: −log p(w_t | every visible token) at each masked
  position, by forward–backward over the chain with the masked positions hidden. Packed samples
  (``data/packed.py``) are cut at [CLS] / [SEP]: a word after a special token is a chain start
  (π, exact both at a document's start and mid-document, the chain being stationary), and a word
  before one has no right-hand constraint (lengths are independent of words).
- ``oracle_scores``: an oracle discriminator that knows the chain's true probabilities (not the
  generator's): a token's score is −log p(c_t | c_{t−1}, c_{t+1}) on the corrupted sequence,
  the Markov blanket of c_t. Its ROC AUC on a run's own replacements (``--eval-dump-dir``;
  :func:`score_known_answer`) is the reference the discriminator's AUC is measured against: a
  good generator makes replacements that even the oracle cannot see, and the oracle's AUC says
  how many.

A test oracle, not part of the product: ``rtd_scale`` never imports ``verify``
(tests/unit/test_layering.py). numpy only at import; :func:`score_known_answer` imports torch.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

# tools/train_tokenizer.py's fixed special ids, as the first lines of the language's vocab.txt
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]")
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
# made_up_words draws two consonant–vowel syllables: no more distinct words than this
MAX_WORDS = (len(_CONSONANTS) * len(_VOWELS)) ** 2
# draws of a random chain before make() gives up on finding one with a single stationary
# distribution over every word (see chain_problem)
MAX_DRAWS = 2000


def chain_problem(num_words: int, num_successors: int) -> str | None:
    """Why ``MarkovLanguage.make`` cannot (or practically cannot) draw this chain, or None.

    A draw is kept when every word has a predecessor and the chain is aperiodic
    (``_stationary``). One successor per word makes an irreducible chain a single cycle, which
    is periodic; with S successors a given word has no predecessor with probability
    (1 − S/W)^W, so a draw keeps every word with probability about exp(−W (1 − S/W)^W)
    (Poisson approximation), which is refused below 5 / MAX_DRAWS.
    """
    if num_words > MAX_WORDS:
        return f"at most {MAX_WORDS} distinct made-up words exist, asked for {num_words}"
    if num_successors == 1 and num_words > 1:
        return ("with one successor per word every chain over all words is a cycle, which is "
                "periodic; use num_successors >= 2")
    if _keep_prob(num_words, num_successors) < 5 / MAX_DRAWS:
        need = next(s for s in range(num_successors, num_words + 1)
                    if _keep_prob(num_words, s) >= 5 / MAX_DRAWS)
        return (f"with {num_successors} successors per word almost every chain over "
                f"{num_words} words leaves a word unreachable; use num_successors >= {need} "
                f"or fewer words")
    return None


def _keep_prob(num_words: int, num_successors: int) -> float:
    return math.exp(-num_words * (1 - num_successors / num_words) ** num_words)


def made_up_words(n: int, rng: np.random.Generator) -> list[str]:
    """``n`` distinct lowercase words of two consonant–vowel syllables."""
    words: set[str] = set()
    out: list[str] = []
    while len(out) < n:
        syllables = 2
        w = "".join(_CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
                    for _ in range(syllables))
        if w not in words:
            words.add(w)
            out.append(w)
    return out


@dataclass
class MarkovLanguage:
    """The chain: ``words`` [W], ``transition`` [W, W] row-stochastic with ``num_successors``
    non-zero entries per row, ``stationary`` [W]."""

    words: list[str]
    transition: np.ndarray
    stationary: np.ndarray

    @classmethod
    def make(cls, seed: int, num_words: int = 64, num_successors: int = 3) -> "MarkovLanguage":
        if not 1 <= num_successors <= num_words:
            raise ValueError(f"num_successors must be in [1, {num_words}], got {num_successors}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy's default_rng), got {seed}")
        problem = chain_problem(num_words, num_successors)
        if problem:
            raise ValueError(problem)
        rng = np.random.default_rng(seed)
        words = made_up_words(num_words, rng)
        for _ in range(MAX_DRAWS):
            t = np.zeros((num_words, num_words))
            for w in range(num_words):
                succ = rng.choice(num_words, size=num_successors, replace=False)
                t[w, succ] = rng.dirichlet(np.ones(num_successors))
            # a word no row reaches has stationary mass 0, which _stationary refuses: the same
            # draws are kept, without 5000 power iterations on each refused one
            if not (t > 0).any(axis=0).all():
                continue
            pi = _stationary(t)
            if pi is not None:  # irreducible and aperiodic: one stationary distribution
                return cls(words, t, pi)
        raise ValueError(f"no chain over {num_words} words with {num_successors} successors "
                         f"each reached every word aperiodically in {MAX_DRAWS} draws (seed "
                         f"{seed}); use more successors, fewer words or another seed")

    # --- text ---

    def documents(self, num_documents: int, seed: int, min_words: int = 20,
                  max_words: int = 60) -> Iterator[list[int]]:
        """``num_documents`` word-id lists, lengths uniform in [min_words, max_words]."""
        rng = np.random.default_rng(seed)
        w_count = len(self.words)
        cum = np.cumsum(self.transition, axis=1)
        for _ in range(num_documents):
            n = int(rng.integers(min_words, max_words + 1))
            u = rng.random(n)
            doc = [int(rng.choice(w_count, p=self.stationary))]
            for t in range(1, n):
                doc.append(int(min(np.searchsorted(cum[doc[-1]], u[t], side="right"),
                                   w_count - 1)))
            yield doc

    def text(self, doc: Sequence[int]) -> str:
        return " ".join(self.words[w] for w in doc)

    # --- the optimum ---

    def unigram_entropy(self) -> float:
        """H(π) in nats."""
        return _entropy(self.stationary)

    def bigram_entropy(self) -> float:
        """H(w_{t+1} | w_t) = Σ_w π(w) H(P(· | w)) in nats."""
        return float(sum(p * _entropy(row) for p, row in zip(self.stationary, self.transition)))

    def masked_cross_entropy(self, words: np.ndarray, hidden: np.ndarray,
                             boundary: np.ndarray) -> np.ndarray:
        """The Bayes-optimal generator's loss −log p(w_t | visible) at each hidden position.

        Args:
            words: [b, s] word ids (anything at boundary positions).
            hidden: [b, s] bool, the masked positions (never at a boundary).
            boundary: [b, s] bool, special tokens ([CLS], [SEP], [PAD]) that cut the chain.
        Returns:
            float64 [number of hidden positions], in row-major order of ``hidden``.
        """
        out = []
        for row_w, row_h, row_b in zip(words, hidden, boundary):
            for a, b in _segments(row_b):
                seg, hid = row_w[a:b], row_h[a:b]
                post = self._posteriors(seg, hid)
                out.extend(-np.log(post[i, seg[i]]) for i in np.flatnonzero(hid))
        return np.asarray(out, dtype=np.float64)

    def oracle_scores(self, corrupted: np.ndarray, boundary: np.ndarray) -> np.ndarray:
        """The chain oracle's replaced-token scores: −log p(c_t | c_{t−1}, c_{t+1}) under the true
        chain, on the corrupted sequence (higher = more likely replaced; +inf where the chain
        cannot produce c_t between its neighbours). [b, s] float64, 0 at boundary positions."""
        t, pi = self.transition, self.stationary
        scores = np.zeros(corrupted.shape, dtype=np.float64)
        with np.errstate(divide="ignore"):
            for r, (row_c, row_b) in enumerate(zip(corrupted, boundary)):
                for a, b in _segments(row_b):
                    seg = row_c[a:b]
                    for i, c in enumerate(seg):
                        left = pi if i == 0 else t[seg[i - 1]]  # [W] p(w | left)
                        right = np.ones(len(pi)) if i == len(seg) - 1 else t[:, seg[i + 1]]
                        joint = left * right  # p(w, right | left)
                        scores[r, a + i] = (-math.log(joint[c] / joint.sum()) if joint[c] > 0
                                            else math.inf)
        return scores

    def _posteriors(self, seg: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """[n, W] marginals p(w_i | visible words of the segment), forward–backward."""
        n, w_count = len(seg), len(self.words)
        t = self.transition
        evidence = np.ones((n, w_count))
        for i in np.flatnonzero(~hidden):
            evidence[i] = 0.0
            evidence[i, seg[i]] = 1.0
        fwd = np.empty((n, w_count))
        f = self.stationary * evidence[0]
        fwd[0] = f / f.sum()
        for i in range(1, n):
            f = (fwd[i - 1] @ t) * evidence[i]
            fwd[i] = f / f.sum()
        bwd = np.ones((n, w_count))
        for i in range(n - 2, -1, -1):
            g = t @ (bwd[i + 1] * evidence[i + 1])
            bwd[i] = g / g.sum()
        post = fwd * bwd
        return post / post.sum(axis=1, keepdims=True)

    # --- files ---

    def to_json(self) -> dict:
        return {"words": self.words, "transition": self.transition.tolist()}

    @classmethod
    def from_json(cls, obj: dict) -> "MarkovLanguage":
        t = np.asarray(obj["transition"], dtype=np.float64)
        pi = _stationary(t)
        assert pi is not None, "the saved chain has no unique stationary distribution"
        return cls(list(obj["words"]), t, pi)

    @classmethod
    def load(cls, path: str) -> "MarkovLanguage":
        with open(path) as f:
            return cls.from_json(json.load(f))


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def _stationary(t: np.ndarray) -> np.ndarray | None:
    """The unique stationary distribution of ``t``, or None when the chain is reducible or
    periodic (power iteration does not converge to one vector from two starts)."""
    w_count = len(t)
    a = np.full(w_count, 1.0 / w_count)
    b = np.zeros(w_count)
    b[0] = 1.0
    for _ in range(5000):
        a, b = a @ t, b @ t
    if np.abs(a - b).max() > 1e-9 or np.abs(a @ t - a).max() > 1e-12 or a.min() <= 0:
        return None
    return a / a.sum()


def _segments(boundary: np.ndarray) -> Iterator[tuple[int, int]]:
    """[a, b) runs of non-boundary positions."""
    n, i = len(boundary), 0
    while i < n:
        if boundary[i]:
            i += 1
            continue
        j = i
        while j < n and not boundary[j]:
            j += 1
        yield i, j
        i = j


def word_ids_of_tokens(language: MarkovLanguage, encode) -> dict[int, int]:
    """{token id: word id} when ``encode`` (a tokenizer's ``encode``) gives every word of the
    language exactly one token, as the optimum's numbers assume.

    Raises:
        ValueError: naming the words that are split, and the fix (a larger --vocab-size).
    """
    out, split = {}, []
    for w, word in enumerate(language.words):
        ids = encode(word)
        if len(ids) != 1:
            split.append(word)
        else:
            out[ids[0]] = w
    if split:
        raise ValueError(f"{len(split)} of the language's {len(language.words)} words are not "
                         f"one token each (e.g. {split[:3]}); train the tokenizer with a larger "
                         "--vocab-size")
    return out


def score_known_answer(language: MarkovLanguage, token_to_word: dict[int, int],
                       dump: dict) -> dict[str, float]:
    """The optimum on one evaluation's own samples, masks and replacements (``--eval-dump-dir``):

    - ``masked_floor``: the Bayes-optimal generator's mean loss at the masked positions (what
      the run's ``mlm loss`` on the same batches approaches; exact when a masked slot always
      receives [MASK], ``rtd.mask_token_prob`` 1);
    - ``oracle_auc``: the chain oracle's ROC AUC on the run's replacements;
    - ``auc``: the run's discriminator's ROC AUC on the same tokens (the logged ``rtd auc``);
    - ``replaced_fraction``.
    Positions whose token is not a word of the language ([CLS], [SEP], [PAD]) are boundaries and
    are not scored. ``token_to_word``: :func:`word_ids_of_tokens`; ``dump``: one file of
    ``--eval-dump-dir`` (``rtd_scale/training/loop.py``'s ``evaluate``). The AUCs are
    ``rtd_scale.training.diagnostics.roc_auc``, the one the run logs.
    """
    import torch

    from rtd_scale.training.diagnostics import roc_auc

    ids = dump["input_ids"].numpy()
    lut = np.full(int(max(ids.max(), dump["corrupted_ids"].numpy().max(),
                          max(token_to_word))) + 1, -1)
    for tok, w in token_to_word.items():
        lut[tok] = w
    words, corrupted = lut[ids], lut[dump["corrupted_ids"].numpy()]
    boundary = words < 0
    masked = dump["masked"].numpy().astype(bool) & ~boundary
    labels = (dump["corrupted_ids"].numpy() != ids)[~boundary]
    oracle = language.oracle_scores(np.where(boundary, 0, corrupted), boundary)[~boundary]
    floor = language.masked_cross_entropy(np.where(boundary, 0, words), masked, boundary)
    logits = dump["rtd_logits"].numpy().astype(np.float64)[~boundary]
    lab = torch.from_numpy(labels.astype(np.int64))
    return {"masked_floor": float(floor.mean()),
            "oracle_auc": roc_auc(torch.from_numpy(oracle), lab),
            "auc": roc_auc(torch.from_numpy(logits), lab),
            "replaced_fraction": float(labels.mean())}
