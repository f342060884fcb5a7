"""Task metrics on plain Python / NumPy inputs, each checked against a hand-computed answer in
tests/tools/test_finetune.py.

Classification: accuracy; F1 of the positive class (label id 1) for two classes, the unweighted
mean of the per-class F1s (macro F1) for more; Matthews correlation (Matthews 1975; the
multi-class form, Gorodkin 2004), as GLUE reports them (CoLA: Matthews; MRPC, QQP: F1).
Regression: Pearson's and Spearman's correlation (STS-B). Tokens: accuracy over words; entity F1
over BIO chunks as conlleval / seqeval's default mode count them (an ``I-X`` that does not
continue a chunk of type X starts one) when every tag is ``O``, ``B-X`` or ``I-X``, else macro F1
over the tags (micro F1 over single-tag words equals accuracy).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def accuracy(pred: Sequence[int], gold: Sequence[int]) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean()) if gold.size else float("nan")


def _f1(tp: float, fp: float, fn: float) -> float:
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def macro_f1(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Unweighted mean over the classes present in ``gold`` or ``pred`` of each class's F1."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes = np.union1d(pred, gold)
    return float(np.mean([_f1(((pred == c) & (gold == c)).sum(), ((pred == c) & (gold != c)).sum(),
                               ((pred != c) & (gold == c)).sum()) for c in classes]))


def f1(pred: Sequence[int], gold: Sequence[int], num_labels: int) -> float:
    """F1 of label 1 for two labels (GLUE's MRPC / QQP), macro F1 for more."""
    if num_labels == 2:
        pred, gold = np.asarray(pred), np.asarray(gold)
        return float(_f1(((pred == 1) & (gold == 1)).sum(), ((pred == 1) & (gold == 0)).sum(),
                         ((pred == 0) & (gold == 1)).sum()))
    return macro_f1(pred, gold)


def matthews(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Matthews correlation coefficient, the multi-class form (Gorodkin 2004, the R_K statistic):
    cov(pred, gold) / sqrt(cov(pred, pred) · cov(gold, gold)) over one-hot rows; 0 when either
    side is constant."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes = np.union1d(pred, gold)
    c = np.array([[((gold == a) & (pred == b)).sum() for b in classes] for a in classes], float)
    t, p, n = c.sum(1), c.sum(0), c.sum()
    correct = np.trace(c)
    cov_pg = correct * n - t @ p
    denom = math.sqrt((n * n - p @ p) * (n * n - t @ t))
    return float(cov_pg / denom) if denom else 0.0


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, float), np.asarray(y, float)
    x, y = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((x * x).sum() * (y * y).sum()))
    return float((x * y).sum() / denom) if denom else 0.0


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), float)
    xs = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation of the ranks (ties averaged)."""
    return pearson(_ranks(np.asarray(x, float)), _ranks(np.asarray(y, float)))


def is_bio(tags: Sequence[str]) -> bool:
    """Every tag is ``O``, ``B-X`` or ``I-X``, and at least one is not ``O``."""
    return any(t != "O" for t in tags) and all(
        t == "O" or (t[:2] in ("B-", "I-") and len(t) > 2) for t in tags)


def chunks(tags: Sequence[str]) -> set[tuple[int, int, str]]:
    """{(start, end exclusive, type)} of the BIO chunks of one sentence (module docstring)."""
    out, start, kind = set(), None, None
    for i, t in enumerate(list(tags) + ["O"]):
        prefix, _, typ = t.partition("-")
        if start is not None and (prefix != "I" or typ != kind):
            out.add((start, i, kind))
            start = None
        if prefix == "B" or (prefix == "I" and start is None):
            start, kind = i, typ
    return out


def entity_f1(pred: Sequence[Sequence[str]], gold: Sequence[Sequence[str]]) -> float:
    """Micro F1 over the BIO chunks of all sentences: a chunk counts when start, end and type
    all match."""
    tp = fp = fn = 0
    for p, g in zip(pred, gold):
        cp, cg = chunks(p), chunks(g)
        tp += len(cp & cg)
        fp += len(cp - cg)
        fn += len(cg - cp)
    return _f1(tp, fp, fn)
