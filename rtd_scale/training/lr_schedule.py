"""The learning-rate schedule: megatron-core's ``OptimizerParamScheduler``, advanced once per
optimizer step that updated the weights.

Units follow Megatron-LM's training loop (``megatron/training/training.py``:
``get_optimizer_param_scheduler`` and ``train_step``): the scheduler counts samples, and each
applied optimizer step advances it by the global batch size. ``--lr-warmup-iters N`` and
``--lr-decay-iters N`` mean N × global-batch-size samples, ``--lr-*-samples`` are samples and
``--lr-warmup-fraction`` is a fraction of the decay length (``OptimConfig.schedule_samples``).
So the lr of update u (1-based, no skipped update before it) is megatron-core's ``get_lr`` at
``num_steps = (u − 1) × global_batch_size``: with a warm-up, update 1 uses ``--lr-warmup-init``
(0 by default) and update ``warmup + 1`` is the first at the peak; the decay reaches ``min_lr``
at ``num_steps = decay`` (update ``decay + 1``). Counting optimizer steps, never micro-batches,
is what tests/unit/test_schedule.py::test_warmup_counts_optimizer_steps pins.

Skipped updates do not advance the schedule (Megatron-LM steps its scheduler only when
``update_successful``):

- DeepSpeed decides the skip on the host for ZeRO stages 1–3, its bf16 optimizers and fp16's
  loss scaler (``optimizer.overflow``) and then does not call the scheduler: no extra sync;
- at ZeRO stage 0 in fp32, ``optimizer.NonFiniteSkippingAdamW`` decides on the device. The
  scheduler's step then only records that flag (copied into pinned host memory behind a CUDA
  event) and applies the increment at the next optimizer step (a step pre-hook), or when its
  state or lr is read (``settle``). That wait covers the previous step's work only, while the
  current iteration's forward and backward are already queued, so the device never runs dry;
  on CPU it is a plain read. The loop reads the lr it logs through ``lr()``, which settles at
  the start of a log iteration: a wait at the log interval only.

Resume: the checkpoint (DeepSpeed's ``lr_scheduler`` entry) restores the position
(``num_steps``) only; lengths, peak and floor are this run's ``OptimConfig``, which
``engine.resolve_resume_optimizer`` already reconciled with the checkpoint's
(``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``). A checkpoint of
the earlier LambdaLR schedule (``last_epoch`` counted iterations) resumes at ``last_epoch`` ×
global batch size. A resume at another global batch keeps an iteration schedule at the step it
reached (``keep_iterations``), moved inside the load when the checkpoint's batch is known
beforehand (``expect_checkpoint_batch``), so the one lr refresh after the load
(``checkpoint.refresh_learning_rate``) sets the lr the next update uses.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from rtd_scale.config import OptimConfig
from rtd_scale.training.optimizer import NonFiniteSkippingAdamW


class _DeviceFlag:
    """A bool tensor on its way to the host: pinned memory and a CUDA event on GPU."""

    def __init__(self, flag: Optional[torch.Tensor]):
        self.event = None
        self.host = flag
        if flag is not None and flag.is_cuda:
            self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self) -> bool:
        if self.host is None:
            return False
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host)


class MegatronLRScheduler(OptimizerParamScheduler):
    """megatron-core's scheduler as DeepSpeed's client ``lr_scheduler``: ``step()`` without an
    argument (DeepSpeed's call after an applied step) advances by ``global_batch_size`` samples.

    Args:
        optimizer: the torch optimizer whose ``param_groups`` get ``lr`` and ``weight_decay``;
            a group built with ``weight_decay`` 0 keeps 0 (megatron-core's ``wd_mult``).
        optim: the schedule's values (``OptimConfig``).
        train_iters: optimizer steps of the run (the default decay length).
        global_batch_size: samples per optimizer step.
        device_skip_flag: the ``NonFiniteSkippingAdamW`` whose ``skipped`` flag decides, on the
            device, whether a step counts (ZeRO stage 0 in fp32); None where DeepSpeed decides.

    Where the warm-up is not shorter than the decay (a short test run of a long recipe),
    megatron-core asserts; here its ``get_lr`` is evaluated on those lengths all the same: the
    lr warms up through the run (``RunConfig.validate`` warns).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, optim: OptimConfig, *, train_iters: int,
                 global_batch_size: int, device_skip_flag: Optional[torch.optim.Optimizer] = None):
        warmup, decay, wsd = optim.schedule_samples(train_iters, global_batch_size)
        self.samples_per_step = global_batch_size
        self._wd_mult = [1.0 if g.get("weight_decay", 0.0) > 0 else 0.0
                         for g in optimizer.param_groups]
        self._flag_source = device_skip_flag
        self._pending: Optional[_DeviceFlag] = None
        self._checkpoint_batch: Optional[tuple[int, OptimConfig]] = None
        super().__init__(
            optimizer, init_lr=optim.lr_warmup_init, max_lr=optim.lr, min_lr=optim.min_lr,
            lr_warmup_steps=warmup, lr_decay_steps=decay if warmup < decay else warmup + 1,
            lr_decay_style=optim.lr_decay_style.value, start_wd=optim.weight_decay,
            end_wd=optim.weight_decay, wd_incr_steps=train_iters * global_batch_size,
            wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True, wsd_decay_steps=wsd,
            lr_wsd_decay_style=optim.lr_wsd_decay_style.value)
        if self.lr_decay_steps != decay:  # megatron-core asserts warmup < decay; see above
            self.lr_decay_steps = decay
            self.step(0)
        if device_skip_flag is not None:
            device_skip_flag.register_step_pre_hook(lambda *_: self.settle())

    def step(self, increment: Optional[int] = None) -> None:
        """Advance by ``increment`` samples and set every group's lr and weight decay; without
        an argument (after an applied optimizer step), by one global batch — at once, or at the
        next ``settle`` where the device decides whether the step was skipped."""
        if increment is None:
            self.settle()
            if self._flag_source is not None:
                self._pending = _DeviceFlag(self._flag_source.skipped)
                return
            increment = self.samples_per_step
        # paired by position: a group DeepSpeed dropped (an empty one) would shift the rest
        assert len(self.optimizer.param_groups) == len(self._wd_mult), "param groups changed"
        for group, mult in zip(self.optimizer.param_groups, self._wd_mult):
            group["wd_mult"] = mult  # checkpointed param groups may predate the key
        super().step(increment)

    def settle(self) -> None:
        """Apply the recorded step unless its update was skipped (reads the device's flag)."""
        pending, self._pending = self._pending, None
        if pending is not None and not pending.read():
            self.step(self.samples_per_step)

    @property
    def iterations(self) -> float:
        """Applied optimizer steps so far (``num_steps`` / global batch size), settled."""
        self.settle()
        return self.num_steps / self.samples_per_step

    def lr(self) -> float:
        """The lr the next update uses (settled), of the first parameter group."""
        self.settle()
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        self.settle()
        return super().state_dict()

    def _moves(self, saved_samples_per_step: int, optim: OptimConfig) -> bool:
        """Whether a position saved at ``saved_samples_per_step`` samples per step moves to the
        same number of applied steps at this run's batch (:meth:`keep_iterations`)."""
        return not (saved_samples_per_step == self.samples_per_step or optim.lr_warmup_samples
                    or optim.lr_decay_samples is not None
                    or optim.lr_wsd_decay_samples is not None)

    def keep_iterations(self, saved_samples_per_step: int, optim: OptimConfig) -> bool:
        """After a resume at another global batch size: move the restored position (samples at
        the checkpoint's batch) to the same number of applied optimizer steps at this run's
        batch, so that a schedule given in iterations (--lr-warmup-iters, --lr-decay-iters, the
        default decay over --train-iters) continues at the step it reached, in warm-up and
        decay alike, instead of at the samples it read (megatron-core counts samples: a phase 1
        at twice phase 2's batch would otherwise resume twice as far into the schedule). A
        schedule with any length in samples (``--lr-*-samples``) keeps its sample position.
        Returns whether the position moved. Before a load, :meth:`expect_checkpoint_batch`
        makes the same move inside ``load_state_dict``."""
        if not self._moves(saved_samples_per_step, optim):
            return False
        self.settle()
        steps = self.num_steps / saved_samples_per_step
        self.num_steps = 0
        self.step(round(steps * self.samples_per_step))
        return True

    def expect_checkpoint_batch(self, saved_samples_per_step: int, optim: OptimConfig) -> None:
        """Before a load: the checkpoint was saved at ``saved_samples_per_step`` samples per
        step. The next ``load_state_dict`` restores the position already moved as
        :meth:`keep_iterations` moves it, so the one lr refresh after the load
        (``checkpoint.refresh_learning_rate``) reads the position the run continues at."""
        self._checkpoint_batch = (saved_samples_per_step, optim)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position only (see the module docstring), moved to this run's batch
        when :meth:`expect_checkpoint_batch` said the checkpoint's."""
        if "num_steps" in state_dict:
            num_steps = state_dict["num_steps"]
        else:  # the earlier LambdaLR schedule counted iterations, skipped ones included
            num_steps = int(state_dict["last_epoch"]) * self.samples_per_step
        saved, self._checkpoint_batch = self._checkpoint_batch, None
        if "num_steps" in state_dict and saved is not None and self._moves(*saved):
            num_steps = round(num_steps / saved[0] * self.samples_per_step)
        self._pending = None
        self.num_steps = 0
        self.step(num_steps)


def build_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig, *, train_iters: int,
                    global_batch_size: int) -> MegatronLRScheduler:
    """The run's scheduler over ``optimizer``; the device decides skipped steps when it is a
    ``NonFiniteSkippingAdamW`` (ZeRO stage 0 in fp32)."""
    flag = optimizer if isinstance(optimizer, NonFiniteSkippingAdamW) else None
    return MegatronLRScheduler(optimizer, optim, train_iters=train_iters,
                               global_batch_size=global_batch_size, device_skip_flag=flag)
