"""The post-LayerNorm layout under DeepSpeed ZeRO-3 (gloo, CPU, DP = 2): parameters partitioned
and gathered by DeepSpeed's module hooks (the token-type row included) train exactly like
unpartitioned ZeRO stage 0 — with BERT attention and with DeBERTa's disentangled attention, whose
relative table and its norm, read by every layer but owned by the encoder, are gathered like the
rest. Built as pretrain.py builds it under ZeRO-3, inside DeepSpeed's zero.Init (each rank
holding only its partition from the start), the model trains to the same losses, step for step,
as one built whole and partitioned by the engine (the first exactly, the rest to rounding)."""
from __future__ import annotations

import pytest

from tests.helpers import dist as harness, dist_workers as workers

pytestmark = pytest.mark.dist


def test_post_ln_zero3_equals_zero0_at_dp2():
    ranks = harness.run(workers.post_ln_zero_steps, (0, 3, "3-init"), 3, "both", world_size=2)
    for attention in ("bert", "disentangled"):
        for res in (r[attention] for r in ranks):
            assert res[3] == pytest.approx(res[0], abs=1e-6), attention
            assert res[3][-1] < res[3][0]  # it trained (same 2 samples, 3 steps)
            # zero.Init: the same first loss exactly (the same initial weights), then the same
            # losses to rounding (its partitions order the optimizer's flat groups differently)
            assert res["3-init"][0] == res[3][0], attention
            assert res["3-init"] == pytest.approx(res[3], rel=1e-6), attention
            held, whole = res["3-init-held"]
            assert whole > 10_000 and held <= whole / 2 + 1000  # its half (+ padding), no more
        # each data-parallel rank read its own samples
        assert ranks[0][attention][3][0] != ranks[1][attention][3][0]
    assert ranks[0]["bert"][3][0] != ranks[0]["disentangled"][3][0]  # two different models
