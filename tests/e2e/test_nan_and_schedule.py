"""Non-finite iterations, a new learning-rate schedule on resume and TensorBoard after a kill -9.

- A non-finite iteration is skipped exactly — parameters, AdamW's moments and step count as if
  it never happened — at every ZeRO stage, decided without reading a value on the host;
- `--lr 1e6` through the real launcher: detected, counted, no checkpoint after the first NaN,
  stopped with one line naming the last good checkpoint, exit status 1;
- `--load` with another schedule: an error naming both values, or the flags' schedule
  (`--override-opt_param-scheduler`) or the checkpoint's (`--use-checkpoint-opt_param-scheduler`)
  from the first resumed iteration, to 1e-12;
- after a real SIGKILL and `--load`, TensorBoard holds one value per step per tag.
"""
from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from rtd_scale.training.optimizer import NonFiniteSkippingAdamW
from rtd_scale.training.loop import NonFiniteGuard
from tests.helpers.damage import nan_into_first_float
from tests.helpers.env import REPO, free_port
from tests.helpers import dist as harness
from tests.helpers.launcher import launch, scalars

# ---------------------------------------------------------------------------------------------
# Exact skip semantics, every ZeRO stage (one process, the real DeepSpeed engine)
# ---------------------------------------------------------------------------------------------


CASES = [(0, False), (1, False), (2, False), (3, False), (0, True), (1, True), (2, True),
         (3, True)]  # (ZeRO stage, bf16)


def _skip_worker(ctx, cases):
    """Per (stage, bf16): good step, non-finite step, good step — and good, good; returns both
    runs' parameters, the guard's counts and the schedule's position."""
    import deepspeed

    from rtd_scale import distributed
    from rtd_scale.config import Precision, Sharing
    from rtd_scale.training import engine as engine_mod
    from tests.helpers.dist_workers import build, fixed_batch, tiny_config

    def run(stage: int, bf16: bool, with_bad_step: bool):
        cfg = tiny_config(Sharing.GDES)
        cfg.train.micro_batch_size = cfg.train.global_batch_size = 4
        cfg.train.train_iters = 10
        cfg.optim.lr, cfg.optim.min_lr, cfg.optim.lr_warmup_iters = 1e-2, 1e-2, 0
        if bf16:
            cfg.train.precision = Precision.BF16
        cfg.validate()
        model = build(cfg, tp_size=1)
        distributed.seed_after_build(ctx, 7)
        ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": stage}}, cfg,
                                          data_parallel_size=1, gradient_accumulation_steps=1)
        eng = engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
        guard = NonFiniteGuard(eng, ctx.device, limit=0)
        ids, idx = fixed_batch(b=4, s=32)
        counts = []
        for s in ([0, "bad", 1] if with_bad_step else [0, 1]):
            out = eng(ids, idx, 0 if s == "bad" else s)
            # a loss that is inf while its gradients are finite: the gate alone catches it
            loss = out.loss + float("inf") if s == "bad" else out.loss
            eng.backward(guard.gate(loss))
            eng.step()
            guard.after_step()
            counts.append(guard.consecutive())
        skipped = guard.take_interval_count()
        params = list({id(p): p for p in model.parameters()}.values())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            state = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        return state, counts, skipped, eng.lr_scheduler.iterations

    return {case: (run(*case, True), run(*case, False)) for case in cases}


def test_a_nonfinite_step_is_skipped_exactly_at_every_zero_stage():
    (results,) = harness.run(_skip_worker, CASES, world_size=1)
    for case, ((state_a, counts, skipped, epoch), (state_b, _, skipped_b, epoch_b)) in (
            results.items()):
        assert counts == [0, 1, 0] and skipped == 1 and skipped_b == 0, case
        # a skipped iteration does not advance the schedule (Megatron-LM's rule)
        assert epoch == 2 and epoch_b == 2, case
        # the parameters after good, skipped, good equal those after good, good — bitwise: the
        # skipped step moved neither the parameters nor AdamW's moments nor its step count
        assert state_a.keys() == state_b.keys()
        for name in state_a:
            assert torch.equal(state_a[name], state_b[name]), (case, name)
            assert torch.isfinite(state_a[name]).all(), (case, name)


def test_stage0_optimizer_matches_adamw_and_never_reads_the_device():
    """NonFiniteSkippingAdamW: torch.optim.AdamW's update to rounding on finite steps; a
    step with a NaN gradient changes nothing; no operation reads a value on the host."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    w0 = torch.randn(7, 5)
    ours, ref = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    kw = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)
    opt = NonFiniteSkippingAdamW([ours], **kw)
    opt_ref = torch.optim.AdamW([ref], foreach=False, **kw)
    grads = [torch.randn(7, 5) for _ in range(4)]

    host_reads = []

    class CountHostReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("aten::_local_scalar_dense", "aten::is_nonzero",
                                     "aten::item"):
                host_reads.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    for i, g in enumerate(grads):
        if i == 2:  # a non-finite step in between: nothing may move
            before = (ours.detach().clone(), {k: v.clone() for k, v in opt.state[ours].items()})
            ours.grad = g.clone()
            ours.grad[3, 1] = float("nan")
            with CountHostReads():
                opt.step()
            assert bool(opt.skipped)
            assert torch.equal(ours.detach(), before[0])
            for k, v in opt.state[ours].items():
                assert torch.equal(v, before[1][k]), k
        ours.grad, ref.grad = g.clone(), g.clone()
        with CountHostReads():
            opt.step()
        opt_ref.step()
        assert not bool(opt.skipped)
        torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert host_reads == []
    assert float(opt.state[ours]["step"]) == 4.0
    with CountHostReads():
        gated = NonFiniteGuard.gate(torch.tensor(float("nan"), requires_grad=True))
        finite = NonFiniteGuard.gate(torch.tensor(3.25, requires_grad=True))
    assert host_reads == []
    assert math.isnan(gated.item()) and finite.item() == 3.25


# ---------------------------------------------------------------------------------------------
# Through the launcher
# ---------------------------------------------------------------------------------------------


def _args(wiki_shards, save, iters: int, *extra: str, zero: int = 3) -> list[str]:
    tok, prefix = wiki_shards
    return ["--ds_config", f"ds_configs/zero{zero}.json", "--preset", "tiny", "--data-path",
            prefix, "--tokenizer-model", tok, "--save", str(save), "--train-iters", str(iters),
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--seed", "11", "--eval-iters", "0", *extra]


def _error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.e2e
@pytest.mark.parametrize("zero, ranks", [(3, 2), (0, 1)])
def test_huge_lr_is_detected_counted_and_stopped(wiki_shards, tmp_path, zero, ranks):
    save = tmp_path / "run"
    r = launch(_args(wiki_shards, save, 30, "--lr", "1e6", "--lr-warmup-iters", "0",
                     "--log-interval", "2", "--save-interval", "1",
                     "--max-consecutive-nonfinite-iters", "3", zero=zero), ranks=ranks)
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]  # a user error: not restarted
    iters = {int(m.group(1)): m.group(0) for m in
             re.finditer(r" iteration +(\d+)/ +30 \|.*", r.stdout)}
    # iteration 1 steps at lr 1e6 (finite), so iteration 2's forward overflows
    assert "mlm loss: NAN" in iters[2] and "number of skipped iterations:   1 |" in iters[2]
    assert "number of skipped iterations:   0 |" in iters[1]
    s = scalars(str(save / "tensorboard"))
    assert s["optim/skipped_iters"] == {1: 0.0, 2: 1.0, 4: 2.0}
    # checked at the log interval: iterations 2–4 were skipped, 3 in a row, stop at 4
    (line,) = _error_lines(r)
    assert line == (f"error: iterations 2–4 (3 in a row, --max-consecutive-nonfinite-iters 3) "
                    f"had a non-finite loss or gradient norm and were skipped; stopped at "
                    f"iteration 4; the last good checkpoint is {save}/global_step1; lower --lr "
                    f"or raise --lr-warmup-iters, then resume with --load {save} "
                    f"--override-opt_param-scheduler")
    assert "Traceback" not in r.stderr
    # saves were due at every iteration: none after the first non-finite one
    assert sorted(p.name for p in save.glob("global_step*")) == ["global_step1"]
    assert r.stdout.count("note: not saving at iteration") == 2  # 2 and 3 (4 stops first)
    assert "note: not saving at iteration 2: the last 1 iteration(s)" in r.stdout


def _lr_of_first_resumed_iteration(r: subprocess.CompletedProcess, step: int) -> float:
    m = re.search(rf"learning rate of iteration {step}: (\S+)", r.stdout)
    assert m, r.stdout[-3000:] + r.stderr[-3000:]
    return float(m.group(1))


@pytest.mark.e2e
def test_a_new_schedule_on_resume(wiki_shards, tmp_path):
    base = tmp_path / "base"
    common = ("--log-interval", "1", "--save-interval", "4", "--lr-warmup-iters", "2")
    r = launch(_args(wiki_shards, base, 4, "--lr", "1e-3", *common, zero=0), ranks=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    new = ("--lr", "5e-4", "--min-lr", "1e-4", "--lr-decay-iters", "340")

    # neither flag: one line naming both values of each changed field, before anything runs
    runs = {}
    for name, flag in (("plain", ()), ("override", ("--override-opt_param-scheduler",)),
                       ("checkpoint", ("--use-checkpoint-opt_param-scheduler",))):
        run_dir = tmp_path / name
        import shutil

        shutil.copytree(base, run_dir)
        runs[name] = (run_dir, launch(_args(wiki_shards, run_dir, 6, "--load", str(run_dir),
                                            *common, *new, *flag, zero=0), ranks=1))
    run_dir, r = runs["plain"]
    assert r.returncode == 2
    (line,) = _error_lines(r)
    assert line == (f"error: --load {run_dir}: the learning-rate schedule differs from the "
                    "checkpoint's (--lr 0.001 → 0.0005, --min-lr 0 → 0.0001, --lr-decay-iters "
                    "unset (= --train-iters 4) → 340); pass --override-opt_param-scheduler to "
                    "use the new values from the first resumed iteration, or "
                    "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    assert "Traceback" not in r.stderr
    assert not (run_dir / "global_step6").exists()

    # the flags win from iteration 5: megatron-core's linear decay after 4 updates of 8
    # samples, warm-up 2 × 8, decay 340 × 8, from 5e-4 to 1e-4
    run_dir, r = runs["override"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = 1e-4 + (5e-4 - 1e-4) * (1 - (32 - 16) / (340 * 8 - 16))
    assert _lr_of_first_resumed_iteration(r, 5) == pytest.approx(want, rel=1e-12)
    tb = scalars(str(run_dir / "tensorboard"))
    assert tb["optim/lr"][5] == pytest.approx(want, rel=1e-6)  # TensorBoard keeps float32
    assert "--override-opt_param-scheduler: the new values apply" in r.stdout

    # the checkpoint's schedule: 1e-3, no floor, decay over --train-iters (now 6 × 8 samples)
    run_dir, r = runs["checkpoint"]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    want = 1e-3 * (1 - (32 - 16) / (6 * 8 - 16))
    assert _lr_of_first_resumed_iteration(r, 5) == pytest.approx(want, rel=1e-12)
    assert "--use-checkpoint-opt_param-scheduler: the checkpoint's values are kept" in r.stdout


# ---------------------------------------------------------------------------------------------
# TensorBoard after kill -9 and --load
# ---------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_tensorboard_holds_one_value_per_step_after_kill_and_resume(wiki_shards, tmp_path):
    save = tmp_path / "run"
    args = _args(wiki_shards, save, 14, "--log-interval", "1", "--save-interval", "4",
                 "--lr", "1e-3", zero=0)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, "rtd_scale/pretrain.py", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:  # kill -9 once iteration 10 is logged: 9 and 10 are after the save
        seen.append(line)
        if line.lstrip().startswith("iteration       10/"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)[-3000:]
    before = scalars(str(save / "tensorboard"))
    assert sorted(before["loss/mlm"]) == list(range(1, 11))

    r = launch(_args(wiki_shards, save, 14, "--log-interval", "1", "--save-interval", "4",
                     "--lr", "1e-3", "--load", str(save), zero=0), ranks=1)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "at iteration 8" in r.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(save / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"loss/mlm", "loss/rtd", "optim/lr", "optim/skipped_iters"} <= set(tags)
    for tag in tags:
        steps = [e.step for e in acc.Scalars(tag)]
        # one value each, in order: a step's scalars, or a save's time at the steps it saved
        saves = [4, 8, 12, 14] if tag == "timers/save-checkpoint-time" else None
        assert steps == (saves or list(range(1, 15))), (tag, steps)
    after = {e.step: e.value for e in acc.Scalars("loss/mlm")}
    for step in range(1, 9):  # the first run's values up to its checkpoint are kept
        assert after[step] == before["loss/mlm"][step]
    # steps 9 and 10 are the resumed run's (the same data and masks: bitwise the same value)
    assert after[9] == before["loss/mlm"][9]


# ---------------------------------------------------------------------------------------------
# A checkpoint damaged in place (its sizes intact) is refused at load, before any step
# ---------------------------------------------------------------------------------------------


def _damaged_checkpoint_worker(ctx, save_dir):
    from rtd_scale import distributed
    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.config import Sharing
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.checkpoint import load, save
    from tests.helpers.dist_workers import build, fixed_batch, tiny_config

    cfg = tiny_config(Sharing.GDES)
    cfg.train.micro_batch_size = cfg.train.global_batch_size = 4
    cfg.validate()

    def engine():
        model = build(cfg, tp_size=1)
        distributed.seed_after_build(ctx, 7)
        ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": 2}}, cfg,
                                          data_parallel_size=1, gradient_accumulation_steps=1)
        return engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())

    eng = engine()
    ids, idx = fixed_batch(b=4, s=32)
    eng.backward(eng(ids, idx, 0).loss)
    eng.step()
    path = save.save(eng, save_dir, step=1, rank=0, client_state={"step": 1},
                     layout={"world_size": 1})
    load.load(engine(), save_dir, rank=0)  # intact: loads
    # one weight turned NaN in place, as a damaged disk block does: the file keeps its size
    nan_into_first_float(os.path.join(path, "mp_rank_00_model_states.pt"))
    try:
        load.load(engine(), save_dir, rank=0)
    except UserInputError as e:
        return str(e)
    return None


def test_a_checkpoint_damaged_in_place_is_refused_at_load(tmp_path):
    (message,) = harness.run(_damaged_checkpoint_worker, str(tmp_path / "run"), world_size=1)
    assert message is not None, "a NaN weight loaded without a word"
    ckpt = tmp_path / "run" / "global_step1"
    assert message == (
        f"{ckpt}/mp_rank_00_model_states.pt: damaged: it holds 1 inf/NaN value(s) although its "
        "size matches the completion record (the loaded weights hold 1); resume from an earlier "
        f"checkpoint (--load DIR/global_stepN) or delete {ckpt}")
