"""pretrain.py's memory estimate per rank (rtd_scale/memory.py) against the rank's measured
peak, through the real launcher at ZeRO-1 on 2 ranks (ZeRO-3's: tests/e2e/test_pretrain_launcher.py)."""
from __future__ import annotations

import pytest

from tests.helpers.launcher import common, launch, memory_estimate_and_peak

pytestmark = pytest.mark.e2e


def test_zero1_two_ranks_estimate_within_20_percent_of_the_peak(wiki_shards, tmp_path):
    r = launch(common(wiki_shards, tmp_path / "run", 2, ["--eval-iters", "0"],
                      ds_config="ds_configs/zero1.json", save_interval=None))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "ZeRO stage 1" in r.stdout
    estimate, peak = memory_estimate_and_peak(r.stdout)
    # ZeRO-1's parts: the whole gradients until the reduction, its fp32 staging bucket, the
    # sharded optimizer; no ZeRO-3 live parameters
    line = next(l for l in r.stdout.splitlines() if l.startswith("memory per rank: estimate"))
    assert all(f" {part} " in line for part in ("weights", "gradients", "reduce bucket",
                                                 "optimizer", "activations", "MLM logits"))
    assert "live parameters" not in line
    assert abs(peak / estimate - 1) <= 0.2, (estimate, peak)
