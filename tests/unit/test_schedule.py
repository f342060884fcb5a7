"""The learning-rate schedule (training/lr_schedule.py): megatron-core's OptimizerParamScheduler
driven as Megatron-LM's training loop drives it, per optimizer step (never per micro-batch),
skipped steps not counted, resumable."""
from __future__ import annotations

import math

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rtd_scale.config import ConfigError, OptimConfig
from rtd_scale.presets import preset
from rtd_scale.training.optimizer import NonFiniteSkippingAdamW
from rtd_scale.training.lr_schedule import MegatronLRScheduler, build_scheduler

G = 8  # global batch size


def _sgd():
    w, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [w], "weight_decay": 0.01},
                            {"params": [b], "weight_decay": 0.0}], lr=1.0)


def _ours_per_update(optim: OptimConfig, train_iters: int, n: int) -> list[float]:
    """The lr each of n updates uses, stepping as DeepSpeed does (``step()`` after each)."""
    opt = _sgd()
    sched = MegatronLRScheduler(opt, optim, train_iters=train_iters, global_batch_size=G)
    used = []
    for _ in range(n):
        used.append(opt.param_groups[0]["lr"])
        sched.step()
    return used


def _megatron_per_update(n: int, **kw) -> list[float]:
    """megatron-core's scheduler as Megatron-LM's train loop steps it: + global batch per
    successful iteration (megatron/training/training.py)."""
    opt = _sgd()
    sched = OptimizerParamScheduler(opt, start_wd=0.01, end_wd=0.01, wd_incr_steps=10**9,
                                    wd_incr_style="constant", **kw)
    used = []
    for _ in range(n):
        used.append(opt.param_groups[0]["lr"])
        sched.step(increment=G)
    return used


@pytest.mark.parametrize("style, extra, mextra", [
    ("linear", {}, {}),
    ("cosine", {}, {}),
    ("inverse-square-root", {}, {}),
    ("constant", {}, {}),
    ("WSD", {"lr_wsd_decay_iters": 40, "lr_wsd_decay_style": "cosine"},
     {"wsd_decay_steps": 40 * G, "lr_wsd_decay_style": "cosine"}),
    ("WSD", {"lr_wsd_decay_iters": 30}, {"wsd_decay_steps": 30 * G,
                                         "lr_wsd_decay_style": "exponential"}),
])
def test_each_style_equals_megatron_core(style, extra, mextra):
    optim = OptimConfig(lr=1e-3, min_lr=1e-5, lr_warmup_iters=10, lr_decay_iters=100,
                        lr_decay_style=style, **extra)
    optim.validate()
    ours = _ours_per_update(optim, train_iters=120, n=120)
    ref = _megatron_per_update(120, init_lr=0.0, max_lr=1e-3, min_lr=1e-5,
                               lr_warmup_steps=10 * G, lr_decay_steps=100 * G,
                               lr_decay_style=style, **mextra)
    assert ours == ref  # exactly: the same code on the same numbers
    # and the values themselves (update u uses get_lr at (u - 1) × G samples)
    assert ours[0] == 0.0 and ours[5] == pytest.approx(0.5e-3)  # warm-up from 0
    assert ours[10] == pytest.approx(1e-3)  # update 11: the first at the peak
    if style == "cosine":  # halfway through the decay: (max + min) / 2
        assert ours[55] == pytest.approx(0.5 * (1e-3 + 1e-5))
    if style == "inverse-square-root":  # lr · sqrt(warmup / t)
        assert ours[40] == pytest.approx(1e-3 * math.sqrt(10 / 40))
    if style == "constant":
        assert ours[110] == 1e-3
    if style == "WSD" and extra["lr_wsd_decay_iters"] == 40:
        assert ours[60] == 1e-3  # stable until 100 − 40
        assert ours[80] == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))  # halfway: cosine 1/2
    if style != "constant":
        assert ours[110] == 1e-5  # past the decay: the floor


def test_warmup_counts_optimizer_steps():
    """Warm-up 100 optimizer steps, whatever the accumulation: megatron-core's formula —
    update 1 at lr_warmup_init (0), update 100 at 99/100 of the peak, update 101 the first at
    the peak (megatron-core counts from 0, so the peak is one update after the warm-up); linear
    decay to min_lr at 300."""
    cfg = preset("tiny")
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.min_lr = 1e-3, 100, 0.0
    used = _ours_per_update(cfg.optim, train_iters=300, n=300)
    assert used[0] == 0.0
    assert used[99] == pytest.approx(0.99e-3)
    assert used[100] == pytest.approx(1e-3) and max(used) == used[100]
    assert used.index(max(used)) == 100
    assert used[199] == pytest.approx(1e-3 * (300 - 199) / 200)  # update 200
    assert used[299] == pytest.approx(1e-3 / 200)  # update 300: one step before the floor


def test_warmup_fraction_and_init():
    optim = OptimConfig(lr=2e-3, lr_warmup_fraction=0.1, lr_warmup_init=1e-4,
                        lr_decay_style="cosine")
    optim.validate()
    used = _ours_per_update(optim, train_iters=50, n=50)
    # warm-up = 0.1 × (50 × 8) = 40 samples = 5 updates, from 1e-4
    assert used[0] == pytest.approx(1e-4)
    assert used[1] == pytest.approx(1e-4 + (2e-3 - 1e-4) * 8 / 40)
    assert used[5] == pytest.approx(2e-3)
    assert used == _megatron_per_update(50, init_lr=1e-4, max_lr=2e-3, min_lr=0.0,
                                        lr_warmup_steps=0.1 * 400, lr_decay_steps=400,
                                        lr_decay_style="cosine")


def test_decay_and_warmup_in_samples():
    optim = OptimConfig(lr=1e-3, min_lr=1e-4, lr_warmup_samples=20, lr_decay_samples=100)
    optim.validate()
    assert optim.schedule_samples(1000, G) == (20, 100, None)
    used = _ours_per_update(optim, train_iters=1000, n=20)
    assert used[2] == pytest.approx(1e-3 * 16 / 20)  # 16 samples into a 20-sample warm-up
    assert used[3] == pytest.approx(1e-3 - 0.9e-3 * (24 - 20) / 80)  # 24 samples: decaying
    assert used[12] == pytest.approx(1e-4 + 0.9e-3 * (100 - 96) / 80)  # 96 samples
    assert used[13:] == [1e-4] * 7  # 104 samples > 100: the floor


def test_resume_restores_the_position_and_this_runs_values():
    optim = OptimConfig(lr=1e-3, lr_warmup_iters=4, lr_decay_style="cosine")
    opt = _sgd()
    a = MegatronLRScheduler(opt, optim, train_iters=20, global_batch_size=G)
    for _ in range(7):
        a.step()
    state = a.state_dict()
    assert state["num_steps"] == 7 * G
    straight = [opt.param_groups[0]["lr"]]
    for _ in range(5):
        a.step()
        straight.append(opt.param_groups[0]["lr"])

    opt2 = _sgd()
    b = MegatronLRScheduler(opt2, optim, train_iters=20, global_batch_size=G)
    b.load_state_dict(state)
    resumed = [opt2.param_groups[0]["lr"]]
    for _ in range(5):
        b.step()
        resumed.append(opt2.param_groups[0]["lr"])
    assert resumed == straight
    # an --override-opt_param-scheduler resume: the position from the checkpoint, the values
    # (here a new peak) from this run's config
    c = MegatronLRScheduler(_sgd(), OptimConfig(lr=5e-4, lr_warmup_iters=4,
                                                lr_decay_style="cosine"),
                            train_iters=20, global_batch_size=G)
    c.load_state_dict(state)
    assert c.lr() == pytest.approx(straight[0] / 2)
    # a checkpoint of the earlier LambdaLR schedule: last_epoch iterations
    d = MegatronLRScheduler(_sgd(), optim, train_iters=20, global_batch_size=G)
    d.load_state_dict({"last_epoch": 7, "base_lrs": [1e-3, 1e-3]})
    assert d.num_steps == 7 * G and d.lr() == straight[0]


def _six_steps_at_g():
    """(OptimConfig, the scheduler, its state) after 6 steps at global batch G: warm-up 4,
    linear decay to step 20."""
    optim = OptimConfig(lr=1e-3, lr_warmup_iters=4)
    a = MegatronLRScheduler(_sgd(), optim, train_iters=20, global_batch_size=G)
    for _ in range(6):
        a.step()
    return optim, a, a.state_dict()


def test_resume_at_another_batch_keeps_the_step_of_an_iteration_schedule():
    """Phase 2 of a two-phase run (batch 2G after 6 steps at G): an iteration-based schedule
    (warm-up 4, linear decay over 20 steps) continues at step 6, where the restored sample
    position alone (6 G samples = 3 steps of 2G) would put it back in the warm-up; a schedule
    with a length in samples keeps the sample position."""
    optim, a, state = _six_steps_at_g()
    b = MegatronLRScheduler(_sgd(), optim, train_iters=20, global_batch_size=2 * G)
    b.load_state_dict(state)
    assert b.lr() == pytest.approx(1e-3 * 3 / 4)  # 6 G samples: step 3 of 2G, warming up
    assert b.keep_iterations(G, optim) is True
    assert b.num_steps == 6 * 2 * G and b.iterations == 6
    assert b.lr() == pytest.approx(1e-3 * (1 - (6 - 4) / (20 - 4)))  # step 6: decaying
    assert a.lr() == pytest.approx(b.lr(), rel=1e-12)  # the run that kept its batch
    assert b.keep_iterations(2 * G, optim) is False  # the same batch: nothing to move
    samples = OptimConfig(lr=1e-3, lr_warmup_samples=4 * G, lr_decay_samples=20 * G)
    c = MegatronLRScheduler(_sgd(), samples, train_iters=20, global_batch_size=2 * G)
    c.load_state_dict(state)
    assert c.keep_iterations(G, samples) is False and c.num_steps == 6 * G


def test_a_load_told_the_checkpoints_batch_refreshes_the_lr_once_at_the_moved_step():
    """``--load`` at another global batch (resume.resume): the scheduler told the checkpoint's
    batch before the load restores the position already at the step it reached, so the one lr
    refresh of ``checkpoint.load`` (``refresh_learning_rate``) sets step 6's lr, with no move
    after it; the same position as ``keep_iterations`` after a plain load. A schedule with a
    length in samples, and a checkpoint of the earlier LambdaLR schedule (its ``last_epoch``
    counts iterations already), keep their positions."""
    from types import SimpleNamespace

    from rtd_scale.training.checkpoint.load import refresh_learning_rate

    optim, a, state = _six_steps_at_g()
    b = MegatronLRScheduler(_sgd(), optim, train_iters=20, global_batch_size=2 * G)
    b.expect_checkpoint_batch(G, optim)
    b.load_state_dict(state)
    step6 = 1e-3 * (1 - (6 - 4) / (20 - 4))
    assert b.num_steps == 6 * 2 * G
    assert b.optimizer.param_groups[0]["lr"] == pytest.approx(step6, rel=1e-12)
    refresh_learning_rate(SimpleNamespace(lr_scheduler=b))
    assert b.num_steps == 6 * 2 * G and b.iterations == 6
    assert b.lr() == pytest.approx(step6, rel=1e-12) and b.lr() == pytest.approx(a.lr(), rel=1e-12)
    moved_after = MegatronLRScheduler(_sgd(), optim, train_iters=20, global_batch_size=2 * G)
    moved_after.load_state_dict(state)
    assert moved_after.keep_iterations(G, optim) is True
    assert moved_after.num_steps == b.num_steps
    # told once: a later load restores the position as saved
    b.load_state_dict(state)
    assert b.num_steps == 6 * G
    samples = OptimConfig(lr=1e-3, lr_warmup_samples=4 * G, lr_decay_samples=20 * G)
    c = MegatronLRScheduler(_sgd(), samples, train_iters=20, global_batch_size=2 * G)
    c.expect_checkpoint_batch(G, samples)
    c.load_state_dict(state)
    assert c.num_steps == 6 * G
    d = MegatronLRScheduler(_sgd(), optim, train_iters=20, global_batch_size=2 * G)
    d.expect_checkpoint_batch(G, optim)
    d.load_state_dict({"last_epoch": 6, "base_lrs": [1e-3, 1e-3]})
    assert d.num_steps == 6 * 2 * G and d.lr() == pytest.approx(step6, rel=1e-12)

def test_weight_decay_groups_keep_their_decay():
    opt = _sgd()
    sched = MegatronLRScheduler(opt, OptimConfig(weight_decay=0.05), train_iters=10,
                                global_batch_size=G)
    sched.step()
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]


def test_a_skipped_step_leaves_the_schedule_where_it_was():
    """ZeRO stage 0 in fp32: the device decides; the schedule learns it before the next update
    (a step pre-hook) and the update after a skipped one uses the skipped one's lr."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 3))
    opt = NonFiniteSkippingAdamW([{"params": [w], "weight_decay": 0.01}], lr=1.0)
    optim = OptimConfig(lr=1e-3, lr_warmup_iters=4)
    sched = build_scheduler(opt, optim, train_iters=10, global_batch_size=G)
    assert isinstance(sched, MegatronLRScheduler) and sched._flag_source is opt
    seen = []

    def update(bad: bool):
        w.grad = torch.randn(3, 3)
        if bad:
            w.grad[0, 0] = float("nan")
        opt.step()  # the pre-hook settles the previous step first
        seen.append(opt.param_groups[0]["lr"])
        sched.step()  # DeepSpeed's call after the optimizer's step

    for bad in (False, False, True, False, False):
        update(bad)
    assert seen == pytest.approx([0.0, 0.25e-3, 0.5e-3, 0.5e-3, 0.75e-3])
    assert sched.iterations == 4  # five steps, one skipped
    assert sched.state_dict()["num_steps"] == 4 * G
    # DeepSpeed's own skip (ZeRO 1-3, bf16, fp16): it does not call step() at all, and a
    # plain torch optimizer needs no flag
    assert build_scheduler(_sgd(), optim, train_iters=10, global_batch_size=G)._flag_source is None


def test_warmup_longer_than_the_run_warms_up_throughout():
    """megatron-core asserts warm-up < decay; a short run of a long recipe (the tiny preset's
    30 warm-up steps in a 6-step test) warms up throughout instead, with a warning."""
    with pytest.warns(UserWarning, match="peak learning rate is never reached"):
        cfg = preset("tiny")
        cfg.train.train_iters = 6
        cfg.validate()
    used = _ours_per_update(cfg.optim, train_iters=6, n=6)
    assert used == pytest.approx([cfg.optim.lr * k / 30 for k in range(6)])


@pytest.mark.parametrize("fields, message", [
    ({"lr_decay_style": "exp"}, "optim.lr_decay_style 'exp': choose one of constant, linear"),
    ({"lr_decay_style": "WSD"}, "--lr-decay-style WSD needs .* --lr-wsd-decay-iters"),
    ({"lr_warmup_iters": 5, "lr_warmup_fraction": 0.1}, "--lr-warmup-fraction and"),
    ({"lr_warmup_iters": 5, "lr_warmup_samples": 10}, "--lr-warmup-iters and "
                                                      "--lr-warmup-samples"),
    ({"lr_decay_iters": 5, "lr_decay_samples": 10}, "--lr-decay-iters and --lr-decay-samples"),
    ({"lr_warmup_fraction": 1.0}, r"optim.lr_warmup_fraction must be in \[0, 1\)"),
    ({"lr_warmup_init": 1.0}, r"optim.lr_warmup_init must be in \[0, optim.lr 0.001\]"),
    ({"lr_wsd_decay_style": "step"}, "optim.lr_wsd_decay_style 'step'"),
])
def test_schedule_flags_are_checked(fields, message):
    with pytest.raises(ConfigError, match=message):
        OptimConfig(lr=1e-3, **fields).validate()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-flag path on CUDA")
def test_a_skipped_step_on_cuda_reaches_the_schedule_through_pinned_memory():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 3, device="cuda"))
    opt = NonFiniteSkippingAdamW([{"params": [w], "weight_decay": 0.01}], lr=1.0)
    sched = build_scheduler(opt, OptimConfig(lr=1e-3, lr_warmup_iters=4), train_iters=10,
                            global_batch_size=G)
    seen = []
    for bad in (False, False, True, False, False):
        w.grad = torch.randn(3, 3, device="cuda")
        if bad:
            w.grad[0, 0] = float("nan")
        opt.step()
        seen.append(opt.param_groups[0]["lr"])
        sched.step()
        assert sched._pending is not None and sched._pending.event is not None
        assert sched._pending.host.is_pinned()
    assert seen == pytest.approx([0.0, 0.25e-3, 0.5e-3, 0.5e-3, 0.75e-3])
    assert sched.iterations == 4
