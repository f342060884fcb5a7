"""TFLOP/s per device, MFU, memory, loss scale and ETA in the log line and TensorBoard
(training/throughput.py), and the resolved configs as TensorBoard text."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from rtd_scale import flops
from rtd_scale.config import preset
from rtd_scale.training.metrics import format_log_line
from rtd_scale.training.throughput import (DEVICE_PEAK_TFLOPS, ThroughputMeter, format_eta,
                                           memory_gib, peak_tflops, step_model_flops)
from tests.helpers.env import REPO, free_port, standalone_env

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


@pytest.fixture(scope="module")
def tiny_run(wiki_shards, tmp_path_factory):
    """4 steps of the tiny preset, one process, ZeRO 0, a user-set peak of 1 GFLOP/s."""
    tok, prefix = wiki_shards
    save = tmp_path_factory.mktemp("throughput") / "run"
    args = ["--ds_config", "ds_configs/zero0.json", "--preset", "tiny", "--data-path", prefix,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", "4",
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--seed", "11", "--eval-iters", "0", "--log-interval", "1",
            "--peak-tflops-per-device", "0.001", "--log-throughput"]
    env = dict(standalone_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r = subprocess.run([sys.executable, "rtd_scale/pretrain.py", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return args, save, r.stdout


def test_mfu_in_the_log_is_flops_py_formula_for_the_step(tiny_run):
    from rtd_scale.pretrain import build_parser, config_from_args

    args, save, stdout = tiny_run
    cfg = config_from_args(build_parser().parse_args(args))
    cfg.model.vocab_size = json.loads((save / "config.json").read_text())["model"]["vocab_size"]
    assert cfg.model.vocab_size == 1000  # the tokenizer's
    fpt = flops.rtd_flops_per_token(flops.dims_of(cfg))
    lines = re.findall(r" iteration +(\d+)/ +4 \|.*", stdout)
    assert len(lines) == 4
    for line in re.finditer(r" iteration +(\d+)/ +4 \|.*", stdout):
        text = line.group(0)
        ms = float(re.search(r"elapsed time per iteration \(ms\): ([\d.]+)", text).group(1))
        tflops = float(re.search(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.e+-]+)", text)
                       .group(1))
        mfu = float(re.search(r"MFU: ([\d.e+-]+)%", text).group(1)) / 100
        want = fpt * 8 * 64 / (ms / 1000) / 1e12  # one device
        assert tflops == pytest.approx(want, rel=2e-3), text
        assert mfu == pytest.approx(want / 0.001, rel=2e-3), text
        assert re.search(r"ETA: \d+:\d\d:\d\d \|", text), text
        memory = re.search(r"memory GiB \(max over ranks\) allocated/reserved/peak: "
                           r"([\d.]+)/([\d.]+)/([\d.]+) \|", text)
        if torch.cuda.is_available():  # the run trains on the GPU
            allocated, reserved, peak = map(float, memory.groups())
            assert 0 < allocated <= reserved and allocated <= peak, text
        else:
            assert memory is None, text  # CPU: no CUDA memory to report
    assert "ETA: 0:00:00 |" in stdout.splitlines()[-1] or re.search(
        r"iteration +4/ +4 \|.*ETA: 0:00:00 \|", stdout)


def test_tensorboard_has_the_resolved_config_and_the_scalars(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, save, stdout = tiny_run
    acc = EventAccumulator(str(save / "tensorboard"))
    acc.Reload()
    texts = {}
    for tag in acc.Tags()["tensors"]:
        (event,) = acc.Tensors(tag)
        assert event.step == 0
        texts[tag] = event.tensor_proto.string_val[0].decode()
    run = texts["config/run/text_summary"]
    assert run.startswith("```\n") and run.endswith("\n```")
    assert json.loads(run[4:-4]) == json.loads((save / "config.json").read_text())
    ds = json.loads(texts["config/ds_config/text_summary"][4:-4])
    assert ds == json.loads((save / "ds_config.json").read_text())
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert sorted(scalars["throughput/mfu"]) == [1, 2, 3, 4]
    assert scalars["time/eta_s"][4] == 0.0
    step4 = re.search(r"iteration +4/ +4 \|.*", stdout).group(0)
    mfu = float(re.search(r"MFU: ([\d.e+-]+)%", step4).group(1)) / 100
    assert scalars["throughput/mfu"][4] == pytest.approx(mfu, rel=1e-3)
    assert "optim/loss_scale" not in scalars  # fp32: no loss scaler



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
