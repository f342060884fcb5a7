"""The two-level Gumbel-max sampler draws the same ids at TP = 1 and TP = 2 (gloo, CPU), on a
vocabulary of whole 128-id blocks per shard, as rtd_scale's padding to 128 × TP guarantees."""
from __future__ import annotations

import torch

from tests.helpers import dist as harness

V_PADDED, V_REAL = 512, 500


def _logits(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(n, V_PADDED, generator=g) * 2.0
    logits[:, 256:270] += 3.0  # heavy ids inside the second shard at TP = 2
    return logits


def sample_worker(ctx, n: int):
    from rtd_scale.objectives.sampling import sample_from_logits

    v_local = V_PADDED // ctx.tp_size
    start = ctx.tp_rank * v_local
    ids = torch.arange(start, start + v_local)
    sampleable = (ids < V_REAL) & (ids >= 5)
    logits = _logits(n)[:, start:start + v_local]
    keys = dict(seed=5, step=2, sample_index=torch.arange(n) // 64,
                position=torch.arange(n) % 64, vocab_start=start, sampleable=sampleable,
                tp_group=ctx.tp_group)
    original = torch.arange(n) % 300 + 5
    return {"free": sample_from_logits(logits, **keys),
            "cold": sample_from_logits(logits, temperature=0.5, **keys),
            "disallow": sample_from_logits(logits, disallow_ids=original, **keys),
            "original": original}


def test_two_level_sampler_identical_at_tp1_and_tp2():
    n = 2000
    tp1 = harness.run(sample_worker, n, world_size=1, tp=1)[0]
    tp2 = harness.run(sample_worker, n, world_size=2, tp=2)
    for key in ("free", "cold", "disallow"):
        for rank in tp2:
            assert torch.equal(rank[key], tp1[key]), key
    assert not (tp1["disallow"] == tp1["original"]).any()
    # both shards win rows (the comparison is not trivially one-sided)
    assert (tp1["free"] < 256).any() and (tp1["free"] >= 256).any()
    assert ((tp1["free"] >= 5) & (tp1["free"] < V_REAL)).all()
