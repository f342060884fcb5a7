"""The post-LayerNorm layout under DeepSpeed ZeRO-3 (gloo, CPU, DP = 2): parameters partitioned
and gathered by DeepSpeed's module hooks (the token-type row included) train exactly like
unpartitioned ZeRO stage 0 — with BERT attention and with DeBERTa's disentangled attention, whose
relative table and its norm, read by every layer but owned by the encoder, are gathered like the
rest. Built as pretrain.py builds it under ZeRO-3, inside DeepSpeed's zero.Init (each rank
holding only its partition from the start), the model puts the same parameters in AdamW's
weight-decay group and trains to the same losses and the same weights, step for step, as one
built whole and partitioned by the engine, in fp32 and in bf16."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import dist as harness, dist_workers as workers

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def ranks():
    """Per rank, per attention: 3 steps at ZeRO-0, ZeRO-3 and ZeRO-3 built under zero.Init."""
    return harness.run(workers.post_ln_zero_steps, (0, 3, "3-init"), 3, "both", world_size=2)


def test_post_ln_zero3_equals_zero0_at_dp2(ranks):
    for attention in ("bert", "disentangled"):
        for res in (r[attention] for r in ranks):
            assert res[3] == pytest.approx(res[0], abs=1e-6), attention
            assert res[3][-1] < res[3][0]  # it trained (same 2 samples, 3 steps)
            held, whole = res["3-init-held"]
            assert whole > 10_000 and held <= whole / 2 + 1000  # its half (+ padding), no more
        # each data-parallel rank read its own samples
        assert ranks[0][attention][3][0] != ranks[1][attention][3][0]
    assert ranks[0]["bert"][3][0] != ranks[0]["disentangled"][3][0]  # two different models


def test_zero_init_build_trains_like_the_whole_build(ranks):
    """Under zero.Init a parameter's own ``data`` is an empty 1-D placeholder: judged by it, every
    parameter went to the no-decay group; DeepSpeed dropped the emptied decay group and the
    scheduler, pairing its weight-decay multipliers with the groups by position, gave the decay
    to the one left, biases and norms included (LayerNorm weights off by lr × weight decay per
    step: 3e-5 after the 6 steps of tests/e2e/test_resume_layout.py). The groups, the losses
    and the weights after 3 steps are the whole build's (measured: equal to the bit)."""
    for attention in ("bert", "disentangled"):
        for res in (r[attention] for r in ranks):
            no_decay = res[("no_decay", "3-init")]
            assert no_decay == res[("no_decay", 3)] == res[("no_decay", 0)], attention
            assert "discriminator.block.layers.0.mlp.linear_fc1.weight" not in no_decay
            assert "discriminator.block.layers.0.mlp.linear_fc1.bias" in no_decay
            assert res["3-init"] == res[3], attention
            whole, built = res[("weights", 3)], res[("weights", "3-init")]
            assert list(built) == list(whole)
            for name, w in whole.items():
                assert torch.equal(built[name], w), (attention, name)


def test_zero_init_build_in_bf16_trains_like_the_whole_build():
    """In bf16 too: zero.Init makes every randn in its context in bf16, and initial weights drawn
    so were rounded before their scaling, one bf16 step off the whole build's (model/weights.py
    draws with torch.normal). Losses and weights after 3 steps equal the whole build's to the
    bit (measured)."""
    ranks = harness.run(workers.post_ln_zero_steps, (3, "3-init"), 3, "bert", True,
                        world_size=2)
    for res in ranks:
        assert res["3-init"] == res[3]
        assert res[3][-1] < res[3][0]
        whole, built = res[("weights", 3)], res[("weights", "3-init")]
        assert list(built) == list(whole)
        for name, w in whole.items():
            assert torch.equal(built[name], w), name

