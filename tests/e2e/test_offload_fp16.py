"""ZeRO-Offload and fp16 with the real DeepSpeed engine: the offloaded optimizer is DeepSpeed's
CPU Adam in AdamW mode and moves the weights as torch's AdamW does (ZeRO 1 and 2, in-process);
ZeRO-3 with parameters and optimizer offloaded trains through the real launcher, with the
ds_config's activation_checkpointing mapped to megatron-core's recompute; --fp16 trains where
DeepSpeed's accelerator runs fp16, and is one line of refusal where it does not."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from bench.fp16_check import iterations
from rtd_scale import pretrain
from rtd_scale.training.ds_config import fp16_supported
from tests.helpers.env import REPO
from tests.helpers import dist as harness
from tests.helpers.launcher import launch, repeated_lines
from rtd_scale.cli_errors import EXIT_USER_ERROR

pytestmark = pytest.mark.e2e


def _offload_worker(ctx, stages):
    """Per ZeRO stage: three steps on one batch with the optimizer offloaded (DeepSpeed's CPU
    Adam; and torch's AdamW with zero_force_ds_cpu_optimizer=false) and without offload;
    returns each run's optimizer class name and final parameters."""
    from rtd_scale import distributed
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.config import Sharing
    from tests.helpers.dist_workers import build, fixed_batch, tiny_config

    def run(stage: int, extra: dict):
        cfg = tiny_config(Sharing.GDES)
        cfg.train.micro_batch_size = cfg.train.global_batch_size = 4
        cfg.train.train_iters = 10
        cfg.optim.lr, cfg.optim.min_lr, cfg.optim.lr_warmup_iters = 1e-2, 1e-2, 0
        cfg.optim.weight_decay = 0.1  # large enough that a coupled decay would show
        cfg.validate()
        model = build(cfg, tp_size=1)
        distributed.seed_after_build(ctx, 7)
        ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": stage}, **extra}, cfg,
                                          data_parallel_size=1, gradient_accumulation_steps=1)
        eng = engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
        ids, idx = fixed_batch(b=4, s=32)
        for step in range(3):
            out = eng(ids, idx, step)
            eng.backward(out.loss)
            eng.step()
        state = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        return type(eng.basic_optimizer).__name__, state

    out = {}
    for stage in stages:
        offload = {"offload_optimizer": {"device": "cpu", "pin_memory": False}}
        off = {"zero_optimization": {"stage": stage, **offload}}
        out[stage] = {"plain": run(stage, {}), "cpu_adam": run(stage, off),
                      "torch_on_cpu": run(stage, {**off, "zero_force_ds_cpu_optimizer": False})}
    return out


def test_offloaded_optimizer_is_cpu_adam_and_matches_adamw():
    (results,) = harness.run(_offload_worker, [1, 2], world_size=1)
    for stage, runs in results.items():
        assert runs["cpu_adam"][0] == "DeepSpeedCPUAdam", stage
        assert runs["torch_on_cpu"][0] == "AdamW", stage
        assert runs["plain"][0] == "AdamW", stage
        plain = runs["plain"][1]
        moved = max((plain[n] - runs["cpu_adam"][1][n]).abs().max().item() for n in plain)
        for variant in ("cpu_adam", "torch_on_cpu"):
            for name, value in runs[variant][1].items():
                # same AdamW (decoupled decay, same groups and hyper-parameters) to rounding
                torch.testing.assert_close(value, plain[name], rtol=1e-5, atol=1e-6,
                                           msg=f"{variant} stage {stage} {name}")
        assert moved < 1e-5, stage


def _args(wiki_shards, save, ds_config: str, iters: int, *extra: str) -> list[str]:
    tok, prefix = wiki_shards
    return ["--ds_config", ds_config, "--preset", "tiny", "--data-path", prefix,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", str(iters),
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--lr", "1e-3", "--lr-warmup-iters", "1", "--log-interval", "1",
            "--save-interval", "0", "--seed", "11", *extra]


def test_zero3_offload_with_activation_checkpointing_through_the_launcher(wiki_shards, tmp_path):
    user = json.loads((REPO / "ds_configs" / "zero3_offload.json").read_text())
    user["activation_checkpointing"] = {"partition_activations": False}
    ds = tmp_path / "zero3_offload_ckpt.json"
    ds.write_text(json.dumps(user))
    save = tmp_path / "run"
    r = launch(_args(wiki_shards, save, str(ds), 4), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    # the op's first build is silent for minutes: the run says what it is waiting for, once
    # (not once per rank: 512 copies on 512 ranks), as it prints every other line
    assert (r.stdout + r.stderr).count("CPU Adam op, compiled on first use") == 1
    assert repeated_lines(r) == {}
    rows = iterations(r.stdout)
    assert len(rows) == 4
    for row in rows:
        for key in ("mlm loss", "rtd loss"):
            assert math.isfinite(float(row[key])), row
        assert int(row["number of skipped iterations"]) == 0
    resolved = json.loads((save / "ds_config.json").read_text())
    zero = resolved["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == zero["offload_param"]["device"] == "cpu"
    assert resolved["activation_checkpointing"] == {"partition_activations": False}
    config = json.loads((save / "config.json").read_text())
    assert config["model"]["recompute_activations"] is True


def test_fp16_trains_or_is_refused_in_one_line(wiki_shards, tmp_path, capsys, monkeypatch):
    save = tmp_path / "run"
    argv = _args(wiki_shards, save, "ds_configs/zero2_fp16.json", 6, "--fp16")
    if not fp16_supported():
        monkeypatch.chdir(REPO)
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert pretrain.main(argv) == EXIT_USER_ERROR
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["error: --ds_config ds_configs/zero2_fp16.json: --fp16: DeepSpeed runs "
                       "fp16 only where the accelerator supports it (a CUDA GPU, or a CPU with "
                       "oneDNN fp16 kernels), and this machine's does not; use --bf16 (or "
                       "fp32) here"]
        assert not save.exists()
        return
    # an initial scale of 2^24 overflows at first: DeepSpeed halves it and skips those steps
    user = json.loads((REPO / "ds_configs" / "zero2_fp16.json").read_text())
    user["fp16"]["initial_scale_power"] = 24
    ds = tmp_path / "fp16.json"
    ds.write_text(json.dumps(user))
    argv[1] = str(ds)
    r = launch(argv, ranks=min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2,
               timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = iterations(r.stdout)
    assert len(rows) == 6
    skipped = [int(row["number of skipped iterations"]) for row in rows]
    assert sum(skipped) >= 1 and skipped[0] == 1
    assert math.isfinite(float(rows[-1]["mlm loss"]))
    scales = [float(row["loss scale"]) for row in rows if "loss scale" in row]
    assert scales and scales[0] <= 2.0 ** 24 and scales[-1] < 2.0 ** 24
    assert re.search(r"\bfp16\b", r.stdout)
