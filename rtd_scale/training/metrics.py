"""Metrics: summed on the device every micro-batch, reduced and written once per log interval.

One TensorBoard writer, on the logging rank (``ParallelContext.is_logging_rank``), and with
``--wandb-project`` one W&B run there that gets the same scalars (``MetricsLogger``). Tags:
loss/mlm, loss/rtd, loss/total, mlm/accuracy, rtd/replaced_fraction, rtd/accuracy_replaced,
rtd/accuracy_original, optim/lr, optim/grad_norm, optim/skipped_iters (iterations skipped for a
non-finite loss or gradient norm since the previous log line), throughput/tokens_per_s, and
(first pipeline stage's tables, training/diagnostics.py) embedding/avg_cosine_generator and
embedding/avg_cosine_discriminator (arXiv 2111.09543 Table 1: mean pairwise cosine within each
table) and embedding/rowwise_cosine_generator_discriminator (a token's generator row vs its
discriminator row); at each evaluation (training/loop.py) the same losses and accuracies on the
validation split under valid/ (valid/loss/mlm, valid/loss/rtd, valid/loss/total,
valid/mlm/accuracy, valid/rtd/...) and valid/rtd/auc (the discriminator's held-out ROC AUC).
From training/throughput.py: throughput/tflops_per_device, throughput/mfu (a fraction; with a
known peak), memory/allocated_gib, memory/reserved_gib, memory/peak_allocated_gib (CUDA; max over
ranks), memory/peak_gb (any device: the largest rank's measured peak, rtd_scale/memory.py),
time/eta_s, and optim/loss_scale under fp16. From training/timers.py, with
--timing-log-level 1 or 2: timers/<phase>_ms (milliseconds per iteration of each phase). From
training/loop.py at a loss spike (training/spikes.py): loss_spike/ratio, and at a rollback
loss_spike/rollbacks, loss_spike/rolled_back_to_iteration, loss_spike/skipped_samples. Text:
config/run and config/ds_config (the resolved configs, at the run's first step), and
loss_spike/rollback (a rollback's line, with the exact samples skipped).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from rtd_scale.model.rtd import COUNT_KEYS, RTDOutput
from rtd_scale.training.throughput import format_eta
from rtd_scale.training.timers import format_timer_fields


class MetricAccumulator:
    """Sums losses and counts over micro-batches without a host sync (STYLE rule 9).

    ``masked_lm_only``: the run's ``rtd.objective`` is mlm: ``reduce`` leaves out loss/rtd and
    the rtd/* ratios (no discriminator computes them)."""

    def __init__(self, device: torch.device, masked_lm_only: bool = False):
        self.device, self.masked_lm_only = device, masked_lm_only
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(3 + len(COUNT_KEYS), dtype=torch.float64, device=self.device)
        self.micro_batches = 0
        self.started = time.perf_counter()

    def add(self, out: RTDOutput) -> None:
        """One micro-batch's output: its losses as the model computed them (``out.loss`` is
        its L_MLM + rtd_lambda · L_RTD; the weight is applied in the model only)."""
        vals = [out.mlm_loss, out.rtd_loss, out.loss] + [out.counts[k] for k in COUNT_KEYS]
        self.sums += torch.stack([v.detach().to(torch.float64) for v in vals])
        self.micro_batches += 1

    def reduce(self, group: Optional[dist.ProcessGroup]) -> dict[str, float]:
        """Means of the losses over micro-batches and data-parallel ranks, ratios of the summed
        counts; one all-reduce and one host sync. Each micro-batch's loss is its sum / (the
        global batch's count / its micro-batches) (``objectives/losses.py``), so the mean over
        a step's micro-batches is that step's L_MLM (L_RTD): the summed loss over the global
        batch / its count, whatever the split; over a log interval, the mean of the steps'."""
        s = self.sums.clone()
        n = torch.tensor([float(self.micro_batches)], dtype=torch.float64, device=self.device)
        s = torch.cat([s, n])
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(s, group=group)
        v = s.tolist()
        mb = max(v[-1], 1.0)
        c = dict(zip(COUNT_KEYS, v[3:3 + len(COUNT_KEYS)]))

        def ratio(a: float, b: float) -> float:
            return a / b if b > 0 else float("nan")

        out = {
            "loss/mlm": v[0] / mb,
            "loss/rtd": v[1] / mb,
            "loss/total": v[2] / mb,
            "mlm/accuracy": ratio(c["mlm_correct"], c["masked"]),
            "rtd/replaced_fraction": ratio(c["replaced"], c["tokens"]),
            "rtd/accuracy_replaced": ratio(c["rtd_correct_replaced"], c["replaced"]),
            "rtd/accuracy_original": ratio(c["rtd_correct_original"], c["original"]),
            "_tokens": c["tokens"],
        }
        if self.masked_lm_only:
            return {k: x for k, x in out.items() if k != "loss/rtd" and not k.startswith("rtd/")}
        return out


@torch.no_grad()
def grad_norm(model: torch.nn.Module, tp_rank: int, model_parallel_group) -> float:
    """Global L2 norm of the gradients in ``param.grad`` across the tensor × pipeline group:
    tensor-parallel shards summed over their group, replicated parameters counted once (on TP
    rank 0), the pipeline's tied copy (``ds_pipe_replicated``) not at all — DeepSpeed's rule.
    Used where DeepSpeed keeps no norm (ZeRO stage 0); call before ``engine.step()``."""
    total = torch.zeros(1, dtype=torch.float64)
    for p in {id(p): p for p in model.parameters()}.values():
        if p.grad is None or getattr(p, "ds_pipe_replicated", False):
            continue
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0:
            total += p.grad.detach().double().pow(2).sum().cpu()
    if dist.is_initialized():
        dist.all_reduce(total, group=model_parallel_group)
    return float(total.sqrt())


class TensorBoardLogger:
    """The one writer (created only on the logging rank)."""

    def __init__(self, log_dir: Optional[str], purge_step: Optional[int] = None):
        """``purge_step``: the first step this run logs. Events of an earlier run in
        ``log_dir`` at that step or later (written after its last checkpoint, before a crash)
        are hidden from TensorBoard (``SummaryWriter``'s ``purge_step``), so each step keeps
        one value per tag."""
        self.writer = None
        if log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if self.writer is None:
            return
        for tag, value in scalars.items():
            if not tag.startswith("_"):
                self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def rewind(self, step: int) -> None:
        """Hide the events written so far at ``step`` or later (a loss-spike rollback replays
        them): a new writer with that ``purge_step``, as a resumed run's."""
        if self.writer is not None:
            log_dir = self.writer.log_dir
            self.writer.close()
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir, purge_step=step)

    def write_text(self, tag: str, text: str, step: int) -> None:
        """``text`` as a fenced block under TensorBoard's Text tab (``add_text`` renders
        Markdown), e.g. the resolved config at the run's first step."""
        if self.writer is None:
            return
        self.writer.add_text(tag, "```\n" + text + "\n```", step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class MetricsLogger:
    """The loop's one writer: hands every scalar dict and text to each sink — TensorBoard
    (``TensorBoardLogger``) and, with ``--wandb-project``, W&B (``wandb_logger.WandbLogger``) —
    so both get the same values at the same steps."""

    def __init__(self, *sinks):
        self.sinks = [s for s in sinks if s is not None]

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.write(step, scalars)

    def write_text(self, tag: str, text: str, step: int) -> None:
        for sink in self.sinks:
            sink.write_text(tag, text, step)

    def rewind(self, step: int) -> None:
        """The run goes back to before ``step`` (a loss-spike rollback): TensorBoard hides what
        it holds from ``step`` on; W&B keeps it and ignores the replayed steps until they pass
        its last (its steps only increase)."""
        for sink in self.sinks:
            if hasattr(sink, "rewind"):
                sink.rewind(step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def format_log_line(step: int, train_iters: int, consumed: int, ms_per_step: float,
                    scalars: dict[str, float], global_batch_size: int) -> str:
    """A Megatron-LM-style training log line."""
    return (
        f" iteration {step:8d}/{train_iters:8d} | consumed samples: {consumed:12d} | "
        f"elapsed time per iteration (ms): {ms_per_step:.1f} | "
        f"learning rate: {scalars['optim/lr']:.3E} | global batch size: {global_batch_size:5d} | "
        f"mlm loss: {scalars['loss/mlm']:.6E} | "
        + (f"rtd loss: {scalars['loss/rtd']:.6E} | " if "loss/rtd" in scalars else "")
        + f"total loss: {scalars['loss/total']:.6E} | mlm acc: {scalars['mlm/accuracy']:.4f} | "
        + (f"replaced: {scalars['rtd/replaced_fraction']:.4f} | "
           if "rtd/replaced_fraction" in scalars else "")
        + f"grad norm: {scalars['optim/grad_norm']:.3f} | "
        f"tokens/s: {scalars['throughput/tokens_per_s']:.0f} | "
        f"number of skipped iterations: {int(scalars.get('optim/skipped_iters', 0)):3d} |"
        + _throughput_fields(scalars) + format_timer_fields(scalars)
    )


def _throughput_fields(scalars: dict[str, float]) -> str:
    """The optional fields (training/throughput.py), each present when its scalar is."""
    out = ""
    if "throughput/tflops_per_device" in scalars:  # Megatron-LM's --log-throughput wording
        out += (" throughput per GPU (TFLOP/s/GPU): "
                f"{scalars['throughput/tflops_per_device']:.4g} |")
    if "throughput/mfu" in scalars:
        out += f" MFU: {100 * scalars['throughput/mfu']:.4g}% |"
    if "memory/allocated_gib" in scalars:
        out += (" memory GiB (max over ranks) allocated/reserved/peak: "
                f"{scalars['memory/allocated_gib']:.2f}/{scalars['memory/reserved_gib']:.2f}/"
                f"{scalars['memory/peak_allocated_gib']:.2f} |")
    if "memory/peak_gb" in scalars:
        out += f" peak memory per rank (GB): {scalars['memory/peak_gb']:.2f} |"
    if "optim/loss_scale" in scalars:
        out += f" loss scale: {scalars['optim/loss_scale']:.1f} |"
    if "time/eta_s" in scalars:
        out += f" ETA: {format_eta(scalars['time/eta_s'])} |"
    return out
