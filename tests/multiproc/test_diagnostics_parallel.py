"""Learning diagnostics (rtd_scale/training/diagnostics.py) across processes: Table 1's average
cosines vocab-parallel at TP = 2 equal TP = 1, and the held-out RTD AUC at DP = 2 with ZeRO-3
equals DP = 1 and brute-force pair counting."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.training.diagnostics import AVG_COSINE_DISCRIMINATOR, AVG_COSINE_GENERATOR
from tests.helpers.diagnostics import brute_force_auc, cosines_worker, evaluate_worker


@pytest.mark.dist
def test_table_cosines_tp2_equal_tp1():
    from tests.helpers import dist as harness

    ref = harness.run(cosines_worker, world_size=1)[0]
    for res in harness.run(cosines_worker, world_size=2, tp=2):
        for mode, vals in ref.items():
            assert res[mode] == pytest.approx(vals, abs=1e-10)
    assert ref["gdes"][AVG_COSINE_DISCRIMINATOR] != pytest.approx(
        ref["gdes"][AVG_COSINE_GENERATOR], abs=1e-4)


@pytest.mark.dist
def test_evaluate_auc_dp2_zero3_equals_dp1_and_pair_counting():
    from tests.helpers import dist as harness

    one = harness.run(evaluate_worker, 0, world_size=1)[0]
    scores, labels = one["reference"]
    assert 20 < int(labels.sum()) < int(labels.numel())  # both classes present
    auc = one["valid"]["valid/rtd/auc"]
    assert auc == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)
    two = harness.run(evaluate_worker, 3, world_size=2)
    first = next(r for r in two if r["dp_rank"] == 0)
    assert first["valid"]["valid/rtd/auc"] == pytest.approx(auc, abs=1e-9)
    assert torch.isnan(torch.tensor(next(r for r in two if r["dp_rank"] == 1)["valid"][
        "valid/rtd/auc"]))  # computed once, on the logging rank's data-parallel group's first rank
    assert first["valid"]["valid/loss/rtd"] == pytest.approx(one["valid"]["valid/loss/rtd"],
                                                             abs=1e-6)
    for r in two:  # Table-1 cosines gathered from ZeRO-3 partitions equal the unpartitioned ones
        assert r["cosines"] == pytest.approx(one["cosines"], abs=1e-10)
