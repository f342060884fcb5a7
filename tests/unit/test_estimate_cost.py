"""tools/estimate_cost.py: the RTD step's model FLOPs against a hand computation. The command
itself (its output and usage errors) is in tests/tools/test_estimate_cost_cli.py."""
from __future__ import annotations

import pytest

from rtd_scale.presets import preset
from tests.helpers.tools import load_tool

estimate_cost = load_tool("estimate_cost")


def test_debertav3_large_per_token_by_hand():
    # discriminator 24 × 1024, generator 12 × 1024, FFN 4096, s 512, V 128,100, E 1024, p 0.15;
    # disentangled attention reads R = 511 of the 2 × 256 relative embeddings at s 512
    h, f, s, v, p, r = 1024, 4096, 512, 128_100, 0.15, 511
    layer_matmul = 6 * (4 * h * h + 2 * h * f)  # 75,497,472
    layer_attention = 12 * (s + r) * h  # QKᵀ, × V, c2p, p2c: 12,570,624
    assert layer_matmul == 75_497_472 and layer_attention == 12_570_624
    mlm_head = p * 6 * (h * h + h * v)  # masked positions only
    rtd_head = 6 * (h * h + h)
    hand = 36 * (layer_matmul + layer_attention) + mlm_head + rtd_head
    assert hand == pytest.approx(3_295_749_734.4)

    got = estimate_cost.rtd_flops_per_token(preset("debertav3-large"))
    assert got.generator_matmul == 12 * layer_matmul
    assert got.discriminator_matmul == 24 * layer_matmul
    assert got.generator_attention == 12 * layer_attention
    assert got.discriminator_attention == 24 * layer_attention
    assert got.embedding_projection == 0  # DeBERTaV3: table width = hidden size
    assert got.mlm_head == pytest.approx(mlm_head)
    assert got.rtd_head == rtd_head
    assert got.total == pytest.approx(hand)

    # the regime: 8192 × 512 tokens per step, 500,000 steps
    total = got.total * 8192 * 512 * 500_000
    assert total == pytest.approx(6.9117e21, rel=1e-4)
    gpu_h, wall_h = estimate_cost.gpu_hours(total, 8192 * 512 * 500_000.0, mfu=0.4,
                                            peak_tflops=989, gpus=64)
    assert gpu_h == pytest.approx(total / (0.4 * 989e12) / 3600)
    assert wall_h == pytest.approx(gpu_h / 64)


def test_relative_rows_follow_the_sequence_and_the_attention_type():
    """R is what model/disentangled.py projects: 255 rows at s 128, none with BERT attention."""
    cfg = preset("debertav3-large")
    short = estimate_cost.rtd_flops_per_token(cfg, seq_length=128)
    assert short.discriminator_attention == 24 * 12 * (128 + 255) * 1024
    cfg.model.attention_type = "bert"
    bert = estimate_cost.rtd_flops_per_token(cfg)
    assert bert.discriminator_attention == 24 * 12 * 512 * 1024
    assert bert.total == pytest.approx(3_069_699_686.4)


def test_electra_projection_and_narrow_generator():
    # electra-small: table width 128 projected to 64 (generator) and 256 (discriminator)
    got = estimate_cost.rtd_flops_per_token(preset("electra-small"))
    assert got.embedding_projection == 6 * 128 * 64 + 6 * 128 * 256
    assert got.mlm_head == pytest.approx(0.15 * 6 * (64 * 128 + 128 * 30_522))
    assert got.generator_matmul == 12 * 6 * (4 * 64 * 64 + 2 * 64 * 256)


def test_mask_prob_scales_only_the_mlm_head():
    cfg = preset("debertav3-base")
    a = estimate_cost.rtd_flops_per_token(cfg, mask_prob=0.15)
    b = estimate_cost.rtd_flops_per_token(cfg, mask_prob=0.30)
    assert b.mlm_head == pytest.approx(2 * a.mlm_head)
    assert b.total - a.total == pytest.approx(a.mlm_head)


def test_gpu_hours_from_measured_throughput():
    gpu_h, wall_h = estimate_cost.gpu_hours(1e21, 3.6e12, tokens_per_s=1e6, gpus=8)
    assert wall_h == pytest.approx(1000.0)  # 3.6e12 tokens / 1e6 per s = 3.6e6 s
    assert gpu_h == pytest.approx(8000.0)
    with pytest.raises(ValueError, match="--gpus"):
        estimate_cost.gpu_hours(1e21, 1e12, tokens_per_s=1e6)


def test_modernbert_base_gated_ffn_and_local_layers_by_hand():
    """The modern block: GeGLU's three matrices (6hf), and in the 14 local layers of 22 (7 of 11
    in the generator) each query attends to the keys of its 128-token window, 124.9375 on
    average at s 1,024 (1,024 · 129 − 64 · 65 pairs); a naive count over the pairs agrees."""
    h, f, s, v, p = 768, 1152, 1024, 50_368, 0.15
    keys = (s * 129 - 64 * 65) / s
    assert keys == 124.9375 == sum(min(i + 64, s - 1) - max(i - 64, 0) + 1 for i in range(s)) / s
    layer_matmul = 6 * (4 * h * h + 3 * h * f)
    global_attention, local_attention = 12 * s * h, 12 * keys * h
    got = estimate_cost.rtd_flops_per_token(preset("modernbert-base"))
    assert got.discriminator_matmul == 22 * layer_matmul
    assert got.generator_matmul == 11 * layer_matmul
    assert got.discriminator_attention == pytest.approx(8 * global_attention
                                                        + 14 * local_attention)
    assert got.generator_attention == pytest.approx(4 * global_attention + 7 * local_attention)
    assert got.mlm_head == pytest.approx(p * 6 * (h * h + h * v))
    assert got.total == pytest.approx(1.1690e9, rel=1e-4)
    # a window that holds the sequence: every layer attends to all s keys (the control)
    whole = estimate_cost.rtd_flops_per_token(preset("modernbert-base"), seq_length=64)
    assert whole.discriminator_attention == 22 * 12 * 64 * h


def test_masked_lm_control_by_hand_and_equal_compute():
    """rtd.objective=mlm: debertav3-large's discriminator (24 × 1024) and its MLM head alone;
    an RTD step's FLOPs buy 1.4762 of its steps."""
    from rtd_scale.config import apply_override

    h, f, s, v, p, r = 1024, 4096, 512, 128_100, 0.15, 511
    layer = 6 * (4 * h * h + 2 * h * f) + 12 * (s + r) * h
    hand = 24 * layer + p * 6 * (h * h + h * v)
    assert hand == pytest.approx(2_232_634_982.4)
    cfg = preset("debertav3-large")
    apply_override(cfg, "rtd.objective=mlm")
    got = estimate_cost.rtd_flops_per_token(cfg)
    assert got.generator_matmul == 24 * 6 * (4 * h * h + 2 * h * f)  # the one encoder
    assert got.discriminator_matmul == got.discriminator_attention == got.rtd_head == 0
    assert got.total == pytest.approx(hand)
    mlm = estimate_cost.masked_lm_flops_per_token(preset("debertav3-large"))
    assert mlm.total == pytest.approx(hand)
    rtd = estimate_cost.rtd_flops_per_token(preset("debertav3-large"))
    assert rtd.total / mlm.total == pytest.approx(3_295_749_734.4 / 2_232_634_982.4)
    assert rtd.total / mlm.total == pytest.approx(1.4762, abs=1e-4)


def test_equal_compute_line_and_a_bad_objective(capsys):
    assert estimate_cost.main(["--preset", "debertav3-large"]) == 0
    out = capsys.readouterr().out
    # 500,000 × 3,295,749,734.4 / 2,232,634,982.4 steps
    assert ("equal compute: the masked-LM control (--set rtd.objective=mlm, 2.2326e+09 FLOPs "
            "per token) takes 738,085 steps of 4,194,304 tokens for these 6.9117e+21 FLOPs"
            ) in out
    assert estimate_cost.main(["--preset", "debertav3-large", "--set", "rtd.objective=mlm"]) == 0
    out = capsys.readouterr().out
    assert "masked LM (rtd.objective=mlm) 24 × 1024 (FFN 4096)" in out
    assert "regime:    500,000 steps, 2.0972e+12 tokens, 4.6822e+21 FLOPs" in out
    assert "equal compute" not in out
    assert estimate_cost.main(["--set", "rtd.objective=bert"]) == 2
    assert "--set rtd.objective=bert: expected one of rtd, mlm" in capsys.readouterr().err
