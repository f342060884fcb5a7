"""Validation under pipeline parallelism: the forward-only two-pass schedule gives the losses of
one stage and leaves no gradient (rtd_scale/training/pipeline.py ``pipeline_forward``)."""
from __future__ import annotations

import pytest

from tests.helpers import dist as harness, eval_workers

pytestmark = pytest.mark.dist


def test_forward_only_pipeline_equals_one_stage():
    ref = harness.run(eval_workers.pipeline_eval, world_size=1)[0]
    res = harness.run(eval_workers.pipeline_eval, world_size=2, pp=2)
    last = next(r for r in res if r["pp_rank"] == 1)
    assert len(ref["mlm"]) == len(last["mlm"]) == 4
    assert last["mlm"] == pytest.approx(ref["mlm"], abs=1e-5)
    assert last["rtd"] == pytest.approx(ref["rtd"], abs=1e-5)
    assert all((a == b).all() for a, b in zip(last["masked"], ref["masked"]))
    for r in res + [ref]:
        assert r["grads"] == 0 and not r["requires_grad"]
