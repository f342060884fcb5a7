"""The layout-free state (training/checkpoint/layout_free.py) as the hub between every pair of
ds_configs/ files and precisions, at DP 2 (gloo, CPU): gathered from each, loaded into each, and
the next step taken. Pairwise through the hub: a source's state equals the reference's, a
target holds the reference's state exactly after the load and continues its step 3 —
ZeRO-Offload on and off (DeepSpeed's CPU Adam counts AdamW steps in an int, torch's AdamW in a
tensor), ZeRO 0–3, fp32, and bf16 at ZeRO-0 and 1. The ZeRO-Offload changes at one stage, which
DeepSpeed loads itself, go through checkpoint.save / checkpoint.load and continue too. One world
for all of it; the real launches of these conversions are in tests/e2e/test_resume_layout.py."""
from __future__ import annotations

import json

import pytest

from rtd_scale.training.ds_config import fp16_supported
from tests.helpers import dist as harness, dist_workers as workers
from tests.helpers.env import REPO

pytestmark = pytest.mark.dist

FP32_REL = 1e-5  # ZeRO stages and CPU Adam reduce and update in other orders
BF16_REL = 2e-2  # a bf16 forward against the fp32 reference's
SOURCE_REL = 1e-4  # two steps trained apart (measured ≤ 2.3e-5)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    files = sorted((REPO / "ds_configs").glob("*.json"))
    configs = {}
    for path in files:
        user = json.loads(path.read_text())
        if "fp16" in user and not fp16_supported():
            continue  # refused where DeepSpeed has no fp16 (tests/e2e/test_offload_fp16.py)
        configs[path.stem] = (user, "fp16" if "fp16" in user else "fp32")
    assert {"zero0", "zero1", "zero2", "zero2_offload", "zero3", "zero3_offload"} <= set(configs)
    # the reference first; bf16 where DeepSpeed keeps the fp32 masters in other places than in
    # fp32: per-parameter copies at ZeRO-0 (FP16_UnfusedOptimizer), bf16_* files at ZeRO-1
    configs = {"zero1": configs.pop("zero1"), **configs}
    for stage in ("zero0", "zero1"):
        configs[f"{stage}_bf16"] = (configs[stage][0], "bf16")
    pairs = [("zero2_offload", "zero2"), ("zero2", "zero2_offload"),
             ("zero3_offload", "zero3"), ("zero3", "zero3_offload")]
    result = harness.run(workers.layout_free_matrix, configs, pairs,
                         str(tmp_path_factory.mktemp("matrix")), world_size=2)[0]
    return configs, result


def test_every_config_gathers_the_same_state(matrix):
    configs, result = matrix
    print({n: r["rel"] for n, r in result["source"].items()})
    for name, (_, precision) in configs.items():
        got = result["source"][name]
        # DeepSpeed's ZeRO-0 bf16 wrapper (FP16_UnfusedOptimizer.initialize_optimizer_states)
        # steps AdamW once on zero gradients when it is built: its runs count one step more
        steps = 3.0 if name == "zero0_bf16" else 2.0
        assert got["adam_step"] == steps and got["moments"] and got["fp32_masters"], (name, got)
        if precision == "fp32":  # two steps apart, each in its own reduction order
            assert got["rel"] < SOURCE_REL, (name, got)


def test_every_config_loads_the_reference_state_exactly_and_continues(matrix):
    configs, result = matrix
    print({n: (r["loss3"], r["after_rel"]) for n, r in result["target"].items()})
    for name, (_, precision) in configs.items():
        got = result["target"][name]
        assert got["loaded_rel"] == 0.0, (name, got)  # fp32 masters and both moments, bit for bit
        assert got["adam_step"] == 2.0, name
        rel = FP32_REL if precision == "fp32" else BF16_REL
        assert abs(got["loss3"] - result["loss3"]) <= rel * abs(result["loss3"]), (name, got)
        if precision == "fp32":
            assert got["after_rel"] < FP32_REL, (name, got)


def test_without_the_moments_the_step_after_the_load_differs(matrix):
    """Negative control: the reference's state with both moments zeroed, loaded at ZeRO-1,
    gives the same step-3 loss (the weights carry it) but not the same state after the update:
    the moments, not the weights alone, make the targets' states equal."""
    _, result = matrix
    got = result["control"]
    assert abs(got["loss3"] - result["loss3"]) <= FP32_REL * abs(result["loss3"])
    assert got["after_rel"] > 100 * FP32_REL, got


def test_offload_on_and_off_at_one_stage_loads_and_continues(matrix):
    _, result = matrix
    print(result["pair"], result["loss3"])
    for pair, got in result["pair"].items():
        assert got["adam_step"] == 2.0, pair
        assert abs(got["loss3"] - result["loss3"]) <= FP32_REL * abs(result["loss3"]), (pair, got)
        assert got["after_rel"] < SOURCE_REL, (pair, got)  # trained apart for steps 1–2
