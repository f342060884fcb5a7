"""The entry point's flags and the run configuration they give (Megatron-LM's
``megatron/training/arguments.py``: ``parse_args``, then ``validate_args``).

:func:`build_parser` holds every flag of ``rtd_scale/pretrain.py`` (its ``--help``), one
function per group, with Megatron-LM's names where one exists; the Megatron-LM model and
optimizer flags, their ``--generator-`` twins and the refused ones are
``megatron_args.add_model_args``'s group. The list is frozen (tests/unit/test_cli_flags.py): a
new knob is a config field, set with ``--set`` or in a ``--config`` file. :func:`config_from_args`
builds the config: preset or ``--config`` → flags → ``--set`` overrides, validated once at the
end, an error naming the flag that set the field (:data:`FLAG_FIELDS`, the table of flags and
fields).
"""
from __future__ import annotations

import argparse
import math
import os
import warnings

from rtd_scale import config_file, megatron_args
from rtd_scale.cli_errors import OneLineArgumentParser, UserInputError
from rtd_scale.config import (AttentionType, ConfigError, LayerNormPosition, LossSpikePolicy,
                              LRDecayStyle, Precision, RunConfig, Sharing, SharingScope,
                              WSDDecayStyle, apply_override)
from rtd_scale.presets import PRESETS, preset
from rtd_scale.training.throughput import DEVICE_PEAK_TFLOPS


def _run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the run: a preset or a config file, the DeepSpeed config, overrides")
    g.add_argument("--config", metavar="FILE",
                   help="start from this config: a run's config.json, or YAML / JSON with its "
                        "fields (those left out: the file's preset's); flags beside it override "
                        "it; with --load, what a resume may not change is refused")
    g.add_argument("--ds_config", "--deepspeed_config", dest="ds_config",
                   help="DeepSpeed JSON (ZeRO knobs), e.g. ds_configs/zero3.json; required "
                        "unless --config names one")
    g.add_argument("--preset", choices=list(PRESETS), metavar="NAME",
                   help=f"named config, one of {', '.join(PRESETS)} (default tiny; "
                        "rtd_scale/presets.py's PRESETS)")
    g.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set model.generator.num_layers=2 "
                        "(the way to a knob without a flag of its own)")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # passed by the deepspeed launcher


def _data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    for flag, help_text in (
            ("--data-path", "shard or dataset prefixes printed by tools/preprocess_data.py, read "
             "as one dataset; or WEIGHT PREFIX pairs to blend datasets by weight "
             "(e.g. 0.7 A 0.3 B)"),
            ("--train-data-path", "Megatron-LM's name for the training corpus when the held-out "
             "ones are given: the same as --data-path"),
            ("--valid-data-path", "a held-out validation corpus, --data-path's syntax, read whole: "
             "validation (--eval-interval, --eval-iters; the held-out RTD AUC) reads it instead "
             "of --split's validation share, which then trains"),
            ("--test-data-path", "a held-out test corpus, --data-path's syntax, read whole and "
             "evaluated (--eval-iters global batches) after the last step, as Megatron-LM does; "
             "--split's test share then trains")):
        g.add_argument(flag, nargs="+", metavar="[WEIGHT] PREFIX", help=help_text)
    g.add_argument("--split", help="train,valid,test shares of each dataset's documents "
                   "(default 969,30,1)")
    g.add_argument("--data-cache-path", help="directory for the cached sample index "
                   "(default: index-cache/ next to each dataset's first shard)")
    g.add_argument("--num-workers", type=int, help="DataLoader worker processes per rank "
                   "(default 2; 0 in the tiny preset)")
    g.add_argument("--reset-attention-mask", "--reset-position-ids", dest="reset_attention_mask",
                   action="store_true", default=None,
                   help="document-masked packing (data.document_masking): inside a packed "
                   "sample, attention stays within each document and positions restart at each "
                   "(Megatron-LM's --reset-attention-mask and --reset-position-ids, one switch "
                   "here: either name sets both); the samples, their order and masks are the "
                   "same. Default: the preset's (on for modernbert-*, off for the others)")
    g.add_argument("--tokenizer-model", help="the tokenizer the shards were made with: a SentencePiece "
                   ".model, a tokenizer.json or a WordPiece vocab.txt")
    g.add_argument("--seq-length", type=int)


def _training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, help="optimizer steps")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--seed", type=int)
    for flag, help_text in (
            ("--bf16", "bf16 compute, fp32 master weights"),
            ("--fp16", "fp16 compute, fp32 master weights, DeepSpeed's dynamic loss scaler "
             "(knobs in the ds_config's fp16 section); for GPUs without bf16 (V100, T4); not "
             "with --bf16"),
            ("--recompute-activations", "activation checkpointing in both models (megatron-core "
             "full-layer recompute): less memory, one more forward per layer"),
            ("--compile-layers", "torch.compile every encoder layer (model.compile_layers): "
             "faster GPU steps after a compilation at start-up")):
        g.add_argument(flag, action="store_true", default=None, help=help_text)
    g.add_argument("--eval-interval", type=int, help="validate every N steps, and after the "
                   "last step (0: never)")
    g.add_argument("--eval-iters", type=int, help="global batches per validation (0: never)")


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int)
    g.add_argument("--pipeline-model-parallel-size", type=int)
    g.add_argument("--distributed-timeout-minutes", type=int, metavar="MINUTES",
                   help="timeout of torch.distributed's and megatron-core's process groups "
                        "(a rank that waits longer on the others fails; Megatron-LM's flag, "
                        "default 10)")


def _objective_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the objective, attention and embedding sharing")
    g.add_argument("--sharing", choices=[s.value for s in Sharing],
                   help="embedding sharing between generator and discriminator: es (one "
                        "embedding layer, ELECTRA), nes (separate), gdes (E_D = stopgrad(E_G) + "
                        "E_Δ, DeBERTaV3); default: the preset's")
    g.add_argument("--sharing-scope", choices=[s.value for s in SharingScope],
                   help="what es / gdes share: embeddings (default; es: token, position and "
                        "token-type tables and the embedding LayerNorm, as ELECTRA; gdes: token "
                        "and position tables, each stopgrad(E_G) + E_Δ, as DeBERTa) or tokens "
                        "(the token table only). No effect under nes or --attention-type "
                        "disentangled (no position or token-type table there)")
    g.add_argument("--layernorm-position", choices=[x.value for x in LayerNormPosition],
                   help="encoder layout: pre (pre-LayerNorm, final LayerNorm) or post "
                        "(BERT/ELECTRA, Hugging Face ElectraModel); default: the preset's")
    g.add_argument("--attention-type", choices=[x.value for x in AttentionType],
                   help="self-attention: bert (absolute positions), disentangled (DeBERTa's "
                        "relative c2p|p2c attention, needs --layernorm-position post) or rotary "
                        "(the modern block, ModernBERT's: --position-embedding-type rope); "
                        "default: the preset's")
    g.add_argument("--rtd-lambda", type=float, help="λ in L_MLM + λ·L_RTD (default 50)")
    g.add_argument("--mask-prob", type=float)
    g.add_argument("--mask-strategy", choices=["token", "whole_word", "span"],
                   help="mask single tokens (default), whole words, or SpanBERT spans of whole "
                        "words (objectives/masking.py)")


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("AdamW and the learning-rate schedule")
    # megatron-core's OptimizerParamScheduler, with Megatron-LM's flags (training/lr_schedule.py);
    # a list in the second place is the flag's choices, a type otherwise
    for flag, kind, help_text in (
            ("--lr", float, None), ("--min-lr", float, None), ("--lr-warmup-iters", int, None),
            ("--lr-decay-iters", int, "default: --train-iters"),
            ("--lr-decay-style", [x.value for x in LRDecayStyle],
             "after the warm-up, from --lr to --min-lr (default linear)"),
            ("--lr-warmup-fraction", float, "warm-up as a fraction of the decay length (instead "
             "of --lr-warmup-iters / --lr-warmup-samples)"),
            ("--lr-warmup-samples", int, "warm-up in samples"),
            ("--lr-decay-samples", int, "decay length in samples (instead of --lr-decay-iters)"),
            ("--lr-warmup-init", float, "the lr warm-up starts from (default 0)"),
            ("--lr-wsd-decay-style", [x.value for x in WSDDecayStyle],
             "WSD's annealing (default exponential)"),
            ("--lr-wsd-decay-iters", int, "WSD: the last N steps of the decay anneal to --min-lr "
             "(the lr holds at --lr before them)"),
            ("--lr-wsd-decay-samples", int, "WSD's annealing phase in samples")):
        g.add_argument(flag, help=help_text,
                       **({"choices": kind} if isinstance(kind, list) else {"type": kind}))
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--clip-grad", type=float)
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true", default=None,
                   help="with --load: use this run's optimizer flags (the schedule's --lr, "
                        "--min-lr, --lr-warmup-*, --lr-decay-*, --lr-wsd-*, and --weight-decay, "
                        "--adam-beta1, --adam-beta2, --adam-eps, --clip-grad) from the first "
                        "resumed iteration when they differ from the checkpoint's; without "
                        "this or the next flag such a difference is refused")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true", default=None,
                   help="with --load: keep the checkpoint's schedule and optimizer values, "
                        "whatever those flags say (config.json records them)")


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints, resume and exports")
    g.add_argument("--save", help="run directory: checkpoints, config.json, ds_config.json")
    g.add_argument("--load", help="resume from the newest complete checkpoint in this "
                   "directory (one whose completion record matches its files), or from exactly "
                   "DIR/global_stepN; also at another TP, PP or DP size or ZeRO stage, exactly "
                   "(the checkpoint converted once, beside it)")
    g.add_argument("--ckpt-step", type=int, metavar="N", help="with --load DIR: resume from "
                   "DIR/global_stepN (Megatron-LM's name); an error when it is incomplete")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--override-data-order", action="store_true", default=None,
                   help="with --load: accept a --seed other than the checkpoint's, or training "
                        "data other than it was trained on (regenerated or re-ordered shards, "
                        "an edited blend: refused without it); the new order, masks and "
                        "sampling noise start at the resumed sample")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal, save a checkpoint after the current step and exit 0 "
                        "(for preemption: Slurm's --signal); SIGTERM, SIGINT and the deepspeed "
                        "launcher's exit always do so")
    g.add_argument("--exit-signal", default="SIGTERM",
                   choices=["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"])
    g.add_argument("--export", help="after the last step, write a consolidated, TP-agnostic fp32 "
                   "state dict (ZeRO partitions and TP shards merged, vocabulary padding removed) "
                   "to this .pt file; loads at any TP size (rtd_scale.model.weights)")
    g.add_argument("--export-hf", metavar="DIR", help="after the last step, write a Hugging Face "
                   "transformers export (as tools/export_hf.py): the discriminator at DIR "
                   "(ElectraForPreTraining; RobertaPreLayerNormModel + rtd_head.safetensors for "
                   "--layernorm-position pre), the generator at DIR/generator, the tokenizer in both")
    g.add_argument("--pretrained-checkpoint", metavar="PATH", help="start from these weights "
                   "only (optimizer and schedule start fresh), at any TP / PP / DP layout: an "
                   "export directory (tools/export_hf.py, --export-hf), a Hugging Face ELECTRA "
                   "directory (the generator in PATH/generator, or fresh) or an --export .pt "
                   "file; not with --load")


def _logging_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, monitoring and profiling")
    g.add_argument("--log-interval", type=int)
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2],
                   help="per-phase times in the log line and TensorBoard (timers/*_ms): 0 none "
                        "(default), 1 data wait, forward, backward, optimizer step; 2 also the "
                        "forward's mask, generator forward, sample, discriminator forward "
                        "(CUDA events read at the log interval: no sync per step)")
    g.add_argument("--tensorboard-dir", help="default: <save>/tensorboard")
    # Weights & Biases and the step profiler, with Megatron-LM's flags (config.MonitorConfig)
    g.add_argument("--wandb-project", help="also log the TensorBoard scalars and the resolved "
                   "config to this W&B project (needs `pip install 'rtd_scale[wandb]'`; offline: "
                   "WANDB_MODE=offline, then `wandb sync`)")
    g.add_argument("--wandb-exp-name", help="the W&B run's name (default: W&B picks one)")
    g.add_argument("--wandb-entity", help="the W&B team or user (default: W&B's default)")
    g.add_argument("--wandb-save-dir", help="W&B's local files (default: <save>/wandb)")
    g.add_argument("--profile", action="store_true", default=None,
                   help="write a torch.profiler trace of iterations --profile-step-start … "
                        "--profile-step-end − 1 to <tensorboard-dir>/profile (TensorBoard's "
                        "profiler plugin, https://ui.perfetto.dev)")
    g.add_argument("--profile-step-start", type=int, help="first traced iteration (default 10)")
    g.add_argument("--profile-step-end", type=int, help="the iteration after the last traced "
                   "one (default 12)")
    g.add_argument("--profile-ranks", type=int, nargs="+", metavar="RANK",
                   help="global ranks to trace (default 0)")
    g.add_argument("--peak-tflops-per-device", type=float, metavar="TFLOPS",
                   help="a device's peak TFLOP/s, the denominator of the MFU in the log "
                        "(default: the bf16 dense datasheet value of a known GPU; else no MFU)")
    g.add_argument("--device-peak", choices=sorted(DEVICE_PEAK_TFLOPS), help="the peak of a "
                   "known GPU by name (bf16 dense datasheet value); instead of "
                   "--peak-tflops-per-device")
    g.add_argument("--log-throughput", action="store_true", help="accepted for Megatron-LM's "
                   "command lines: TFLOP/s per device, MFU, memory and ETA are always logged")
    g.add_argument("--data-digest", metavar="FILE", help="audit: append one JSON line per step "
                   "with the step's global sample ids and hashes of its masks and losses "
                   "(gathered over data-parallel ranks; costs one gather per step)")
    g.add_argument("--eval-dump-dir", metavar="DIR", help="analysis: write each validation's "
                   "original ids, masks, corrupted ids and discriminator logits to "
                   "DIR/valid_iter{N}_dp{R}.pt (torch.save), one file per data-parallel rank; "
                   "e.g. to score an oracle discriminator on the run's own replacements")


def _fault_tolerance_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fault tolerance: non-finite steps, hangs, stragglers, loss spikes")
    g.add_argument("--max-consecutive-nonfinite-iters", type=int, metavar="N",
                   help="stop with an error after N iterations in a row whose loss or gradient "
                        "norm is inf or NaN (each is skipped and counted); checked at the log "
                        "interval and before a save; 0: never stop (default 5)")
    g.add_argument("--ft-rank-section-timeouts", metavar="SECTION:SECONDS,...",
                   help="the heartbeat's budgets (NVIDIA resiliency extension's flag and "
                        "sections): a rank that finishes no step within its section's budget "
                        "is declared hung, every rank's Python stack goes to "
                        "<save>/hangs/…/stacks.txt, one line names the rank(s) and the run ends "
                        "(exit status 75) for its supervisor to restart. Sections: setup (to "
                        "the first step, and a validation; default 600), step (default auto: 5 "
                        "× the median step time, at least 180), checkpointing (a save; default "
                        "auto: 5 × the longest save, at least 420). A value is seconds, auto, "
                        "or none (off); e.g. setup:600,step:120,checkpointing:auto")
    g.add_argument("--straggler-threshold", type=float, metavar="FRACTION",
                   help="name, at each log interval, the ranks whose own work per step is "
                        "slower than FRACTION of their peers' median (time to the step's first "
                        "collective; training/stragglers.py): in the log line, TensorBoard "
                        "(stragglers/*) and the summary (default 0.7, Megatron-LM's and NVIDIA's "
                        "threshold; 0: name none)")
    g.add_argument("--loss-spike-policy", choices=[m.value for m in LossSpikePolicy],
                   help="what a loss spike does. A spike: an iteration whose L_MLM or L_RTD "
                        "exceeds its median over the previous --loss-spike-window-iters "
                        "iterations by more than --loss-spike-threshold robust standard "
                        "deviations (1.4826 × the median absolute deviation, of the logarithm) "
                        "and by more than 10%% of the median (train.loss_spike_min_rise); armed "
                        "once the window is full; spikes leave the window out; read at the log "
                        "interval and before a save (no host sync per step). rollback "
                        "(default): reload the newest checkpoint this run saved or resumed "
                        "from before the spike, never read the spiking iterations' samples "
                        "(with the iterations just before them whose gradient norm crossed the "
                        "same rule), record them in every later checkpoint so any resume skips "
                        "them, and continue: a run left alone for weeks should not train on a "
                        "damaged model, and a false alarm costs only the iterations since that "
                        "checkpoint; warn: one line and loss_spike/* in TensorBoard; off")
    g.add_argument("--loss-spike-window-iters", type=int, metavar="N",
                   help="iterations a spike is measured against (default 100)")
    g.add_argument("--loss-spike-threshold", type=float, metavar="Z",
                   help="robust standard deviations above the window's median (default 6)")
    g.add_argument("--max-loss-spike-rollbacks", type=int, metavar="N",
                   help="rollbacks in the whole run (counted across resumes) after which a "
                        "spike stops it with one line, exit status 2, not restarted (default 5)")


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    """The entry point's flags, one function per group of ``--help``; ``quiet``: print no
    usage error or help (ranks other than 0). The list is frozen
    (tests/unit/test_cli_flags.py): a new knob is a config field, set with ``--set`` or in the
    ``--config`` file."""
    p = OneLineArgumentParser(
        prog="rtd_scale/pretrain.py", quiet=quiet,
        description="Replaced-token-detection pretraining (ELECTRA / DeBERTaV3) on megatron-core "
                    "and DeepSpeed. Launch with `deepspeed rtd_scale/pretrain.py ...`.")
    for add in (_run_flags, _data_flags, _training_flags, _parallel_flags, _objective_flags,
                _optimizer_flags, _checkpoint_flags, _logging_flags, _fault_tolerance_flags,
                megatron_args.add_model_args):
        add(p)
    return p


# The one table of flags and the config fields they set: "--flag" → "section.field". A value
# flag given sets its field (config_from_args), and an error about a field a flag set names that
# flag (config.ConfigError.naming). Megatron-LM's model flags, whose generator follows the
# discriminator, are megatron_args' (ENCODER_FIELDS, SECTION_FIELDS); config_from_args applies
# those flags the same way.
FLAG_FIELDS: dict[str, str] = {
    "--ds_config": "train.ds_config",
    **{f"--{name.replace('_', '-')}": f"data.{name}" for name in (
        "data_path", "valid_data_path", "test_data_path", "tokenizer_model", "seq_length",
        "split", "data_cache_path", "num_workers")},
    "--reset-attention-mask": "data.document_masking",  # and its other name, --reset-position-ids
    **{f"--{name.replace('_', '-')}": f"train.{name}" for name in (
        "train_iters", "micro_batch_size", "global_batch_size", "seed", "save", "load",
        "save_interval", "log_interval", "timing_log_level", "tensorboard_dir", "export",
        "export_hf", "pretrained_checkpoint", "eval_interval", "eval_iters", "data_digest",
        "eval_dump_dir", "max_consecutive_nonfinite_iters", "loss_spike_policy",
        "loss_spike_window_iters", "loss_spike_threshold", "max_loss_spike_rollbacks",
        "peak_tflops_per_device", "override_data_order")},
    **{f"--{name.replace('_', '-')}": f"parallel.{name}" for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "distributed_timeout_minutes")},
    **{f"--{name.replace('_', '-')}": f"model.{name}" for name in (
        "sharing", "sharing_scope", "layernorm_position", "attention_type",
        "recompute_activations", "compile_layers")},
    **{f"--{name.replace('_', '-')}": f"rtd.{name}" for name in (
        "rtd_lambda", "mask_prob", "mask_strategy")},
    **{f"--{name.replace('_', '-')}": f"optim.{name}" for name in (
        "lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style",
        "lr_warmup_fraction", "lr_warmup_samples", "lr_decay_samples", "lr_warmup_init",
        "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples", "weight_decay",
        "clip_grad")},
    # Megatron-LM's spelling, with its underscore
    "--override-opt_param-scheduler": "optim.override_opt_param_scheduler",
    "--use-checkpoint-opt_param-scheduler": "optim.use_checkpoint_opt_param_scheduler",
    **{f"--{name.replace('_', '-')}": f"monitor.{name}" for name in (
        "wandb_project", "wandb_exp_name", "wandb_entity", "wandb_save_dir", "profile",
        "profile_step_start", "profile_step_end", "profile_ranks")},
    "--straggler-threshold": "fault_tolerance.straggler_threshold",
    **megatron_args.FLAG_FIELDS,
}
# Flags that set a field other than by their value (config_from_args says how).
DERIVED_FLAG_FIELDS: dict[str, str] = {
    "--bf16": "train.precision", "--fp16": "train.precision",
    "--device-peak": "train.peak_tflops_per_device",
    "--vocab-file": "data.tokenizer_model", "--train-data-path": "data.data_path",
    "--ckpt-step": "train.load",
    # the modern block's flags without a field of their own (megatron_args._apply_block_args)
    "--position-embedding-type": "model.attention_type",
    "--use-rotary-position-embeddings": "model.attention_type",
    "--swiglu": "model.mlp_activation", "--disable-bias-linear": "model.add_bias_linear",
    "--window-size": "model.window_size",
}


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


_SECTION_FIELDS = {"setup": "setup_timeout_s", "step": "step_timeout_s",
                   "checkpointing": "checkpointing_timeout_s"}


def _section_timeouts(cfg: RunConfig, value: str) -> None:
    """``--ft-rank-section-timeouts setup:600,step:auto,checkpointing:none`` into
    ``cfg.fault_tolerance`` (seconds; auto: derived, ``None``; none: off, 0)."""
    for item in filter(None, (v.strip() for v in value.split(","))):
        name, _, raw = item.partition(":")
        if name not in _SECTION_FIELDS or not raw:
            raise UserInputError(f"--ft-rank-section-timeouts {value}: cannot read {item!r}; "
                                 "expected SECTION:SECONDS with SECTION one of setup, step, "
                                 "checkpointing and SECONDS a number, auto or none, e.g. "
                                 "setup:600,step:120,checkpointing:auto")
        if raw == "auto" and name == "setup":
            raise UserInputError(f"--ft-rank-section-timeouts {value}: setup has no measured "
                                 "time to derive a budget from; give seconds or none")
        try:
            seconds = None if raw == "auto" else 0.0 if raw == "none" else float(raw)
        except ValueError:
            raise UserInputError(f"--ft-rank-section-timeouts {value}: {name}:{raw} is not "
                                 "seconds, auto or none") from None
        if seconds is not None and not math.isfinite(seconds):  # config.json holds no inf/NaN
            raise UserInputError(f"--ft-rank-section-timeouts {value}: {name}:{raw} is not "
                                 "seconds, auto or none (none: no budget)")
        setattr(cfg.fault_tolerance, _SECTION_FIELDS[name], seconds)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Preset (or ``--config FILE``) → flags → ``--set`` overrides, validated once at the end.

    Raises:
        ValueError: naming the flag, file or field and the fix.
    """
    cfg, left_out = (config_file.read(args.config, preset_flag=args.preset) if args.config
                     else (preset(args.preset or "tiny"), {}))
    if args.train_data_path is not None:
        if args.data_path is not None and args.data_path != args.train_data_path:
            raise UserInputError("--data-path and --train-data-path name two training corpora; "
                                 "pass one of them")
        args.data_path = args.train_data_path
    if args.lr_warmup_iters is None and (args.lr_warmup_fraction is not None
                                         or args.lr_warmup_samples is not None):
        # the warm-up given in another unit replaces the preset's (in iterations), as when
        # Megatron-LM is given only one of them
        cfg.optim.lr_warmup_iters = 0
    origins: dict[str, str] = {}  # config field → the flag that set it, for the errors
    for flag, path in FLAG_FIELDS.items():
        value = getattr(args, _dest(flag), None)
        if value is not None and flag not in megatron_args.FLAG_FIELDS:
            section, name = path.split(".")
            setattr(getattr(cfg, section), name, value)
            origins[path] = flag
    if args.bf16 and args.fp16:
        raise UserInputError("--bf16 and --fp16 contradict each other; pass one of them")
    for flag, precision in (("--bf16", Precision.BF16), ("--fp16", Precision.FP16)):
        if getattr(args, _dest(flag)):
            cfg.train.precision = precision
            origins["train.precision"] = flag
    if args.device_peak:
        if args.peak_tflops_per_device is not None:
            raise UserInputError("--device-peak and --peak-tflops-per-device both give the "
                                 "peak; pass one of them")
        cfg.train.peak_tflops_per_device = DEVICE_PEAK_TFLOPS[args.device_peak]
    if args.ft_rank_section_timeouts is not None:
        _section_timeouts(cfg, args.ft_rank_section_timeouts)
    origins.update(megatron_args.apply_model_args(cfg, args))  # before --set
    for assignment in args.set:
        field = apply_override(cfg, assignment)  # --set has the last word
        origins[field] = f"--set {field}"
    if left_out and (note := config_file.left_out_note(
            args.config, left_out, cfg, {p: f for f, p in reversed(FLAG_FIELDS.items())})):
        warnings.warn(note)  # printed once the run is validated (pretrain.py's HeldWarnings)
    if args.ckpt_step is not None:  # one form for both: --load DIR/global_stepN
        if not cfg.train.load:
            raise UserInputError(f"--ckpt-step {args.ckpt_step}: needs --load DIR (the run "
                                 "directory holding global_step*)")
        cfg.train.load = os.path.join(cfg.train.load, f"global_step{args.ckpt_step}")
    if cfg.train.tensorboard_dir is None and cfg.train.save:
        cfg.train.tensorboard_dir = os.path.join(cfg.train.save, "tensorboard")
    monitor = cfg.monitor
    if monitor.uses_wandb and monitor.wandb_save_dir is None:
        if not cfg.train.save:
            raise UserInputError(f"--wandb-project {monitor.wandb_project}: W&B needs a "
                                 "directory for its files; pass --wandb-save-dir DIR or --save")
        monitor.wandb_save_dir = os.path.join(cfg.train.save, "wandb")  # Megatron-LM's default
    if monitor.profile and not cfg.train.tensorboard_dir:
        raise UserInputError("--profile writes its trace to <tensorboard-dir>/profile; pass "
                             "--tensorboard-dir DIR or --save")
    try:
        cfg.validate()
    except ConfigError as e:  # a field a flag set is named by that flag
        raise e.naming(origins) from None
    if not cfg.train.ds_config:
        raise UserInputError("--ds_config is required: the DeepSpeed JSON, e.g. "
                             "ds_configs/zero1.json")
    if not cfg.data.data_path:
        raise UserInputError("--data-path is required: shard prefixes made by tools/preprocess_data.py")
    if not cfg.data.tokenizer_model:
        raise UserInputError("--tokenizer-model is required: the SentencePiece model the shards "
                             "were made with")
    return cfg
