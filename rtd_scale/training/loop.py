"""The training loop: micro-batches → DeepSpeed engine → metrics, checkpoints, TensorBoard."""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rtd_scale.config import RunConfig
from rtd_scale.data.packed import PackedDataset, micro_batches
from rtd_scale.distributed import DeepSpeedMpu, ParallelContext
from rtd_scale.training import checkpoint
from rtd_scale.training.pipeline import pipeline_train_step
from rtd_scale.training.metrics import (MetricAccumulator, TensorBoardLogger, format_log_line,
                                        grad_norm, table_cosine)


@dataclass
class TrainResult:
    """What the loop saw: logged (step, scalars) pairs on the logging rank."""

    first_step: int
    last_step: int
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    checkpoint_dir: Optional[str] = None
    interrupted: bool = False  # stopped early by the exit signal, after saving


class ExitSignal:
    """Megatron-LM's ``--exit-signal-handler``: remember that ``signum`` arrived; the loop then
    saves a checkpoint after the current step and returns. All ranks agree through one MAX
    all-reduce per step (only while the handler is installed)."""

    def __init__(self, signum: Optional[int]):
        self.signum, self.received = signum, False
        if signum is not None:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def any_rank_received(self, device) -> bool:
        if self.signum is None:
            return False
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def train(cfg: RunConfig, ctx: ParallelContext, engine, dataset: PackedDataset, *,
          start_step: int, consumed_samples: int, tb: TensorBoardLogger, print_fn=print,
          stop: Optional["ExitSignal"] = None, layout: Optional[dict] = None) -> TrainResult:
    """Run optimizer steps start_step … train_iters − 1 (0-based; logs count them from 1).

    With ``stop`` (an installed ``ExitSignal``), its signal — received at any time since it was
    installed — makes the loop save a checkpoint after the current step and return with
    ``interrupted=True``.
    """
    t = cfg.train
    stop = stop or ExitSignal(None)
    model = engine.module
    acc = MetricAccumulator(ctx.device)
    result = TrainResult(first_step=start_step + 1, last_step=t.train_iters)
    last_log = time.perf_counter()
    steps_since_log = 0
    norm = None
    own_norm = engine.zero_optimization_stage() == 0  # DeepSpeed keeps no norm at stage 0
    mp_group = DeepSpeedMpu().get_model_parallel_group()

    def will_log(done: int) -> bool:
        # every log_interval steps, and the run's first and last step (the summary's ends)
        return done % t.log_interval == 0 or done in (start_step + 1, t.train_iters)

    for step in range(start_step, t.train_iters):
        lr_used = engine.get_lr()[0]  # the schedule's value for this update (before it steps)
        batches = micro_batches(dataset, consumed_samples=consumed_samples, seed=t.seed,
                                global_batch_size=t.global_batch_size,
                                micro_batch_size=t.micro_batch_size,
                                dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)
        if ctx.pp_size > 1:
            for out in pipeline_train_step(engine, batches, step=step, ctx=ctx):
                acc.add(out, cfg.rtd.rtd_lambda)
        else:
            for j, mb in enumerate(batches):
                out = engine(mb.input_ids.to(ctx.device), mb.sample_index.to(ctx.device), step)
                engine.backward(out.loss)
                if own_norm and j == len(batches) - 1 and will_log(step + 1):
                    norm = grad_norm(model, ctx.tp_rank, mp_group)
                engine.step()
                acc.add(out, cfg.rtd.rtd_lambda)
        steps_since_log += 1
        consumed_samples += t.global_batch_size
        done = step + 1
        if will_log(done):
            scalars = acc.reduce(ctx.dp_group)
            now = time.perf_counter()
            elapsed = now - last_log
            scalars["optim/lr"] = lr_used
            if not own_norm:
                norm = engine.get_global_grad_norm()
            scalars["optim/grad_norm"] = float(norm) if norm is not None else float("nan")
            # non-pad tokens over all data-parallel ranks (reduce() summed them)
            scalars["throughput/tokens_per_s"] = scalars.pop("_tokens") / elapsed
            cos = table_cosine(model, ctx.tp_group, zero3=engine.zero_optimization_stage() == 3)
            if cos is not None:
                scalars["embedding/cosine_generator_discriminator"] = cos
            if ctx.is_logging_rank:
                tb.write(done, scalars)
                print_fn(format_log_line(done, t.train_iters, consumed_samples,
                                         1000.0 * elapsed / steps_since_log, scalars,
                                         t.global_batch_size))
                result.history.append((done, scalars))
            acc.reset()
            last_log, steps_since_log = now, 0
        stopping = stop.any_rank_received(ctx.device)
        if t.save and ((t.save_interval and done % t.save_interval == 0) or done == t.train_iters
                       or stopping):
            result.checkpoint_dir = checkpoint.save(
                engine, t.save, step=done, rank=ctx.rank,
                client_state={"step": done, "consumed_samples": consumed_samples,
                              "config": cfg.to_dict()},
                layout=layout)
            if ctx.is_logging_rank:
                print_fn(f"saved checkpoint at iteration {done:8d} to {result.checkpoint_dir}")
        if stopping:
            if ctx.is_logging_rank:
                print_fn(f"exit signal {signal.Signals(stop.signum).name} received: stopped after "
                         f"iteration {done}" + ("" if t.save else " (no --save: nothing saved)"))
            result.interrupted, result.last_step = True, done
            break
    return result
