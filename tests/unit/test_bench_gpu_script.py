"""bench/gpu_rtd_step.py (and its pieces in bench/gpu/): the FLOP formula against its reference
H200 measurements, the kernel families, a failing row reported instead of raised. The whole
script at tiny sizes on CPU is in tests/tools/test_bench_gpu_script.py."""
from __future__ import annotations

import pytest
import torch

from bench import gpu_rtd_step as bench
from bench.gpu import census, run, workloads
from bench.gpu.report import results_table
from rtd_scale.flops import EncoderDims, RTDDims, mfu, rtd_flops_per_token, stack_flops_per_token

ELECTRA_LARGE = RTDDims(
    generator=EncoderDims(num_layers=24, hidden_size=256, ffn_hidden_size=1024),
    discriminator=EncoderDims(num_layers=24, hidden_size=1024, ffn_hidden_size=4096),
    embedding_size=1024, vocab_size=30522, seq_length=512, mask_prob=0.15)


def test_flops_reproduce_the_reference_mfu():
    """The reference Hugging Face rows (bench/gpu_rtd_step.py's anchors): 96.4k tokens/s is
    27.5% MFU of 754 TFLOP/s, 124.9k is 35.6%; the 24×1024 stack at 191.5k tokens/s is 376
    TFLOP/s."""
    per_token = rtd_flops_per_token(ELECTRA_LARGE)
    assert round(100 * mfu(per_token, 96.4e3, 754e12), 1) == 27.5
    assert round(100 * mfu(per_token, 124.9e3, 754e12), 1) == 35.6
    stack = stack_flops_per_token(EncoderDims(num_layers=24, hidden_size=1024,
                                              ffn_hidden_size=4096), 512)
    assert stack == 3 * 24 * (24 * 1024 ** 2 + 4 * 512 * 1024)
    assert round(stack * 191.5e3 / 1e12) == 376


def test_flops_count_the_mlm_head_at_masked_positions_only():
    more_masked = RTDDims(**{**ELECTRA_LARGE.__dict__, "mask_prob": 0.30})
    head = 3 * (2 * 256 * 1024 + 2 * 1024 * 30522)  # dense h_g -> E, vocabulary E -> V
    assert rtd_flops_per_token(more_masked) - rtd_flops_per_token(ELECTRA_LARGE) == \
        pytest.approx(0.15 * head)


def test_the_bench_rows_use_the_presets_dimensions():
    from rtd_scale.presets import preset

    cfg = workloads.rtd_config(workloads.WORKLOADS["electra-large"], tiny=False)
    assert cfg.rtd.mask_prob == 0.15 and cfg.train.micro_batch_size == 32
    assert workloads.rtd_dims(cfg) == ELECTRA_LARGE
    deberta = workloads.rtd_config(workloads.WORKLOADS["debertav3-large"], tiny=False)
    assert deberta.model.discriminator == preset("debertav3-large").model.discriminator
    assert deberta.model.sharing.value == "gdes" and deberta.train.micro_batch_size == 16
    # disentangled attention: 511 relative rows at seq 512 (256 buckets), credited as 4Rh per layer
    assert workloads.rtd_dims(deberta).relative_rows == 511
    assert rtd_flops_per_token(workloads.rtd_dims(deberta)) == pytest.approx(3_295_749_734.4)
    tiny = workloads.rtd_config(workloads.WORKLOADS["electra-large"], tiny=True)
    assert tiny.data.seq_length == 64
    assert tiny.model.generator.hidden_size < tiny.model.discriminator.hidden_size


@pytest.mark.parametrize("name,family", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention (flash/sdpa)"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention (flash/sdpa)"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>",
     "layernorm"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>",
     "copy/transpose"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
     "elementwise/gelu/dropout"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BitwiseXorFunctor<long>>",
     "int64/fp64 math (hash RNG)"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MaxOps<float>>>",
     "reduction/softmax/loss"),
    ("void at::native::indexSelectLargeIndex<float, long>", "index/gather/embedding"),
    ("Memcpy DtoH (Device -> Pageable)", "copy/transpose"),
    ("aten::addmm", "gemm"),
    ("aten::native_layer_norm_backward", "layernorm"),
])
def test_kernel_families(name, family):
    assert census.kernel_family(name) == family


def _tiny_settings():
    return bench.settings_from(bench.parse_args(["--device", "cpu", "--tiny"]))


@pytest.mark.parametrize("error,status", [
    (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)(
        "CUDA out of memory. Tried to allocate 2.00 GiB"), "OOM"),
    (RuntimeError("boom"), "error"),
])
def test_a_failing_row_is_reported_not_raised(monkeypatch, error, status):
    b = run.Bench(_tiny_settings())
    b.log = lambda *a, **k: None

    def fail(item):
        raise error

    monkeypatch.setattr(b, "build", fail)
    row = b.run(run.Item("electra-base", "rtd-engine"))
    assert row.status == status and row.tokens_per_s is None
    assert type(error).__name__ in row.note
    assert status in results_table(b)


def test_a_child_row_gets_the_runs_settings():
    """A torch.compile row runs in ``python -m bench.gpu.child`` under the parent's settings,
    handed over as JSON."""
    s = bench.settings_from(bench.parse_args(["--device", "cpu", "--tiny", "--zero-stage", "2",
                                              "--deadline-s", "12.5"]))
    assert workloads.Settings.from_json(s.to_json()) == s


def test_rows_past_the_deadline_are_skipped():
    b = run.Bench(_tiny_settings())
    b.t0 -= 10_000  # the deadline has passed
    row = b.run(run.Item("electra-large", "hf-eager"))
    assert row.status == "skipped" and "deadline" in row.note


def test_the_sync_census_counts_device_waits_not_the_data_wait_host_work():
    """``train_step`` decides ``has_padding`` on the host batch in its data-wait phase: host
    work, not a wait for the device; the same read in the forward, an ``.item()`` and a
    boolean-mask index are counted (on CPU, where host and device are one)."""
    from bench.gpu.timing import Stepper
    from rtd_scale.phases import PHASE_DATA_WAIT, PHASE_FORWARD

    host = torch.tensor([[1, 7, 0], [1, 8, 2]])
    x = torch.tensor([1.0, -2.0, 3.0])

    def run(i, timers):
        with timers(PHASE_DATA_WAIT):
            assert bool((host == 0).any())
        with timers(PHASE_FORWARD):
            assert bool((host == 0).any())
            assert x.sum().item() == 2.0
            assert x[x > 0].tolist() == [1.0, 3.0]

    res = census.SyncCensus.run(Stepper(run), 0, torch.device("cpu"))
    ops = sorted(site.rsplit("[", 1)[1].rstrip("]") for site, n in res["sites"].items()
                 for _ in range(n))
    assert ops == ["aten::_local_scalar_dense", "aten::_local_scalar_dense", "aten::index"], ops
    assert res["sync_ops"] == 3


def test_an_unknown_mode_of_a_row_is_an_error_not_another_row():
    from bench.gpu import hf_rows, rtd_rows

    with pytest.raises(ValueError,
                       match="arch 'bert': choose one of electra, deberta-v2, modernbert"):
        hf_rows.hf_rtd_step(None, "bert", _tiny_settings(), None)
    with pytest.raises(ValueError, match="impl 'stack-hf': choose"):
        rtd_rows.stack_mcore_step("stack-hf", workloads.stack_shape(True), _tiny_settings())


def test_the_core_table_plans_each_layouts_cores_and_skips_what_cannot_run_here():
    """``--cores`` (bench/device_check.sh's kernel table): per workload HF eager, then the
    engine once per core its attention has (DeBERTa sdpa / flex / flash, the modern block sdpa /
    flex, ELECTRA sdpa / te), HF compiled per workload last; the ModernBERT-base workload is
    the preset's 1,024 tokens. A core that cannot run here is skipped with its reason, before
    any model is built; an unknown core is refused in one line."""
    s = _tiny_settings()
    items = run.plan(s, ["debertav3-large", "modernbert-base", "electra-base"], {"stack"},
                     ("sdpa", "flex", "flash", "te"))
    assert [(i.workload, i.impl, i.core) for i in items] == [
        ("debertav3-large", "hf-eager", ""), ("debertav3-large", "rtd-engine", "sdpa"),
        ("debertav3-large", "rtd-engine", "flex"), ("debertav3-large", "rtd-engine", "flash"),
        ("modernbert-base", "hf-eager", ""), ("modernbert-base", "rtd-engine", "sdpa"),
        ("modernbert-base", "rtd-engine", "flex"),
        ("electra-base", "hf-eager", ""), ("electra-base", "rtd-engine", "sdpa"),
        ("electra-base", "rtd-engine", "te"),
        ("debertav3-large", "hf-compile", ""), ("modernbert-base", "hf-compile", ""),
        ("electra-base", "hf-compile", "")]
    assert items[1].diag == {"families", "phases"} and not items[2].diag
    modern = workloads.rtd_config(workloads.WORKLOADS["modernbert-base"], tiny=False)
    assert modern.data.seq_length == 1024 and modern.model.window_size == 128

    b = run.Bench(s)
    b.log = lambda *a, **k: None
    for item in items[2:4] + items[6:7] + items[9:10]:  # flex, flash, flex, te on the CPU
        row = b.run(item)
        assert row.status == "skipped" and row.tokens_per_s is None, (item, row.note)
        assert f"core {item.core}" in row.title
    notes = [r.note for r in b.rows]
    assert notes[0] == "the flex core trains on CUDA only"
    assert "flash" in notes[1] and "te" not in notes[1]
    assert "transformer-engine" in notes[3]
    assert "skipped" in results_table(b)
    with pytest.raises(SystemExit):
        bench.parse_args(["--cores", "sdpa,cudnn"])
