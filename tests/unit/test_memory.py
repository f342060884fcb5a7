"""rtd_scale/memory.py: the parameter counts (the built model's, exactly), the model states of
each ZeRO stage in the ZeRO paper's bytes per parameter (arXiv 1910.02054 §5) with DeepSpeed's
own copies and buffers, the ds_config's limits, and tools/estimate_cost.py's plan. The estimate
against a rank's measured peak: tests/e2e/test_memory_estimate.py and
tests/e2e/test_pretrain_launcher.py."""
from __future__ import annotations

import json

import pytest
import torch

from rtd_scale import memory
from rtd_scale.presets import preset
from tests.helpers.env import REPO
from tests.helpers.tiny_model import build
from tests.helpers.tools import load_tool


@pytest.mark.parametrize("name", ["tiny", "debertav3-tiny", "modernbert-tiny", "electra-small"])
def test_parameter_counts_are_the_built_models(single_process_group, name):
    cfg = preset(name)
    cfg.model.vocab_size = 1000
    counts = memory.config_parameter_counts(cfg)
    model = build(cfg, seed=1)
    assert counts == memory.count_parameters(model)
    assert counts.total == sum({id(p): p.numel() for p in model.parameters()}.values())
    # the vocabulary-row tables: the generator's table, the MLM bias, GDES's E_Δ
    e, rows = cfg.model.embedding_size, model.padded_vocab_size
    tables = {"tiny": 2, "debertav3-tiny": 2, "modernbert-tiny": 2, "electra-small": 1}[name]
    assert counts.vocab == tables * rows * e + rows


def test_the_masked_lm_control_counts_its_one_encoder(single_process_group):
    """rtd.objective=mlm: the parameters of the model it builds (the discriminator's shape,
    one table, the MLM bias) and the activations of one encoder, fewer than the RTD pair's."""
    from rtd_scale.config import apply_override

    cfg = preset("debertav3-tiny")
    cfg.model.vocab_size = 1000
    rtd_counts = memory.config_parameter_counts(cfg)
    apply_override(cfg, "rtd.objective=mlm")
    counts = memory.config_parameter_counts(cfg)
    model = build(cfg, seed=1)
    assert counts == memory.count_parameters(model) and counts.total < rtd_counts.total
    assert counts.vocab == model.padded_vocab_size * (cfg.model.embedding_size + 1)
    layout = memory.RankLayout(micro_batch_size=8, seq_length=128)
    one = memory.ParameterCounts(vocab=0, layers=1, other=0, largest=0)
    mlm = memory.estimate(cfg, one, layout).parts
    apply_override(cfg, "rtd.objective=rtd")
    rtd = memory.estimate(cfg, one, layout).parts
    assert mlm["activations"] < rtd["activations"]
    assert mlm["MLM logits"] == rtd["MLM logits"]  # the same masked positions and table
    # exactly one stack: with the generator at the discriminator's shape, the RTD pair holds
    # two stacks and the outside term, the masked LM one stack and the same outside term, so
    # 2·mlm − rtd is the outside term alone: C_OUTSIDE · s · b · h (fp32: 4 bytes)
    cfg.model.generator = cfg.model.discriminator
    twin = memory.estimate(cfg, one, layout).parts["activations"]
    outside = memory.C_OUTSIDE * 128 * 8 * cfg.model.discriminator.hidden_size * 4
    assert 2 * mlm["activations"] - twin == pytest.approx(outside, rel=1e-12)


def test_debertav3_base_at_the_sample_tokenizers_padded_table(single_process_group):
    """The count the start-up line printed for debertav3-base at DeBERTaV3's 128,128 rows."""
    cfg = preset("debertav3-base")
    assert memory.config_parameter_counts(cfg).total == 326_490_497
    assert memory.config_parameter_counts(cfg).per_rank(2, 2).vocab == (
        2 * 128_128 * 768 + 128_128) // 2


def _parts(stage: int, *, bf16: bool, dp: int, offload: bool = False, pp: int = 1,
           **zero) -> tuple:
    cfg = preset("tiny")
    p = 1_000_000_000  # 1e9 parameters: the buckets and live limits stay below it
    counts = memory.ParameterCounts(vocab=0, layers=p, other=0, largest=0)
    z = memory.ZeroSettings(stage=stage, offload_optimizer=offload, **zero)
    est = memory.estimate(cfg, counts, memory.RankLayout(pp=pp, dp=dp, zero=z, bf16=bf16,
                                                          micro_batch_size=1, seq_length=8))
    per = {k: v / p for k, v in est.parts.items()}
    return per, {k: v / p for k, v in est.host.items()}


def test_zero_stages_in_bytes_per_parameter():
    # ZeRO-0, fp32: 4 (weights) + 4 (gradients) + 8 (Adam's two moments)
    per, _ = _parts(0, bf16=False, dp=1)
    assert (per["weights"], per["gradients"], per["optimizer"]) == (4, 4, 8)
    # bf16 at stage 0 is DeepSpeed's FP16_UnfusedOptimizer: fp32 masters and moments (12) on
    # every rank, a bf16 .grad and, at the step, an fp32 .grad: 20, more than fp32's 16
    per, _ = _parts(0, bf16=True, dp=4)
    assert (per["weights"], per["gradients"], per["optimizer"]) == (2, 6, 12)
    # with pipeline parallelism it is BF16_Optimizer: masters and moments over DP, a bf16
    # .grad and a whole bf16 accumulator
    per, _ = _parts(0, bf16=True, dp=4, pp=2)
    assert (per["weights"], per["gradients"], per["optimizer"]) == (2, 4, 3)
    # ZeRO-1, bf16, N = 64: 2 + 2 (every gradient alive until the reduction) + 12 / 64 + the
    # fp32 partition of the gradients 4 / 64, and the fp32 staging bucket of 5e8 elements
    per, _ = _parts(1, bf16=True, dp=64)
    assert per["weights"] == 2 and per["optimizer"] == pytest.approx(12 / 64)
    assert per["gradients"] == pytest.approx(2 + 4 / 64)
    assert per["reduce bucket"] == pytest.approx(5e8 * 4 / 1e9)
    # ZeRO-2: the gradients partitioned (reduced bucket by bucket), a bf16 bucket
    per, _ = _parts(2, bf16=True, dp=64, reduce_bucket_size=5e7)
    assert per["gradients"] == pytest.approx(4 / 64)
    assert per["reduce bucket"] == pytest.approx(5e7 * 2 / 1e9)
    # ZeRO-3: the weights too, plus what is gathered: the live limit and the prefetch bucket
    per, _ = _parts(3, bf16=True, dp=64, max_live_parameters=1e8, prefetch_bucket_size=5e7)
    assert per["weights"] == pytest.approx(2 / 64)
    assert per["ZeRO-3 live parameters"] == pytest.approx(2 * 1.5e8 / 1e9)
    # ZeRO-3 in fp32 has no separate master copy (DeepSpeed reuses the fp32 partition)
    per, _ = _parts(3, bf16=False, dp=64)
    assert per["optimizer"] == pytest.approx(8 / 64)
    # offload: masters, moments and the gradient partition in host memory (16 / N)
    per, host = _parts(3, bf16=True, dp=64, offload=True)
    assert "optimizer" not in per and host["optimizer (offloaded)"] == pytest.approx(16 / 64)


def test_the_cpu_optimizer_steps_temporaries_count_beyond_the_freed_activations():
    """torch's unfused AdamW makes two temporaries of the tensor it steps (the flat partition
    at ZeRO-1/2, a sub-group at ZeRO-3, the largest parameter at ZeRO-0), after the backward
    pass has freed the activations: only their excess is added, on the CPU only."""
    cfg = preset("tiny")
    p = 1_000_000_000
    counts = memory.ParameterCounts(vocab=0, layers=p, other=0, largest=10_000_000)

    def parts(stage, device, **kw):
        z = memory.ZeroSettings(stage=stage, **kw)
        return memory.estimate(cfg, counts, memory.RankLayout(
            dp=2, zero=z, bf16=True, micro_batch_size=1, seq_length=8, device=device)).parts

    cpu = parts(2, "cpu")
    assert cpu["optimizer step"] == pytest.approx(
        2 * 4 * p / 2 - cpu["activations"] - cpu["MLM logits"])
    assert "optimizer step" not in parts(2, "cuda")  # fused on a GPU: in place
    sub = parts(3, "cpu", sub_group_size=1e8)
    assert sub["optimizer step"] == pytest.approx(
        2 * 4 * 1e8 - sub["activations"] - sub["MLM logits"])
    assert parts(0, "cpu")["optimizer step"] == pytest.approx(
        2 * 4 * 10_000_000 - cpu["activations"] - cpu["MLM logits"])
    assert "optimizer step" not in parts(2, "cpu", offload_optimizer=True)  # CPU Adam


def test_zero3_offloads_optimizer_set_up_buffer_counts_beyond_the_activations():
    """ZeRO-3 with an offloaded optimizer steps once on an fp32 buffer of the largest
    sub-group at set-up, beside the gradient partition it keeps, before any activation."""
    cfg = preset("tiny")
    p = 1_000_000_000
    counts = memory.ParameterCounts(vocab=0, layers=p, other=0, largest=0)
    for device in ("cpu", "cuda"):
        est = memory.estimate(cfg, counts, memory.RankLayout(
            dp=4, zero=memory.ZeroSettings(stage=3, offload_optimizer=True, sub_group_size=1e8),
            bf16=True, micro_batch_size=1, seq_length=8, device=device))
        assert est.host["optimizer set-up"] == pytest.approx(
            4 * 1e8 - est.parts["activations"] - est.parts["MLM logits"])
        assert est.host["optimizer (offloaded)"] == pytest.approx(16 * p / 4)
    est = memory.estimate(cfg, counts, memory.RankLayout(
        dp=4, zero=memory.ZeroSettings(stage=3), bf16=True, micro_batch_size=1, seq_length=8))
    assert "optimizer set-up" not in est.host


def test_stage3_config_sets_the_regimes_limits():
    z = memory.ZeroSettings.from_ds_config(json.loads(
        (REPO / "ds_configs" / "zero3.json").read_text()))
    assert (z.stage, z.max_live_parameters, z.prefetch_bucket_size, z.reduce_bucket_size,
            z.param_persistence_threshold) == (3, 1e8, 5e7, 5e7, 1e4)
    # DeepSpeed's defaults where the file is silent (1e9 live: a large model stays gathered)
    z = memory.ZeroSettings.from_ds_config({"zero_optimization": {"stage": 3}})
    assert (z.max_live_parameters, z.reduce_bucket_size) == (1e9, 5e8)
    off = memory.ZeroSettings.from_ds_config(json.loads(
        (REPO / "ds_configs" / "zero3_offload.json").read_text()))
    assert off.offload_optimizer and off.offload_param


def test_activations_grow_with_the_micro_batch_and_shrink_with_recompute():
    cfg = preset("debertav3-base")
    counts = memory.ParameterCounts(vocab=0, layers=1, other=0, largest=0)

    def acts(b: int, recompute: bool = False) -> float:
        return memory.estimate(cfg, counts, memory.RankLayout(
            micro_batch_size=b, seq_length=512, recompute=recompute, bf16=True)).parts

    one, eight = acts(1), acts(8)
    # all but disentangled attention's position projections (one per micro-batch) grow with b
    assert 7.5 * one["activations"] < eight["activations"] < 8 * one["activations"]
    assert eight["MLM logits"] == pytest.approx(8 * one["MLM logits"])
    assert acts(8, recompute=True)["activations"] < eight["activations"] / 10


def test_peak_bytes_on_the_cpu_is_the_resident_peak():
    before = memory.peak_bytes(torch.device("cpu"))
    assert memory.resident_bytes() <= before + 1e6
    block = torch.ones(200_000_000 // 4)  # 200 MB touched
    assert memory.peak_bytes(torch.device("cpu")) >= memory.resident_bytes() >= 2e8
    del block


def test_peak_bytes_never_falls_when_the_resident_size_does(monkeypatch):
    """The kernel's high-water mark (ru_maxrss) lags the resident size, so a peak read while the
    size was above it must hold after the size falls (a logged peak fell 0.5614 → 0.5611 GB)."""
    now = memory.peak_bytes(torch.device("cpu"))
    monkeypatch.setattr(memory, "resident_bytes", lambda: now + 5e8)
    assert memory.peak_bytes(torch.device("cpu")) == now + 5e8
    monkeypatch.setattr(memory, "resident_bytes", lambda: 1.0)
    assert memory.peak_bytes(torch.device("cpu")) == now + 5e8


def test_estimate_cost_plans_each_zero_stage(single_process_group):
    tool = load_tool("estimate_cost")
    lines = []
    rows = tool.memory_plan(preset("debertav3-large"), gpus=64, gpu_memory_gb=80, tp=1,
                            global_batch=8192, seq_length=512, bf16=True, recompute=False,
                            print_fn=lines.append)
    assert [r[0] for r in rows] == ["ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + offload"]
    for name, micro, accumulation, est in rows:
        assert micro * accumulation * 64 == 8192, name
        assert est.device_bytes * (1 + tool.ALLOCATOR_SLACK) <= (80 - tool.CUDA_RUNTIME_GB) * 1e9
    # each stage shards more: a rank's model states fall stage by stage
    states = [sum(v for k, v in r[3].parts.items() if k not in ("activations", "MLM logits"))
              for r in rows]
    assert states[0] > states[1] > states[3]
    assert "719.2M parameters" in lines[0] and len(lines) == 6
    # a GPU too small for one sequence at ZeRO-0 is said so
    rows = tool.memory_plan(preset("debertav3-large"), gpus=64, gpu_memory_gb=8, tp=1,
                            global_batch=8192, seq_length=512, bf16=True, recompute=False,
                            print_fn=lines.append)
    assert rows[0][1] is None and "does not fit even at micro-batch 1" in lines[7]
