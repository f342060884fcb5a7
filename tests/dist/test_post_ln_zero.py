"""The post-LayerNorm layout under DeepSpeed ZeRO-3 (gloo, CPU, DP = 2): parameters partitioned
and gathered by DeepSpeed's module hooks (the token-type row included) train exactly like
unpartitioned ZeRO stage 0."""
from __future__ import annotations

import pytest

from tests.dist import harness, workers

pytestmark = pytest.mark.dist


def test_post_ln_zero3_equals_zero0_at_dp2():
    ranks = harness.run(workers.post_ln_zero_steps, (0, 3), 3, world_size=2)
    for res in ranks:
        assert res[3] == pytest.approx(res[0], abs=1e-6)
        assert res[3][-1] < res[3][0]  # it trained (same 2 samples, 3 steps)
    assert ranks[0][3][0] != ranks[1][3][0]  # each data-parallel rank read its own samples
