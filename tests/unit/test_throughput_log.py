"""TFLOP/s per device, MFU, memory, loss scale and ETA in the log line and TensorBoard
(training/throughput.py). A real run's log lines and TensorBoard are in
tests/e2e/test_throughput_log_run.py."""
from __future__ import annotations


import pytest
import torch

from rtd_scale import flops
from rtd_scale.presets import preset
from rtd_scale.training.metrics import format_log_line
from rtd_scale.training.throughput import (DEVICE_PEAK_TFLOPS, ThroughputMeter, format_eta,
                                           memory_gib, peak_tflops, step_model_flops)

BASE = {"optim/lr": 1e-3, "loss/mlm": 6.9, "loss/rtd": 0.69, "loss/total": 41.4,
        "mlm/accuracy": 0.01, "rtd/replaced_fraction": 0.14, "optim/grad_norm": 1.5,
        "throughput/tokens_per_s": 1234.0, "optim/skipped_iters": 0.0}


def test_meter_is_flops_py_formula():
    cfg = preset("electra-small")
    cfg.data.seq_length, cfg.train.global_batch_size, cfg.train.train_iters = 128, 32, 100
    meter = ThroughputMeter(cfg, world_size=4, device=torch.device("cpu"))
    assert meter.peak is None  # CPU, no peak given: no MFU
    fpt = flops.rtd_flops_per_token(flops.dims_of(cfg))
    assert step_model_flops(cfg) == fpt * 32 * 128
    s = meter.scalars(steps=10, seconds=2.0, done=10)
    assert s["throughput/tflops_per_device"] == pytest.approx(fpt * 32 * 128 * 10 / 2.0 / 4 / 1e12,
                                                              rel=1e-12)
    assert "throughput/mfu" not in s
    assert s["time/eta_s"] == pytest.approx(90 * 0.2)
    s = meter.scalars(steps=10, seconds=4.0, done=20)  # the run's mean: 6 s for 20 steps
    assert s["time/eta_s"] == pytest.approx(80 * 0.3)

    cfg.train.peak_tflops_per_device = 100.0
    meter = ThroughputMeter(cfg, world_size=4, device=torch.device("cpu"))
    s = meter.scalars(steps=10, seconds=2.0, done=10)
    assert s["throughput/mfu"] == pytest.approx(
        flops.mfu(fpt, 32 * 128 * 10 / 2.0 / 4, 100e12), rel=1e-12)
    assert s["throughput/mfu"] == pytest.approx(s["throughput/tflops_per_device"] / 100.0)


def test_peak_by_name_and_off_cuda():
    assert DEVICE_PEAK_TFLOPS["h100"] == 989.4 and DEVICE_PEAK_TFLOPS["h200"] == 989.4
    assert peak_tflops(123.0, torch.device("cpu")) == 123.0
    assert peak_tflops(None, torch.device("cpu")) is None
    assert memory_gib(torch.device("cpu")) is None


def test_log_line_fields():
    plain = format_log_line(3, 10, 48, 250.0, dict(BASE), 16)
    assert plain.endswith("number of skipped iterations:   0 |")
    assert "TFLOP/s" not in plain and "ETA" not in plain
    full = dict(BASE, **{"throughput/tflops_per_device": 412.345, "throughput/mfu": 0.41676,
                         "memory/allocated_gib": 10.5, "memory/reserved_gib": 20.25,
                         "memory/peak_allocated_gib": 30.125, "optim/loss_scale": 65536.0,
                         "time/eta_s": 3723.4})
    line = format_log_line(3, 10, 48, 250.0, full, 16)
    assert line.endswith(
        "number of skipped iterations:   0 | throughput per GPU (TFLOP/s/GPU): 412.3 | "
        "MFU: 41.68% | memory GiB (max over ranks) allocated/reserved/peak: "
        "10.50/20.25/30.12 | loss scale: 65536.0 | ETA: 1:02:03 |")
    assert format_eta(90061) == "1 day, 1:01:01"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory and device names")
def test_cuda_memory_and_peak_by_name():
    dev = torch.device("cuda")
    x = torch.empty(256, 1024, 1024, dtype=torch.uint8, device=dev)  # 0.25 GiB
    m = memory_gib(dev)
    assert m["memory/allocated_gib"] >= 0.25
    assert m["memory/reserved_gib"] >= m["memory/allocated_gib"]
    assert m["memory/peak_allocated_gib"] >= m["memory/allocated_gib"]
    del x
    name = torch.cuda.get_device_name(dev)
    peak = peak_tflops(None, dev)
    if "H200" in name and "NVL" not in name:
        assert peak == 989.4, name
    elif "H100" in name and "NVL" not in name and "PCIe" not in name:
        assert peak == 989.4, name
    print(f"device {name!r}: peak {peak} TFLOP/s")
