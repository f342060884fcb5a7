"""The training loop: loader → the step → metrics, validation, checkpoints, TensorBoard.

``train`` runs a ``Trainer``, whose ``train`` is the loop on one screen (as torchtitan's
``Trainer.train``): ``train_step``, ``log``, ``validate``, ``save`` — or ``roll_back`` past a
loss spike — and ``step_finished`` (the profiler and the heartbeat), each a method.

The step itself: ``training/step.py``'s ``train_step`` at pipeline_model_parallel_size 1,
``training/pipeline.py``'s ``pipeline_train_step`` above it.

Data: one DataLoader per split for the whole run (``data/loader.py``). The training loader starts
at the run's ``consumed_samples`` (0, or the checkpoint's), so a resumed run reads exactly what an
uninterrupted one would (tests/e2e/test_pretrain_launcher.py); each step takes the next
gradient-accumulation-many micro-batches.
Validation every ``eval_interval`` steps, and once more after the last step when that is off
the interval (the final model is always validated, as Megatron-LM's ``pretrain`` does after
training; the summary's held-out AUC and verdict come from it), reads the same first
``eval_iters`` global batches of the validation split each time (masks keyed by the validation
index, sampling noise by step 0), so its losses are comparable across steps; it runs forward
only, with dropout off, and touches neither gradients nor the optimizer nor any RNG state.
(Megatron-LM's validation continues through the validation set from one evaluation to the next
instead.) A test split
(``--test-data-path``) is evaluated the same way once, after the last step (Megatron-LM's
``evaluate_and_print_results`` on the test set at the end of ``pretrain``), tags ``test/``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.batch import rank_share
from rtd_scale.config import LossSpikePolicy, RunConfig
from rtd_scale.data.blend import BlendedDataset
from rtd_scale.data.loader import SplitLoaders, advance, merge_ranges
from rtd_scale.distributed import DeepSpeedMpu, ParallelContext
from rtd_scale.phases import PHASE_DATA_WAIT
from rtd_scale.training.checkpoint import load as checkpoint_load, save as checkpoint_save
from rtd_scale.training.digest import DataDigest
from rtd_scale.training.faults import FaultPlan
from rtd_scale.training.heartbeat import Heartbeat
from rtd_scale.training.diagnostics import (VALID_AUC, VALID_AUC_CHANCE_SD, auc_chance_sd,
                                            gather_scores, roc_auc, table_cosines)
from rtd_scale.training.optimizer import NonFiniteSkippingAdamW
from rtd_scale.training.metrics import (MetricAccumulator, MetricsLogger, format_log_line,
                                        grad_norm)
from rtd_scale.training.pipeline import pipeline_forward, pipeline_train_step
from rtd_scale.training.profiler import StepProfiler
from rtd_scale.training.signals import StopRequest
from rtd_scale.training.spikes import (CLIENT_KEY as SPIKES_KEY, LossSpikeRollbacksError, Spike,
                                       SpikeMonitor, SpikeRule, SpikeState)
from rtd_scale.training.step import eval_step, train_step
from rtd_scale.training.stragglers import StragglerMeter
from rtd_scale.training.throughput import (ThroughputMeter, loss_scale, memory_gib,
                                           peak_memory_gb)
from rtd_scale.training.timers import PhaseTimers, timer_scalars


@dataclass
class TrainResult:
    """What the loop saw: logged (step, scalars) pairs on the logging rank."""

    first_step: int
    last_step: int
    history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    valid_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    test: Optional[dict[str, float]] = None  # the test split's scalars after the last step
    checkpoint_dir: Optional[str] = None
    interrupted: bool = False  # stopped early (a signal, the launcher's exit), after saving
    stragglers: Optional[dict] = None  # training/stragglers.py's summary


class NonFiniteIterationsError(UserInputError):
    """The run stopped: too many consecutive iterations had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    """Megatron-LM's ``--check-for-nan-in-loss-and-grad`` without a host sync per step.

    Per iteration:
    - ``gate(loss)`` multiplies each micro-batch's loss by 1, or by NaN when it is inf or NaN
      (decided on the device), so a non-finite loss always gives non-finite gradients — the
      one thing the optimizers check; the product is exact for a finite loss;
    - the optimizer step then skips an iteration whose gradient norm is not finite: DeepSpeed's
      own check under ZeRO 1–3 and its bf16 optimizers (they already read the norm on the host
      every step), ``optimizer.NonFiniteSkippingAdamW`` on the device at ZeRO stage 0 in fp32.
      Either way a skipped iteration leaves the parameters, AdamW's moments, its step count
      and the learning-rate schedule as they were (Megatron-LM's rule; how the schedule learns
      of the skip: ``training/lr_schedule.py``), and the iteration's samples are consumed;
    - ``after_step()`` counts skipped iterations, on the host where DeepSpeed decided (its
      ``skipped_steps``), else on the device.

    ``consecutive()`` and ``take_interval_count()`` read the counts: a host sync, done only at
    the log interval and before a save. The pipeline-parallel step's loss goes through
    megatron-core's schedule ungated: there the gradient norm alone decides.
    """

    def __init__(self, engine, device: torch.device, limit: int):
        self.engine, self.limit = engine, limit
        self.on_device = isinstance(engine.optimizer, NonFiniteSkippingAdamW)
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self._consecutive = zero.clone() if self.on_device else 0
        self._interval = zero.clone() if self.on_device else 0
        self.total = 0  # skipped iterations read so far (host)
        self._seen = engine.skipped_steps
        # fp16: DeepSpeed's loss scaler skips every step whose scaled gradients overflow, its
        # normal way of finding the scale. Such skips are counted (optim/skipped_iters) but, as
        # in Megatron-LM, never stop the run: only iterations whose loss itself was non-finite
        # count toward the limit, recorded on the device by this instance's gate.
        self.fp16 = bool(getattr(engine, "fp16_enabled", lambda: False)())
        if self.fp16:
            self._loss_bad = zero.clone()
            self.gate = self._gate_and_record

    @staticmethod
    def gate(loss: torch.Tensor) -> torch.Tensor:
        """``loss`` × (1 if finite else NaN), the factor a constant (no gradient of its own)."""
        factor = torch.where(torch.isfinite(loss.detach()), 1.0, float("nan")).to(loss.dtype)
        return loss * factor

    def _gate_and_record(self, loss: torch.Tensor) -> torch.Tensor:
        """``gate``, remembering on the device whether this iteration's loss was non-finite."""
        self._loss_bad = self._loss_bad | (~torch.isfinite(loss.detach())).to(torch.int64)
        return NonFiniteGuard.gate(loss)

    def after_step(self) -> None:
        """Record the iteration just stepped (after its last ``engine.step()``)."""
        if self.on_device:
            bad = self.engine.optimizer.skipped.to(torch.int64)
            self._consecutive = (self._consecutive + 1) * bad
            self._interval += bad
            return
        skipped = self.engine.skipped_steps != self._seen
        self._seen = self.engine.skipped_steps
        if self.fp16:  # an overflow skip is counted, a non-finite loss also stops the run
            self._interval += int(skipped)
            self._consecutive = (self._consecutive + 1) * self._loss_bad
            self._loss_bad = self._loss_bad * 0
            return
        if skipped:  # DeepSpeed did not step the schedule either (training/lr_schedule.py)
            self._consecutive += 1
            self._interval += 1
        else:
            self._consecutive = 0

    def consecutive(self) -> int:
        """Iterations in a row, up to the last one, that were skipped (a host sync)."""
        return int(self._consecutive)

    def take_interval_count(self) -> int:
        """Skipped iterations since the previous call (a host sync); resets the count."""
        n = int(self._interval)
        self._interval = self._interval * 0 if self.on_device else 0
        self.total += n
        return n

    def check(self, done: int, last_good: Optional[str], load_hint: Optional[str]) -> int:
        """The current run of skipped iterations; stops the run once it reaches the limit.

        Raises:
            NonFiniteIterationsError: ``limit`` > 0 and the last ``limit`` or more iterations
                were all skipped (one line: which iterations, the last good checkpoint, the fix).
        """
        c = self.consecutive()
        if self.limit and c >= self.limit:
            where = f"the last good checkpoint is {last_good}" if last_good else \
                "no checkpoint was saved before them"
            resume = (f", then resume with --load {load_hint} --override-opt_param-scheduler"
                      if last_good and load_hint else "")
            raise NonFiniteIterationsError(
                f"iterations {done - c + 1}–{done} ({c} in a row, --max-consecutive-nonfinite-"
                f"iters {self.limit}) had a non-finite loss or gradient norm and were skipped; "
                f"stopped at iteration {done}; {where}; lower --lr or raise --lr-warmup-iters"
                f"{resume}")
        return c


def start_loaders(cfg: RunConfig, ctx: ParallelContext,
                  data: dict[str, BlendedDataset]) -> SplitLoaders:
    """This rank's loaders of the splits the run reads — ``train``; ``valid`` when it evaluates;
    ``test`` when it has one and ``eval_iters`` > 0 — with their workers started now, before the
    model and the engine are built (``data/loader.py``, ``SplitLoaders``: why)."""
    t = cfg.train
    reads = {"train": True, "valid": t.evaluates, "test": t.eval_iters > 0}
    return SplitLoaders({k: v for k, v in data.items() if reads.get(k)},
                        global_batch_size=t.global_batch_size,
                        micro_batch_size=t.micro_batch_size, dp_rank=ctx.dp_rank,
                        dp_size=ctx.dp_size, num_workers=cfg.data.num_workers,
                        pin_memory=ctx.device.type == "cuda",
                        prefetch_factor=cfg.data.prefetch_factor, seed=t.seed)


def evaluate(cfg: RunConfig, ctx: ParallelContext, engine, loader,
             split: str = "valid", iteration: int = 0) -> dict[str, float]:
    """Validation losses and accuracies over ``eval_iters`` global batches of ``loader``
    (forward only, dropout off). Collective over every rank; tags prefixed ``{split}/``
    (``valid`` or ``test``; below with ``valid``). The losses are normalised over each
    validation global batch, as in training (``training/normalise.py``).

    ``valid/rtd/auc``: the exact ROC AUC (``diagnostics.roc_auc``, ties ½) of the
    discriminator's logits, replaced (label 1) vs original (0), over every non-pad token of the
    validation batches of all data-parallel ranks. Computed once per evaluation, on the first
    data-parallel rank of the last pipeline stage's first tensor-parallel rank (the logging
    rank's group; the logits are the same on every TP rank); NaN on the other ranks. Each global
    batch's logits and labels are gathered there (``diagnostics.gather_scores``: 8 bytes per
    token on the device) and kept in host memory (5 bytes per token; 2.1 GB for 100 batches of
    8192 × 512), then sorted once. ``_valid/rtd/auc_chance_sd`` (not written to TensorBoard):
    the AUC's standard deviation for uninformative logits at these class sizes
    (``diagnostics.auc_chance_sd``).

    With ``train.eval_dump_dir``, each data-parallel rank of that group also writes what it
    evaluated to ``{dir}/{split}_iter{iteration}_dp{rank}.pt`` (``torch.save`` of a dict of
    [n, s] CPU tensors ``input_ids``, ``masked``, ``corrupted_ids``, ``rtd_logits`` and [n]
    ``sample_index``): the run's own replacements, for offline analysis (e.g. an oracle
    discriminator's AUC on them, ``verify/known_answer.py``).
    """
    masked_lm_only = engine.module.masked_lm_only  # rtd.objective=mlm: no AUC, no dump
    acc = MetricAccumulator(ctx.device, masked_lm_only)
    _, gas = rank_share(cfg.train.global_batch_size, cfg.train.micro_batch_size, ctx.dp_size)
    pad_id = engine.module.pad_id
    auc_here = ctx.is_last_stage and ctx.tp_rank == 0 and not masked_lm_only
    scores, labels = [], []
    dump: Optional[dict[str, list]] = ({k: [] for k in _DUMP_KEYS}
                                       if cfg.train.eval_dump_dir and auc_here else None)
    engine.eval()
    try:
        with torch.no_grad():
            it = iter(loader)
            for _ in range(cfg.train.eval_iters):
                batches = [next(it) for _ in range(gas)]
                if ctx.pp_size > 1:
                    outs = pipeline_forward(engine.module, batches, step=0, ctx=ctx)
                else:
                    outs = eval_step(engine, batches, step=0, ctx=ctx)
                for out in outs:
                    acc.add(out)
                if auc_here:
                    ids = torch.stack([mb.input_ids for mb in batches]).to(ctx.device)
                    rep = torch.stack([o.corrupted_ids for o in outs]) != ids
                    lab = torch.where(ids == pad_id, -1, rep.to(torch.int64)).to(torch.int8)
                    got = gather_scores(torch.stack([o.rtd_logits for o in outs]), lab,
                                        ctx.dp_group)
                    if got is not None:
                        scores.append(got[0].cpu())
                        labels.append(got[1].cpu())
                if dump is not None:
                    for mb, o in zip(batches, outs):
                        for k, v in (("input_ids", mb.input_ids), ("sample_index", mb.sample_index),
                                     ("masked", o.masked), ("corrupted_ids", o.corrupted_ids),
                                     ("rtd_logits", o.rtd_logits.float())):
                            dump[k].append(v.cpu())
    finally:
        engine.train()
    if dump is not None:
        _write_dump(cfg.train.eval_dump_dir, f"{split}_iter{iteration}_dp{ctx.dp_rank}.pt",
                    {k: torch.cat(v) for k, v in dump.items()})
    scalars = acc.reduce(ctx.dp_group)
    out = {f"{split}/{k}": v for k, v in scalars.items() if not k.startswith("_")}
    if masked_lm_only:
        return out
    auc, auc_sd = (VALID_AUC.replace("valid/", f"{split}/", 1),
                   VALID_AUC_CHANCE_SD.replace("valid/", f"{split}/", 1))
    out[auc], out[auc_sd] = float("nan"), float("nan")
    if scores:
        labels = torch.cat(labels)
        out[auc] = roc_auc(torch.cat(scores), labels)
        out[auc_sd] = auc_chance_sd(labels)
    return out


_DUMP_KEYS = ("input_ids", "sample_index", "masked", "corrupted_ids", "rtd_logits")


def _write_dump(directory: str, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """``torch.save`` to a temporary name, then renamed: a reader never sees half a file."""
    import io
    import os

    from rtd_scale.atomic import write_atomic

    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    torch.save(tensors, buf)
    write_atomic(os.path.join(directory, name), buf.getvalue())


SAVE_TIME_TAG = "timers/save-checkpoint-time"  # seconds of one save (Loop.save)


def format_valid_line(step: int, samples: int, scalars: dict[str, float],
                      split: str = "valid") -> str:
    """Megatron-LM-style validation (or, with ``split="test"``, test) line."""
    v = {k.split("/", 1)[1]: x for k, x in scalars.items() if k.startswith(f"{split}/")}
    return (f" {'validation' if split == 'valid' else split} at iteration {step:8d} | "
            f"samples: {samples} | "
            f"mlm loss: {v['loss/mlm']:.6E} | "
            + ("" if "loss/rtd" not in v else f"rtd loss: {v['loss/rtd']:.6E} | ")
            + f"total loss: {v['loss/total']:.6E} | "
            f"mlm acc: {v['mlm/accuracy']:.4f} |"
            + ("" if "rtd/accuracy_replaced" not in v else  # rtd.objective=mlm: none
               f" rtd acc replaced: {v['rtd/accuracy_replaced']:.4f} | "
            f"rtd acc original: {v['rtd/accuracy_original']:.4f} | "
            f"rtd auc: {v.get('rtd/auc', float('nan')):.4f} |"))


def short_validation_note(t, start_step: int, available: int) -> Optional[str]:
    """The note that one validation (``eval_iters`` global batches) reads more samples than the
    validation split holds, or None — also when the run has no iteration left to train (each
    run validates after its last iteration)."""
    wanted = t.eval_iters * t.global_batch_size
    if not t.evaluates or start_step >= t.train_iters:
        return None
    if available >= wanted:
        return None
    return (f"note: one validation reads {wanted} samples but the validation split holds "
            f"{available}: samples repeat (masked afresh); lower --eval-iters or raise the "
            "validation share of --split")


def stop_line(reason: str, done: int, save: Optional[str], saved: Optional[str],
              last_good: Optional[str]) -> str:
    """The one line an interrupted run ends with: why, where, and the ``--load`` to resume."""
    head = f"{reason}: stopped after iteration {done}"
    if saved:
        return f"{head}; saved {saved}; resume with --load {save}"
    if last_good:
        return (f"{head}; not saved at this iteration; resume from {last_good} with --load "
                f"{last_good}")
    return head + (" (no --save: nothing saved)" if not save else "; nothing saved")


def train(cfg: RunConfig, ctx: ParallelContext, engine, data: dict[str, BlendedDataset], *,
          loaders: SplitLoaders, start_step: int, consumed_samples: int, tb: MetricsLogger,
          print_fn=print,
          stop: Optional[StopRequest] = None, layout: Optional[dict] = None,
          resumed_from: Optional[str] = None,
          profiler: Optional[StepProfiler] = None, heartbeat: Optional[Heartbeat] = None,
          stragglers: Optional[StragglerMeter] = None,
          spike_state: Optional[SpikeState] = None,
          reload: Optional[Callable[[str], tuple[int, int]]] = None) -> TrainResult:
    """Run optimizer steps start_step … train_iters − 1 (0-based; logs count them from 1).

    ``data["train"]`` is read, through ``loaders`` (``start_loaders``, called before the engine
    was built), from ``consumed_samples`` on; ``data["valid"]``, when present, is
    evaluated every ``eval_interval`` steps and after the last one. With ``stop`` (an entered
    ``signals.StopRequest``), a stop request on any rank — at any time since it was entered —
    makes every rank save a checkpoint after the current step and return with
    ``interrupted=True``; the logging rank prints one line naming the checkpoint and the
    ``--load`` that resumes it.

    Non-finite iterations (``NonFiniteGuard``) are skipped and counted (``optim/skipped_iters``
    per log interval); no checkpoint is saved while the last iteration was skipped.
    ``resumed_from`` (the checkpoint directory ``--load`` took) is named as the last good one
    until this run saves. ``profiler`` (``training/profiler.py``) is told each finished step,
    ``heartbeat`` (``training/heartbeat.py``) each finished step and each save or evaluation;
    ``stragglers`` (``training/stragglers.py``) marks each step and names slow ranks at the log
    interval.

    Loss spikes (``training/spikes.py``, ``--loss-spike-policy``) are looked for at the log
    interval and before each save. Under ``rollback`` the newest checkpoint this run saved, or
    ``resumed_from``, before the spike is loaded by ``reload(its directory)`` (collective;
    returns its step and consumed samples: ``run.rollback_reload``, which loads it as
    ``--load`` would; without it ``checkpoint.load.load``, for checkpoints at this layout), the
    spike's samples join ``spike_state.skipped`` (the checkpoint's,
    ``SpikeState.from_client``), and training continues from there. Every checkpoint records
    ``spike_state``.

    Raises:
        NonFiniteIterationsError: ``train.max_consecutive_nonfinite_iters`` iterations in a row
            were skipped (checked at the log interval and before each save).
        LossSpikeRollbacksError: a spike after ``train.max_loss_spike_rollbacks`` rollbacks.
    """
    return Trainer(cfg, ctx, engine, data, loaders=loaders, start_step=start_step,
                   consumed_samples=consumed_samples, tb=tb, print_fn=print_fn, stop=stop,
                   layout=layout, resumed_from=resumed_from, profiler=profiler,
                   heartbeat=heartbeat, stragglers=stragglers, spike_state=spike_state,
                   reload=reload).train()


class Trainer:
    """``train``'s state and its parts: the loop (``train``), one optimizer step
    (``train_step``), the log line (``log``), validation (``validate``), loss spikes
    (``answer_spikes``, ``roll_back``), the checkpoint (``save``) and the end (``finish``).
    ``train``'s arguments, as its attributes (``t`` is ``cfg.train``)."""

    def __init__(self, cfg: RunConfig, ctx: ParallelContext, engine,
                 data: dict[str, BlendedDataset], *, loaders: SplitLoaders,
                 start_step: int, consumed_samples: int,
                 tb: MetricsLogger, print_fn, stop: Optional[StopRequest],
                 layout: Optional[dict], resumed_from: Optional[str],
                 profiler: Optional[StepProfiler], heartbeat: Optional[Heartbeat],
                 stragglers: Optional[StragglerMeter], spike_state: Optional[SpikeState],
                 reload: Optional[Callable[[str], tuple[int, int]]]):
        t = self.t = cfg.train
        self.cfg, self.ctx, self.engine, self.data, self.tb = cfg, ctx, engine, data, tb
        self.loaders = loaders
        self.layout, self.profiler, self.heartbeat = layout, profiler, heartbeat
        self.stragglers, self.reload = stragglers, reload
        self.stop = stop or StopRequest((), watch_launcher=False)  # never entered: never stops
        self.say = print_fn if ctx.is_logging_rank else None  # the logging rank's lines
        self.model = engine.module
        self.step, self.consumed = start_step, consumed_samples  # steps done, samples read
        self.result = TrainResult(first_step=start_step + 1, last_step=t.train_iters)
        _, self.gas = rank_share(t.global_batch_size, t.micro_batch_size, ctx.dp_size)
        self.acc = MetricAccumulator(ctx.device, self.model.masked_lm_only)
        self.last_log, self.steps_since_log = time.perf_counter(), 0
        self.norm, self.lr_used = None, None  # read for the next log line
        self.own_norm = engine.zero_optimization_stage() == 0  # DeepSpeed keeps none at stage 0
        self.mp_group = DeepSpeedMpu().get_model_parallel_group()
        self.spike = spike_state or SpikeState()
        self.train_batches = self.loader_from(consumed_samples, start_step)
        self.valid_loader = None
        if "valid" in data and t.evaluates:
            self.valid_loader = loaders.get("valid", consumed=0,
                                            total=t.eval_iters * t.global_batch_size)
            note = short_validation_note(t, start_step,
                                         sum(len(ds) for ds in data["valid"].datasets))
            if self.say and note:
                self.say(note)
        self.digest = DataDigest(t.data_digest, ctx)
        self.faults = FaultPlan.from_env(ctx.rank, marker_dir=t.save)  # tests only (faults.py)
        self.guard = NonFiniteGuard(engine, ctx.device, t.max_consecutive_nonfinite_iters)
        self.last_good = resumed_from
        self.spikes = None
        if t.loss_spike_policy is not LossSpikePolicy.OFF:
            self.spikes = SpikeMonitor(
                SpikeRule(t.loss_spike_window_iters, t.loss_spike_threshold,
                          t.loss_spike_min_rise, self.spike.window), ctx.device,
                loss_rank=ctx.is_last_stage and ctx.tp_rank == 0,
                norm_rank=ctx.dp_rank == 0 if self.guard.on_device else ctx.rank == 0)
        # the checkpoints a rollback may return to: this run's, and the one it resumed from
        self.ours: list[tuple[int, str]] = [(start_step, resumed_from)] if resumed_from else []
        self.meter = ThroughputMeter(cfg, world_size=ctx.world_size, device=ctx.device)
        self.timers = PhaseTimers(t.timing_log_level, ctx.device)  # --timing-log-level

    def train(self) -> TrainResult:
        """The loop: step, log, validate, save (or roll back past a loss spike), profile."""
        self.write_configs()
        while self.step < self.t.train_iters:
            self.train_step()
            done = self.step + 1
            if self.will_log(done):
                self.log(done)
            if self.will_validate(done):
                self.validate(done)
            stopping = self.stop.agreed(self.ctx.host_group)  # one int64 all-reduced, host
            save_due = self.will_save(done, stopping)
            found, back = self.check_spikes(done, save_due, stopping)
            if back is not None:  # reload the checkpoint before the spike, skip its samples
                self.roll_back(found[0], *back)
                continue
            saved = save_due and self.may_save(done, found, stopping) and self.save(done)
            self.step_finished(done)
            if stopping:
                self.interrupt(done, stopping, saved)
                break
            self.step = done
        self.finish()
        return self.result

    def will_log(self, done: int) -> bool:
        """Every log_interval steps, and the run's first and last step (the summary's ends)."""
        t = self.t
        return done % t.log_interval == 0 or done in (self.result.first_step, t.train_iters)

    def will_validate(self, done: int) -> bool:
        """Every eval_interval steps, and after the last one."""
        return self.valid_loader is not None and (done % self.t.eval_interval == 0
                                                  or done == self.t.train_iters)

    def will_save(self, done: int, stopping: int) -> bool:
        """Every save_interval steps, after the last one, and before a stop (with --save)."""
        t = self.t
        return bool(t.save) and bool((t.save_interval and done % t.save_interval == 0)
                                     or done == t.train_iters or stopping)

    def check_spikes(self, done: int, save_due: bool,
                     stopping: int) -> tuple[list[Spike], Optional[tuple[int, str]]]:
        """The loss spikes found (at the log interval and before a save; a host read) and the
        checkpoint (step, directory) the policy rolls back to, or None (``_answer_spikes``)."""
        if self.spikes is None or not (self.will_log(done) or save_due):
            return [], None
        found = self.spikes.check()
        return found, _answer_spikes(found, self.t, self.spike, self.ours, done, self.tb,
                                     self.say, rollback_possible=not stopping)

    def step_finished(self, done: int) -> None:
        """Tell the profiler (its schedule) and the heartbeat (its step budget) of ``done``."""
        if self.profiler is not None:
            self.profiler.step(done)
        if self.heartbeat:
            self.heartbeat.beat(done)

    def write_configs(self) -> None:
        """The resolved configs, next to the scalars they produce (TensorBoard's Text tab)."""
        if self.say:
            self.tb.write_text("config/run", self.cfg.to_json(), self.step)
            if isinstance(getattr(self.engine, "config", None), dict):  # the resolved ds_config
                self.tb.write_text("config/ds_config", json.dumps(
                    self.engine.config, indent=2, sort_keys=True), self.step)

    def train_step(self) -> None:
        """One optimizer step on the next global batch (``training/step.py``,
        ``training/pipeline.py``): its metrics summed, its skip recorded, its samples counted,
        and what the spike monitor and ``--data-digest`` keep of it."""
        ctx, t, stragglers, done = self.ctx, self.t, self.stragglers, self.step + 1
        if stragglers:
            stragglers.step_start()
        if self.will_log(done):  # the schedule's value for this update (before it steps)
            self.lr_used = self.engine.lr_scheduler.lr()  # settles a skip decided on device
        with self.timers(PHASE_DATA_WAIT):
            batches = [next(self.train_batches) for _ in range(self.gas)]
        if stragglers:
            stragglers.data_done()
        if self.faults.enabled:
            batches = self.faults.before_step(done, batches, self.model.special_ids)
        if stragglers:  # ready to compute: the step's first collective comes after this
            stragglers.ready()
        if ctx.pp_size > 1:
            outs = pipeline_train_step(self.engine, batches, step=self.step, ctx=ctx,
                                       timers=self.timers)
        else:
            read_norm = self.read_norm if self.own_norm and self.will_log(done) else None
            outs = train_step(self.engine, batches, step=self.step, ctx=ctx,
                              gate=self.guard.gate, before_update=read_norm,
                              timers=self.timers)
        for out in outs:
            self.acc.add(out)
        self.guard.after_step()
        if self.digest.enabled:
            self.digest.add(batches, outs)
            self.digest.write(done, self.consumed, self.data["train"].locate)
        read_from = self.consumed
        self.consumed = advance(self.consumed, t.global_batch_size, self.spike.skipped)
        if self.spikes is not None:
            self.spikes.record(done, outs, self.engine.optimizer.grad_norm if self.guard.on_device
                               else self.engine.get_global_grad_norm(),
                               (read_from, self.consumed))
        self.steps_since_log += 1

    def read_norm(self) -> None:
        """The gradient norm before the update, where DeepSpeed keeps none (ZeRO stage 0)."""
        self.norm = grad_norm(self.model, self.ctx.tp_rank, self.mp_group)

    def log(self, done: int) -> None:
        """The interval's scalars (one reduction, one host sync) to TensorBoard and the log
        line; then the non-finite guard's verdict, after the line that shows it."""
        ctx, engine, t = self.ctx, self.engine, self.t
        scalars = self.acc.reduce(ctx.dp_group)
        now = time.perf_counter()
        elapsed, steps = now - self.last_log, self.steps_since_log
        scalars["optim/lr"] = self.lr_used
        if not self.own_norm:
            self.norm = engine.get_global_grad_norm()
        scalars["optim/grad_norm"] = float(self.norm) if self.norm is not None else float("nan")
        scalars["optim/skipped_iters"] = float(self.guard.take_interval_count())
        # non-pad tokens over all data-parallel ranks (reduce() summed them)
        scalars["throughput/tokens_per_s"] = scalars.pop("_tokens") / elapsed
        scalars.update(self.meter.scalars(steps=steps, seconds=elapsed, done=done))
        scalars.update(timer_scalars(self.timers.read(steps)))  # CUDA: one synchronize
        scalars.update(memory_gib(ctx.device) or {})  # an all-reduce on CUDA
        scalars.update(peak_memory_gb(ctx.device))  # an all-reduce
        scale = loss_scale(engine)
        if scale is not None:
            scalars["optim/loss_scale"] = scale
        if not self.model.masked_lm_only:  # arXiv 2111.09543 Table 1 compares two tables
            scalars.update(table_cosines(self.model, ctx.tp_group,
                                         zero3=engine.zero_optimization_stage() == 3) or {})
        slow = self.stragglers.gather(1000.0 * elapsed / steps, scalars) \
            if self.stragglers else ""  # an all-gather of 2 floats per rank
        if self.say:
            self.tb.write(done, scalars)
            self.say(format_log_line(done, t.train_iters, self.consumed, 1000.0 * elapsed / steps,
                                     scalars, t.global_batch_size) + slow)
            self.result.history.append((done, scalars))
        self.acc.reset()
        self.last_log, self.steps_since_log = now, 0
        self.guard.check(done, self.last_good, t.load or t.save)

    def validate(self, done: int) -> None:
        """The validation split (``evaluate``), under the heartbeat's setup budget; its time is
        not training throughput."""
        t = self.t
        began = time.perf_counter()
        if self.heartbeat:
            self.heartbeat.enter("setup")
        scalars = evaluate(self.cfg, self.ctx, self.engine, self.valid_loader, iteration=done)
        if self.say:
            self.tb.write(done, scalars)
            self.say(format_valid_line(done, t.eval_iters * t.global_batch_size, scalars))
            self.result.valid_history.append((done, scalars))
        self.last_log += time.perf_counter() - began  # not training time

    def roll_back(self, spike: Spike, back_step: int, back_dir: str) -> None:
        """Reload the checkpoint of ``back_step`` before ``spike`` and never read the spike's
        samples again: the loader starts afresh after them, the logs forget what followed."""
        t, ctx = self.t, self.ctx
        began = time.perf_counter()
        if self.reload is not None:
            back_step, self.consumed = self.reload(back_dir)
        else:
            client = checkpoint_load.load(self.engine, back_dir, rank=ctx.rank)
            back_step, self.consumed = int(client["step"]), int(client["consumed_samples"])
        self.spike.skipped = merge_ranges([*self.spike.skipped, spike.samples])
        self.spike.rollbacks += 1
        self.spikes.forget_after(back_step)
        self.ours = [(k, d) for k, d in self.ours if k <= back_step]
        self.result.history = [h for h in self.result.history if h[0] <= back_step]
        self.result.valid_history = [h for h in self.result.valid_history if h[0] <= back_step]
        self.tb.rewind(back_step + 1)  # TensorBoard: one value per step, as after a crash
        _log_rollback(self.tb, spike, self.spike, t.max_loss_spike_rollbacks, back_step,
                      back_dir, time.perf_counter() - began, self.say)
        self.train_batches = self.loader_from(self.consumed, back_step)
        self.acc.reset()
        self.guard = NonFiniteGuard(self.engine, ctx.device, t.max_consecutive_nonfinite_iters)
        self.last_good, self.step = back_dir, back_step
        self.last_log, self.steps_since_log = time.perf_counter(), 0

    def loader_from(self, consumed: int, step: int):
        """The training batches from sample ``consumed`` on, for steps ``step`` … the last,
        never reading the skipped spikes' samples."""
        t = self.t
        return iter(self.loaders.get("train", consumed=consumed,
                                     total=consumed + (t.train_iters - step) * t.global_batch_size,
                                     skip=self.spike.skipped))

    def may_save(self, done: int, found: list[Spike], stopping: bool) -> bool:
        """Whether the checkpoint due at ``done`` may be written: never a spiked state the
        rollback policy would leave (the resume finds the spike again), never right after a
        skipped (non-finite) iteration."""
        if found and self.t.loss_spike_policy is LossSpikePolicy.ROLLBACK and stopping:
            return False
        if self.guard.check(done, self.last_good, self.t.load or self.t.save):
            if self.say:
                self.say(f"note: not saving at iteration {done}: the last "
                         f"{self.guard.consecutive()} iteration(s) had a non-finite loss or "
                         f"gradient norm; the last good checkpoint is {self.last_good or 'none'}")
            return False
        return True

    def save(self, done: int) -> bool:
        """The checkpoint after ``done`` steps, with the loader's position, the config and the
        spikes' record in its client state. Its time is left out of the log interval's (the
        iteration time, tokens/s, TFLOP/s, MFU and ETA describe training only, as Megatron-LM's
        ``save_checkpoint_and_time`` stops its interval timer around the save) and shown on its
        own: in its line and as TensorBoard's ``timers/save-checkpoint-time`` (seconds, the
        name Megatron-LM's ``Timers.write`` gives its ``save-checkpoint`` timer)."""
        began = time.perf_counter()
        if self.heartbeat:
            self.heartbeat.enter("checkpointing")
        self.result.checkpoint_dir = checkpoint_save.save(
            self.engine, self.t.save, step=done, rank=self.ctx.rank,
            client_state={"step": done, "consumed_samples": self.consumed,
                          "data": self.data["train"].state(), "config": self.cfg.to_dict(),
                          SPIKES_KEY: _spike_client(self.spike, self.spikes)},
            layout=self.layout)
        self.last_good = self.result.checkpoint_dir
        self.ours.append((done, self.result.checkpoint_dir))
        seconds = time.perf_counter() - began
        self.last_log += seconds
        if self.say:
            self.tb.write(done, {SAVE_TIME_TAG: seconds})
            self.say(f"saved checkpoint at iteration {done:8d} to {self.result.checkpoint_dir} "
                     f"in {seconds:.1f} s")
        return True

    def interrupt(self, done: int, stopping: int, saved: bool) -> None:
        """A stop request (``stopping``: ``StopRequest.agreed``'s code) ends the run after
        ``done`` steps: one line, why and how to resume."""
        if self.say:
            self.say(stop_line(self.stop.reason(stopping), done, self.t.save,
                               self.result.checkpoint_dir if saved else None, self.last_good))
        if self.heartbeat:
            self.heartbeat.stopped(stopping, self.stop.reason(stopping))
        self.result.interrupted, self.result.last_step = True, done

    def finish(self) -> None:
        """The run's end: the stragglers' summary, and the test split once after the last
        step (not after a stop)."""
        t = self.t
        if self.heartbeat:
            self.heartbeat.enter("setup")  # the test split, then the run's end: no step budget
        self.result.stragglers = self.stragglers.summary() if self.stragglers else None
        if "test" in self.data and t.eval_iters > 0 and not self.result.interrupted:
            test_loader = self.loaders.get("test", consumed=0,
                                           total=t.eval_iters * t.global_batch_size)
            scalars = evaluate(self.cfg, self.ctx, self.engine, test_loader, split="test",
                               iteration=t.train_iters)
            if self.say:
                self.tb.write(t.train_iters, scalars)
                self.say(format_valid_line(t.train_iters, t.eval_iters * t.global_batch_size,
                                           scalars, split="test"))
                self.result.test = scalars


def _spike_client(state: SpikeState, monitor: Optional[SpikeMonitor]) -> dict:
    """The checkpoint's record of spikes (``spikes.CLIENT_KEY``): the skipped samples, the
    rollbacks and the rule's window as it stands (the checkpoint's own, with detection off)."""
    if monitor is not None:
        state.window = monitor.rule.state()
    return state.to_client()


def _answer_spikes(found: list[Spike], t, state: SpikeState, ours: list[tuple[int, str]],
                   done: int, tb: MetricsLogger, print_fn,
                   rollback_possible: bool) -> Optional[tuple[int, str]]:
    """What the spikes ``check`` found call for under ``t.loss_spike_policy``: the checkpoint
    (step, directory) to roll back to, or None after a warning line per spike (``print_fn``:
    the logging rank's) and ``loss_spike/ratio`` (``Spike.ratio``) at its last iteration.

    Raises:
        LossSpikeRollbacksError: the run already rolled back ``max_loss_spike_rollbacks`` times.
    """
    if not found:
        return None
    first = found[0]
    before = [(k, d) for k, d in ours if k < first.first_step]
    rollback = t.loss_spike_policy is LossSpikePolicy.ROLLBACK
    if rollback and before:
        back_step, back_dir = max(before)
        if state.rollbacks >= t.max_loss_spike_rollbacks:
            raise LossSpikeRollbacksError(
                f"loss spike at {first.describe()} after {state.rollbacks} rollback(s) "
                f"(--max-loss-spike-rollbacks {t.max_loss_spike_rollbacks}); stopped at "
                f"iteration {done}; the last checkpoint before it is {back_dir}; lower --lr or "
                f"raise --lr-warmup-iters, or raise --max-loss-spike-rollbacks, then resume "
                f"with --load {t.load or t.save}")
        if rollback_possible:
            return back_step, back_dir
        why = "the run stops here without saving, and its resume finds the spike again"
    elif rollback:
        why = "no checkpoint of this run before it to roll back to; training goes on"
    else:
        why = "--loss-spike-policy warn: training goes on"
    for sp in found:
        tb.write(sp.last_step, {"loss_spike/ratio": sp.ratio})
        if print_fn is not None:
            print_fn(f"warning: loss spike at {sp.describe()}; {why}")
    return None


def _log_rollback(tb: MetricsLogger, sp: Spike, state: SpikeState, limit: int, back_step: int,
                  back_dir: str, seconds: float, print_fn) -> None:
    """The rollback's line and its TensorBoard record (after ``tb.rewind``, so kept):
    ``loss_spike/ratio`` at the spike's last iteration, ``loss_spike/rollbacks``,
    ``loss_spike/rolled_back_to_iteration`` and ``loss_spike/skipped_samples`` at its first,
    and the exact range as text (TensorBoard's float32 scalars cannot hold a sample index
    above 2**24)."""
    a, b = sp.samples
    line = (f"loss spike at {sp.describe()}: rolled back to iteration {back_step} ({back_dir}, "
            f"loaded in {seconds:.1f} s); global samples {a}–{b - 1} ({b - a}) will not be "
            f"read; rollback {state.rollbacks} of at most {limit} (--max-loss-spike-rollbacks)")
    tb.write(sp.last_step, {"loss_spike/ratio": sp.ratio})
    tb.write(sp.first_step, {"loss_spike/rollbacks": float(state.rollbacks),
                             "loss_spike/rolled_back_to_iteration": float(back_step),
                             "loss_spike/skipped_samples": float(b - a)})
    tb.write_text("loss_spike/rollback", line, sp.first_step)
    if print_fn is not None:
        print_fn(line)
