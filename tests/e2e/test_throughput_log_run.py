"""A real 4-step run of rtd_scale/pretrain.py (one process, tiny preset): TFLOP/s per device,
MFU, memory and ETA in its log lines follow flops.py's formula, and its TensorBoard holds the
resolved configs and the scalars; its save after step 2, held 3 s (a slow file system, the
test-only fault ``hold``), is no training time. The formulas themselves are in
tests/unit/test_throughput_log.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from rtd_scale import flops
from tests.helpers.env import REPO, free_port, standalone_env


HOLD_S = 3  # the save after step 2 takes at least this long


@pytest.fixture(scope="module")
def tiny_run(wiki_shards, tmp_path_factory):
    """4 steps of the tiny preset, one process, ZeRO 0, a user-set peak of 1 GFLOP/s; saved
    after step 2 (held ``HOLD_S`` by the test-only fault ``hold``) and after step 4."""
    tok, prefix = wiki_shards
    save = tmp_path_factory.mktemp("throughput") / "run"
    args = ["--ds_config", "ds_configs/zero0.json", "--preset", "tiny", "--data-path", prefix,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", "4",
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--seed", "11", "--eval-iters", "0", "--log-interval", "1",
            "--peak-tflops-per-device", "0.001", "--log-throughput", "--save-interval", "2"]
    env = dict(standalone_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RTD_FAULTS=f"hold={HOLD_S}@2:0")
    r = subprocess.run([sys.executable, "rtd_scale/pretrain.py", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return args, save, r.stdout


def test_mfu_in_the_log_is_flops_py_formula_for_the_step(tiny_run):
    from rtd_scale.arguments import build_parser, config_from_args

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


def test_a_slow_save_is_left_out_of_the_training_time(tiny_run):
    """The save after step 2 took over ``HOLD_S`` seconds: its line and TensorBoard's
    ``timers/save-checkpoint-time`` say so, and iteration 3's time per iteration (so its
    tokens/s, TFLOP/s, MFU and ETA) describes its training only — a step here takes well under
    a second, where the save counted in would make it over ``HOLD_S``."""
    from tests.helpers.launcher import scalars

    _, save, stdout = tiny_run
    saved = re.search(rf"^saved checkpoint at iteration +2 to {re.escape(str(save))}/global_step2"
                      r" in ([\d.]+) s$", stdout, re.M)
    assert saved and float(saved[1]) >= HOLD_S, stdout[-3000:]
    tb = scalars(str(save / "tensorboard"))["timers/save-checkpoint-time"]
    assert sorted(tb) == [2, 4] and tb[2] >= HOLD_S and tb[4] < HOLD_S, tb
    assert float(saved[1]) == pytest.approx(tb[2], abs=0.05)
    ms = {int(m[1]): float(m[2]) for m in re.finditer(
        r" iteration +(\d+)/ +4 \|.*?elapsed time per iteration \(ms\): ([\d.]+)", stdout)}
    assert ms[3] < 1000 * HOLD_S / 2, ms
