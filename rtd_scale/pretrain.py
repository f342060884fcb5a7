"""RTD pretraining entry point.

    deepspeed rtd_scale/pretrain.py --ds_config ds_configs/zero3.json --preset tiny \
        --data-path data/sample/shards_text_document --tokenizer-model data/sample/spm.model \
        --save runs/tiny --train-iters 300 ...

Flags follow Megatron-LM's names where one exists. Order of work: parse → config (preset, flags,
``--set`` overrides) → every check that can fail on user input (config, ds_config, tokenizer vs
shards, ``--load``, the output paths) → the configuration's warnings (held until then, so a
refused run prints only its error) → distributed start (MASTER_ADDR resolved first) → model →
DeepSpeed engine → resolved config and ds_config written into the run directory → train → test
split (``--test-data-path``) → summary. A user error prints one line ``error: <what> — <fix>``
and exits 1 before anything is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Sequence

if __name__ == "__main__" and __package__ in (None, ""):
    # Run as a script (``deepspeed rtd_scale/pretrain.py``): import the package, not its folder.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(_here))

from rtd_scale import launch_env  # noqa: E402
from rtd_scale.atomic import write_atomic  # noqa: E402
from rtd_scale.cli_errors import (HeldWarnings, OneLineArgumentParser, check_writable_dir,  # noqa: E402
                                 UserInputError, one_line_warnings)
from rtd_scale.config import LRDecayStyle, WSDDecayStyle  # noqa: E402
from rtd_scale.training.throughput import DEVICE_PEAK_TFLOPS  # noqa: E402
from rtd_scale import megatron_args  # noqa: E402
from rtd_scale.config import (AttentionType, ConfigError, LayerNormPosition, Precision,  # noqa: E402
                              PRESETS, RunConfig, Sharing, SharingScope, apply_override,
                              preset)


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    """The entry point's flags; ``quiet``: print no usage error or help (ranks other than 0)."""
    p = OneLineArgumentParser(
        prog="rtd_scale/pretrain.py", quiet=quiet,
        description="Replaced-token-detection pretraining (ELECTRA / DeBERTaV3) on megatron-core "
                    "and DeepSpeed. Launch with `deepspeed rtd_scale/pretrain.py ...`.")
    p.add_argument("--ds_config", "--deepspeed_config", dest="ds_config", required=True,
                   help="DeepSpeed JSON (ZeRO knobs), e.g. ds_configs/zero3.json")
    p.add_argument("--preset", default="tiny", choices=list(PRESETS), metavar="NAME",
                   help=f"named config, one of {', '.join(PRESETS)} (default tiny; "
                        "rtd_scale/config.py's PRESETS)")
    p.add_argument("--data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                   help="shard or dataset prefixes printed by tools/preprocess_data.py, read as "
                        "one dataset; or WEIGHT PREFIX pairs to blend datasets by weight "
                        "(e.g. 0.7 A 0.3 B)")
    p.add_argument("--train-data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                   help="Megatron-LM's name for the training corpus when the held-out ones "
                        "are given: the same as --data-path")
    p.add_argument("--valid-data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                   help="a held-out validation corpus, --data-path's syntax, read whole: "
                        "validation (--eval-interval, --eval-iters; the held-out RTD AUC) reads "
                        "it instead of --split's validation share, which then trains")
    p.add_argument("--test-data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                   help="a held-out test corpus, --data-path's syntax, read whole and "
                        "evaluated (--eval-iters global batches) after the last step, as "
                        "Megatron-LM does; --split's test share then trains")
    p.add_argument("--split", help="train,valid,test shares of each dataset's documents "
                   "(default 969,30,1)")
    p.add_argument("--data-cache-path", help="directory for the cached sample index "
                   "(default: index-cache/ next to each dataset's first shard)")
    p.add_argument("--num-workers", type=int, help="DataLoader worker processes per rank "
                   "(default 2; 0 in the tiny preset)")
    p.add_argument("--eval-interval", type=int, help="validate every N steps (0: never)")
    p.add_argument("--eval-iters", type=int, help="global batches per validation (0: never)")
    p.add_argument("--data-digest", metavar="FILE", help="audit: append one JSON line per step "
                   "with the step's global sample ids and hashes of its masks and losses "
                   "(gathered over data-parallel ranks; costs one gather per step)")
    p.add_argument("--eval-dump-dir", metavar="DIR", help="analysis: write each validation's "
                   "original ids, masks, corrupted ids and discriminator logits to "
                   "DIR/valid_iter{N}_dp{R}.pt (torch.save), one file per data-parallel rank; "
                   "e.g. to score an oracle discriminator on the run's own replacements")
    p.add_argument("--tokenizer-model", help="the tokenizer the shards were made with: a SentencePiece "
                   ".model, a tokenizer.json or a WordPiece vocab.txt")
    p.add_argument("--save", help="run directory: checkpoints, config.json, ds_config.json")
    p.add_argument("--load", help="resume from the newest complete checkpoint in this "
                   "directory (one whose completion record matches its files), or from exactly "
                   "DIR/global_stepN")
    p.add_argument("--ckpt-step", type=int, metavar="N", help="with --load DIR: resume from "
                   "DIR/global_stepN (Megatron-LM's name); an error when it is incomplete")
    p.add_argument("--train-iters", type=int, help="optimizer steps")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--micro-batch-size", type=int)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--tensor-model-parallel-size", type=int)
    p.add_argument("--distributed-timeout-minutes", type=int, metavar="MINUTES",
                   help="timeout of torch.distributed's and megatron-core's process groups "
                        "(a rank that waits longer on the others fails; Megatron-LM's flag, "
                        "default 10)")
    p.add_argument("--pipeline-model-parallel-size", type=int)
    p.add_argument("--sharing", choices=[s.value for s in Sharing],
                   help="embedding sharing between generator and discriminator: es (one "
                        "embedding layer, ELECTRA), nes (separate), gdes (E_D = stopgrad(E_G) + "
                        "E_Δ, DeBERTaV3); default: the preset's")
    p.add_argument("--sharing-scope", choices=[s.value for s in SharingScope],
                   help="what es / gdes share: embeddings (default; es: token, position and "
                        "token-type tables and the embedding LayerNorm, as ELECTRA; gdes: token "
                        "and position tables, each stopgrad(E_G) + E_Δ, as DeBERTa) or tokens "
                        "(the token table only). No effect under nes or --attention-type "
                        "disentangled (no position or token-type table there)")
    p.add_argument("--layernorm-position", choices=[x.value for x in LayerNormPosition],
                   help="encoder layout: pre (pre-LayerNorm, final LayerNorm) or post "
                        "(BERT/ELECTRA, Hugging Face ElectraModel); default: the preset's")
    p.add_argument("--attention-type", choices=[x.value for x in AttentionType],
                   help="self-attention: bert (absolute positions) or disentangled (DeBERTa's "
                        "relative c2p|p2c attention, needs --layernorm-position post); default: "
                        "the preset's")
    p.add_argument("--rtd-lambda", type=float, help="λ in L_MLM + λ·L_RTD (default 50)")
    p.add_argument("--mask-prob", type=float)
    p.add_argument("--mask-strategy", choices=["token", "whole_word", "span"],
                   help="mask single tokens (default), whole words, or SpanBERT spans of whole "
                        "words (objectives/masking.py)")
    p.add_argument("--lr", type=float)
    p.add_argument("--min-lr", type=float)
    p.add_argument("--lr-warmup-iters", type=int)
    p.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    # megatron-core's OptimizerParamScheduler, with Megatron-LM's flags (training/lr_schedule.py)
    p.add_argument("--lr-decay-style", choices=[x.value for x in LRDecayStyle],
                   help="after the warm-up, from --lr to --min-lr (default linear)")
    p.add_argument("--lr-warmup-fraction", type=float, help="warm-up as a fraction of the "
                   "decay length (instead of --lr-warmup-iters / --lr-warmup-samples)")
    p.add_argument("--lr-warmup-samples", type=int, help="warm-up in samples")
    p.add_argument("--lr-decay-samples", type=int, help="decay length in samples (instead of "
                   "--lr-decay-iters)")
    p.add_argument("--lr-warmup-init", type=float, help="the lr warm-up starts from (default 0)")
    p.add_argument("--lr-wsd-decay-style", choices=[x.value for x in WSDDecayStyle],
                   help="WSD's annealing (default exponential)")
    p.add_argument("--lr-wsd-decay-iters", type=int, help="WSD: the last N steps of the decay "
                   "anneal to --min-lr (the lr holds at --lr before them)")
    p.add_argument("--lr-wsd-decay-samples", type=int, help="WSD's annealing phase in samples")
    p.add_argument("--peak-tflops-per-device", type=float, metavar="TFLOPS",
                   help="a device's peak TFLOP/s, the denominator of the MFU in the log "
                        "(default: the bf16 dense datasheet value of a known GPU; else no MFU)")
    p.add_argument("--device-peak", choices=sorted(DEVICE_PEAK_TFLOPS), help="the peak of a "
                   "known GPU by name (bf16 dense datasheet value); instead of "
                   "--peak-tflops-per-device")
    p.add_argument("--log-throughput", action="store_true", help="accepted for Megatron-LM's "
                   "command lines: TFLOP/s per device, MFU, memory and ETA are always logged")
    p.add_argument("--weight-decay", type=float)
    p.add_argument("--clip-grad", type=float)
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights")
    p.add_argument("--fp16", action="store_true", help="fp16 compute, fp32 master weights, "
                   "DeepSpeed's dynamic loss scaler (knobs in the ds_config's fp16 section); "
                   "for GPUs without bf16 (V100, T4); not with --bf16")
    p.add_argument("--recompute-activations", action="store_true",
                   help="activation checkpointing in both models (megatron-core full-layer "
                        "recompute): less memory, one more forward per layer")
    p.add_argument("--compile-layers", action="store_true",
                   help="torch.compile every encoder layer (model.compile_layers): faster GPU "
                        "steps after a compilation at start-up")
    p.add_argument("--export", help="after the last step, write a consolidated, TP-agnostic fp32 "
                   "state dict (ZeRO partitions and TP shards merged, vocabulary padding removed) "
                   "to this .pt file; loads at any TP size (rtd_scale.model.weights)")
    p.add_argument("--export-hf", metavar="DIR", help="after the last step, write a Hugging Face "
                   "transformers export (as tools/export_hf.py): the discriminator at DIR "
                   "(ElectraForPreTraining; RobertaPreLayerNormModel + rtd_head.safetensors for "
                   "--layernorm-position pre), the generator at DIR/generator, the tokenizer in both")
    p.add_argument("--pretrained-checkpoint", metavar="PATH", help="start from these weights "
                   "only (optimizer and schedule start fresh), at any TP / PP / DP layout: an "
                   "export directory (tools/export_hf.py, --export-hf), a Hugging Face ELECTRA "
                   "directory (the generator in PATH/generator, or fresh) or an --export .pt "
                   "file; not with --load")
    p.add_argument("--tensorboard-dir", help="default: <save>/tensorboard")
    # Weights & Biases and the step profiler, with Megatron-LM's flags (config.MonitorConfig)
    p.add_argument("--wandb-project", help="also log the TensorBoard scalars and the resolved "
                   "config to this W&B project (needs `pip install 'rtd_scale[wandb]'`; offline: "
                   "WANDB_MODE=offline, then `wandb sync`)")
    p.add_argument("--wandb-exp-name", help="the W&B run's name (default: W&B picks one)")
    p.add_argument("--wandb-entity", help="the W&B team or user (default: W&B's default)")
    p.add_argument("--wandb-save-dir", help="W&B's local files (default: <save>/wandb)")
    p.add_argument("--profile", action="store_true", default=None,
                   help="write a torch.profiler trace of iterations --profile-step-start … "
                        "--profile-step-end − 1 to <tensorboard-dir>/profile (TensorBoard's "
                        "profiler plugin, https://ui.perfetto.dev)")
    p.add_argument("--profile-step-start", type=int, help="first traced iteration (default 10)")
    p.add_argument("--profile-step-end", type=int, help="the iteration after the last traced "
                   "one (default 12)")
    p.add_argument("--profile-ranks", type=int, nargs="+", metavar="RANK",
                   help="global ranks to trace (default 0)")
    p.add_argument("--log-interval", type=int)
    p.add_argument("--timing-log-level", type=int, choices=[0, 1, 2],
                   help="per-phase times in the log line and TensorBoard (timers/*_ms): 0 none "
                        "(default), 1 data wait, forward, backward, optimizer step; 2 also the "
                        "forward's mask, generator forward, sample, discriminator forward "
                        "(CUDA events read at the log interval: no sync per step)")
    p.add_argument("--save-interval", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal, save a checkpoint after the current step and exit 0 "
                        "(for preemption: Slurm's --signal); SIGTERM, SIGINT and the deepspeed "
                        "launcher's exit always do so")
    p.add_argument("--exit-signal", default="SIGTERM",
                   choices=["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"])
    p.add_argument("--max-consecutive-nonfinite-iters", type=int, metavar="N",
                   help="stop with an error after N iterations in a row whose loss or gradient "
                        "norm is inf or NaN (each is skipped and counted); checked at the log "
                        "interval and before a save; 0: never stop (default 5)")
    p.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="with --load: use this run's schedule flags (--lr, --min-lr, "
                        "--lr-warmup-*, --lr-decay-*, --lr-wsd-*) from the first resumed "
                        "iteration when they differ from the checkpoint's")
    p.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="with --load: keep the checkpoint's learning-rate schedule, whatever "
                        "the schedule flags say")
    p.add_argument("--override-data-order", action="store_true", default=None,
                   help="with --load: accept a --seed other than the checkpoint's; the sample "
                        "order, masks and sampling noise follow the new seed from the resumed "
                        "sample on")
    megatron_args.add_model_args(p)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field, e.g. --set model.generator.num_layers=2")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


_FLAG_FIELDS = {
    "data_path": ("data", "data_path"), "tokenizer_model": ("data", "tokenizer_model"),
    "valid_data_path": ("data", "valid_data_path"), "test_data_path": ("data", "test_data_path"),
    "distributed_timeout_minutes": ("parallel", "distributed_timeout_minutes"),
    "seq_length": ("data", "seq_length"), "split": ("data", "split"),
    "data_cache_path": ("data", "data_cache_path"), "num_workers": ("data", "num_workers"),
    "eval_interval": ("train", "eval_interval"), "eval_iters": ("train", "eval_iters"),
    "data_digest": ("train", "data_digest"), "eval_dump_dir": ("train", "eval_dump_dir"),
    "save": ("train", "save"), "load": ("train", "load"), "train_iters": ("train", "train_iters"),
    "micro_batch_size": ("train", "micro_batch_size"),
    "global_batch_size": ("train", "global_batch_size"),
    "tensorboard_dir": ("train", "tensorboard_dir"), "log_interval": ("train", "log_interval"),
    "timing_log_level": ("train", "timing_log_level"),
    "save_interval": ("train", "save_interval"), "seed": ("train", "seed"),
    "ds_config": ("train", "ds_config"), "export": ("train", "export"),
    "export_hf": ("train", "export_hf"), "pretrained_checkpoint": ("train", "pretrained_checkpoint"),
    "tensor_model_parallel_size": ("parallel", "tensor_model_parallel_size"),
    "pipeline_model_parallel_size": ("parallel", "pipeline_model_parallel_size"),
    "sharing": ("model", "sharing"), "sharing_scope": ("model", "sharing_scope"),
    "rtd_lambda": ("rtd", "rtd_lambda"),
    "layernorm_position": ("model", "layernorm_position"),
    "attention_type": ("model", "attention_type"),
    "mask_prob": ("rtd", "mask_prob"), "mask_strategy": ("rtd", "mask_strategy"), "lr": ("optim", "lr"), "min_lr": ("optim", "min_lr"),
    "lr_warmup_iters": ("optim", "lr_warmup_iters"), "lr_decay_iters": ("optim", "lr_decay_iters"), "weight_decay": ("optim", "weight_decay"),
    "clip_grad": ("optim", "clip_grad"),
    **{name: ("optim", name) for name in (
        "lr_decay_style", "lr_warmup_fraction", "lr_warmup_samples", "lr_decay_samples",
        "lr_warmup_init", "lr_wsd_decay_style", "lr_wsd_decay_iters", "lr_wsd_decay_samples")},
    "peak_tflops_per_device": ("train", "peak_tflops_per_device"),
    "max_consecutive_nonfinite_iters": ("train", "max_consecutive_nonfinite_iters"),
    "override_data_order": ("train", "override_data_order"),
    **{name: ("monitor", name) for name in (
        "wandb_project", "wandb_exp_name", "wandb_entity", "wandb_save_dir", "profile",
        "profile_step_start", "profile_step_end", "profile_ranks")},
}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Preset → flags → ``--set`` overrides, validated once at the end.

    Raises:
        ValueError: naming the flag or field and the fix.
    """
    cfg = preset(args.preset)
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
    flag_origins: dict[str, str] = {}  # config field → the flag that set it, for the errors
    for flag, (section, name) in _FLAG_FIELDS.items():
        value = getattr(args, flag)
        if value is not None:
            setattr(getattr(cfg, section), name, value)
            flag_origins[f"{section}.{name}"] = ("--ds_config" if flag == "ds_config"
                                                 else "--" + flag.replace("_", "-"))
    if args.bf16 and args.fp16:
        raise UserInputError("--bf16 and --fp16 contradict each other; pass one of them")
    if args.bf16:
        cfg.train.precision = Precision.BF16
    if args.fp16:
        cfg.train.precision = Precision.FP16
    if args.recompute_activations:
        cfg.model.recompute_activations = True
    if args.compile_layers:
        cfg.model.compile_layers = True
    if args.device_peak:
        if args.peak_tflops_per_device is not None:
            raise UserInputError("--device-peak and --peak-tflops-per-device both give the "
                                 "peak; pass one of them")
        cfg.train.peak_tflops_per_device = DEVICE_PEAK_TFLOPS[args.device_peak]
    if args.override_opt_param_scheduler:
        cfg.optim.override_opt_param_scheduler = True
    if args.use_checkpoint_opt_param_scheduler:
        cfg.optim.use_checkpoint_opt_param_scheduler = True
    origins = {**flag_origins, **megatron_args.apply_model_args(cfg, args)}  # before --set
    for assignment in args.set:
        apply_override(cfg, assignment)
        origins.pop(assignment.split("=", 1)[0].strip(), None)  # --set has the last word
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
        raise ConfigError(megatron_args.name_flags(str(e), origins)) from None
    if not cfg.data.data_path:
        raise UserInputError("--data-path is required: shard prefixes made by tools/preprocess_data.py")
    if not cfg.data.tokenizer_model:
        raise UserInputError("--tokenizer-model is required: the SentencePiece model the shards "
                             "were made with")
    return cfg


@dataclass
class Prepared:
    """What ``prepare`` checked and built, for ``run``.

    ``data``: the training split's ``BlendedDataset`` and, when the run validates, the
    validation split's (``{"train": …, "valid": …}``): the ``--valid-data-path`` corpus when
    given, else --split's validation share of ``--data-path``; and the ``--test-data-path``
    corpus as ``"test"`` when given (with ``--eval-iters`` > 0). ``layout``: this run's
    (world, DP, TP, PP, ZeRO stage), as a checkpoint records it. With ``--load``: ``resume``,
    the checkpoint chosen (``checkpoint.load.take``, once per run), and ``meta``, its metadata;
    both None otherwise.
    """

    tokenizer: Any
    data: dict[str, Any]
    ds_config: dict[str, Any]
    data_parallel_size: int
    gradient_accumulation_steps: int
    layout: dict[str, int]
    resume: Optional[Any] = None  # training/checkpoint/choose.py's Choice
    meta: Optional[dict[str, Any]] = None


def prepare(cfg: RunConfig, world_size: int, print_fn=None) -> Prepared:
    """Every check on user input that needs no process group (``Prepared``'s fields).

    Builds (or loads from its cache) every dataset's sample index; every rank runs this at once,
    and the cache tolerates concurrent identical builds.

    Raises:
        ValueError: naming the file, field or flag and the fix.
    """
    from rtd_scale.data import shards
    from rtd_scale.data.blend import build_split
    from rtd_scale.data.tokenizer import Tokenizer
    from rtd_scale.training import engine, wandb_logger
    from rtd_scale.training.checkpoint import choose, compat, files, load as ckpt_load

    wandb_logger.check_available(cfg.monitor)
    beyond = [r for r in cfg.monitor.profile_ranks if r >= world_size]
    if cfg.monitor.profile and beyond:
        raise UserInputError(f"--profile-ranks {' '.join(map(str, beyond))}: no such rank (the "
                             f"world has ranks 0 … {world_size - 1}); pass global ranks below "
                             f"{world_size}")
    dp, gas = cfg.batch_arithmetic(world_size)
    ds_config = engine.resolve_ds_config(
        engine.load_ds_config(cfg.train.ds_config), cfg, data_parallel_size=dp,
        gradient_accumulation_steps=gas, source=f"--ds_config {cfg.train.ds_config}")
    tok = Tokenizer(cfg.data.tokenizer_model)
    sources = cfg.data.sources()
    held_out = {"valid": cfg.data.valid_sources(), "test": cfg.data.test_sources()}
    unverified = []  # notes on shards without a sidecar: only their id range could be checked
    for flag, blend in (("--data-path", sources), ("--valid-data-path", held_out["valid"]),
                        ("--test-data-path", held_out["test"])):
        for entry in (e for _, entries in blend for e in entries):
            for prefix in shards.resolve_data_path(entry, flag):
                note = shards.check_tokenizer_matches(prefix, cfg.data.tokenizer_model,
                                                      tok.vocab_size)
                if note:
                    unverified.append(note)
    if unverified and launch_env.read().rank == 0:
        more = len(unverified) - 1
        print(unverified[0] + (f" (and {more} more shard(s) without a sidecar)" if more else ""))
    if cfg.model.vocab_size != tok.vocab_size:
        cfg.model.vocab_size = tok.vocab_size  # the tokenizer is the truth
    common = dict(seq_length=cfg.data.seq_length, seed=cfg.train.seed,
                  cache_path=cfg.data.data_cache_path, specials=tok.specials)
    split = dict(sources=sources, split=cfg.data.train_split_weights(), **common)
    dataset = {"train": build_split(part=0, **split)}
    # a held-out corpus is read whole as its split: weights (0, 1, 0) for part 1, (0, 0, 1) for 2
    if cfg.train.evaluates and held_out["valid"]:
        dataset["valid"] = build_split(part=1, sources=held_out["valid"], split=(0, 1, 0),
                                       flag="--valid-data-path", **common)
    elif cfg.train.evaluates and cfg.data.split_weights()[1] > 0:
        dataset["valid"] = build_split(part=1, **split)
    if cfg.train.eval_iters > 0 and held_out["test"]:
        dataset["test"] = build_split(part=2, sources=held_out["test"], split=(0, 0, 1),
                                      flag="--test-data-path", **common)
    zero = ds_config.get("zero_optimization", {}).get("stage", 0)
    if zero not in (0, 1, 2, 3):
        raise UserInputError(f"--ds_config {cfg.train.ds_config}: zero_optimization.stage is "
                             f"{zero!r}; DeepSpeed's stages are 0, 1, 2 and 3")
    layout = {"world_size": world_size, "data_parallel_size": dp,
              "tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size,
              "pipeline_model_parallel_size": cfg.parallel.pipeline_model_parallel_size,
              "zero_stage": zero}
    meta = choice = None
    if cfg.train.load:
        choice = ckpt_load.take(cfg.train.load)  # checkpoint/checks.py's CHECKS, before the build
        meta = compat.check_compatible(choice.load_dir, choice.tag, cfg.to_dict(), layout)
        for line in choice.notes if print_fn else ():
            print_fn(line)
    if cfg.train.export_hf:  # a shape Hugging Face cannot hold fails now, not after training
        from rtd_scale.hf import convert, export as hf_export

        convert.check_exportable(cfg.model)
        hf_export.check_output_dir(cfg.train.export_hf, "--export-hf")
    if cfg.train.pretrained_checkpoint and not os.path.exists(cfg.train.pretrained_checkpoint):
        raise UserInputError(f"--pretrained-checkpoint {cfg.train.pretrained_checkpoint}: no such "
                             "file or directory; pass an export directory, a Hugging Face "
                             "ELECTRA directory or an --export .pt file")
    if cfg.train.save:
        save = cfg.train.save
        if os.path.exists(save) and not os.path.isdir(save):
            raise UserInputError(f"--save {save}: exists and is not a directory; pass a "
                                 "directory for checkpoints and logs")
        previous = files.holds_run(save)
        load_dir = choose.split_load(cfg.train.load)[0] if cfg.train.load else ""
        if previous and os.path.abspath(load_dir) != os.path.abspath(save):
            raise UserInputError(
                f"--save {save}: already holds a run ({previous}); pass --load {save} to "
                "continue it, or choose another --save directory")
    # an explicit --tensorboard-dir is checked before --save is made (a refused run writes
    # nothing); the default, <save>/tensorboard, is writable once --save is
    tb = cfg.train.tensorboard_dir
    if tb and not (cfg.train.save and os.path.abspath(tb) == os.path.abspath(
            os.path.join(cfg.train.save, "tensorboard"))):
        check_writable_dir(tb, "--tensorboard-dir")
    if cfg.train.eval_dump_dir and cfg.dumps_evaluations():  # written at an evaluation
        check_writable_dir(cfg.train.eval_dump_dir, "--eval-dump-dir")
    if cfg.train.save:
        save = cfg.train.save
        try:
            os.makedirs(save, exist_ok=True)
        except OSError as e:
            raise UserInputError(f"--save {save}: cannot create it ({e.strerror}); pass a "
                                 "writable directory") from None
        if not os.access(save, os.W_OK):
            raise UserInputError(f"--save {save}: not writable; pass a writable directory")
    return Prepared(tokenizer=tok, data=dataset, ds_config=ds_config, data_parallel_size=dp,
                    gradient_accumulation_steps=gas, layout=layout, resume=choice, meta=meta)


def convert_for_layout(choice, ctx, meta: dict, layout: dict, print_fn,
                       tokenizer_model: Optional[str] = None) -> tuple[str, bool]:
    """The conversion of ``choice`` (the checkpoint ``--load`` takes), saved at another layout:
    rank 0 writes it (or finds it) beside the checkpoint while the others wait; every rank
    raises the same one-line error when it fails. Returns (its root, whether it is DeepSpeed's
    universal checkpoint rather than rtd_scale's layout-free state; ``training/reshard.py``)."""
    import torch.distributed as dist

    from rtd_scale.training import reshard
    from rtd_scale.training.checkpoint import compat

    universal = reshard.uses_universal(meta["layout"], layout)
    result: list = [None]
    if ctx.rank == 0:
        try:
            if universal:
                root, seconds, fresh = reshard.convert(choice.load_dir, choice.tag)
                reshard.check_converted_safe(root, choice.tag)
            else:
                from rtd_scale.hf.consolidate import consolidate_training_state

                root, seconds, fresh = reshard.convert_canonical(
                    choice.load_dir, choice.tag,
                    lambda run, tag, out: consolidate_training_state(run, tag, out,
                                                                     tokenizer_model))
                reshard.check_canonical_safe(root)
            result = [(root, seconds, fresh, None)]
        except UserInputError as e:
            result = [(None, 0.0, False, str(e))]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    root, seconds, fresh, error = result[0]
    if error is not None:
        raise UserInputError(error)
    if print_fn:
        was = compat.describe_layout(meta["layout"])
        now = compat.describe_layout(layout)
        how = f"in {seconds:.1f} s" if fresh else "reusing the conversion made earlier"
        what = (f"DeepSpeed universal checkpoint {os.path.join(root, choice.tag)}" if universal
                else f"layout-free state {root}")
        print_fn(f"converted {choice.path} from {was} to {now} ({what}) {how}")
    return root, universal


def pretrained_weights(cfg: RunConfig) -> tuple[Optional[str], Optional[str]]:
    """(the --pretrained-checkpoint to read, or None; a note for the log, or None).

    Megatron-LM's rule: a run being resumed (``--load``) continues from its own checkpoint, and
    the pretrained weights only start a run — so a requeued Slurm job may keep both flags.
    """
    path = cfg.train.pretrained_checkpoint
    if path and cfg.train.load:
        return None, (f"note: --load {cfg.train.load} resumes a run, so --pretrained-checkpoint "
                      f"{path} is not read (it only starts a run)")
    return path, None


def run(cfg: RunConfig, print_fn=print, stop=None, validated=None) -> dict:
    """Train; returns a summary dict (on every rank; history only on the logging rank).

    ``validated``: called once every check on user input has passed (``prepare`` and the
    schedule against ``--load``), before the process group starts; ``main`` shows the held
    configuration warnings then."""
    import torch

    from rtd_scale import distributed
    from rtd_scale.model.build import build_model
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.checkpoint import choose, compat, files, load as ckpt_load
    from rtd_scale.training.loop import train
    from rtd_scale.training.metrics import MetricsLogger, TensorBoardLogger
    from rtd_scale.training.profiler import StepProfiler

    launch = launch_env.read()  # the launcher's variables, a Slurm step's, or one process
    prep = prepare(cfg, launch.world_size, print_fn if launch.rank == 0 else None)
    tok, dataset, ds_config, layout, meta = (prep.tokenizer, prep.data, prep.ds_config,
                                             prep.layout, prep.meta)
    dp, gas = prep.data_parallel_size, prep.gradient_accumulation_steps
    if meta is not None and meta["step"] >= cfg.train.train_iters:
        if validated:
            validated()
        if launch.rank == 0:
            print_fn(f"nothing to do: {cfg.train.load} is at iteration {meta['step']}, and "
                     f"--train-iters is {cfg.train.train_iters}; raise --train-iters to continue")
        return {"history": [], "valid_history": [], "checkpoint_dir": None, "interrupted": False,
                "last_step": meta["step"], "tensorboard_dir": cfg.train.tensorboard_dir,
                "start_step": meta["step"]}
    if launch.rank == 0:  # whole words or spans that overflow the MLM slots: one line, at start
        from rtd_scale.objectives.unit_fit import warn_if_units_overflow
        warn_if_units_overflow(cfg.rtd, dataset["train"], tok, seed=cfg.train.seed)
    schedule_note = None
    if meta is not None:  # before anything is built: the schedule flags against the checkpoint's
        schedule_note = engine_mod.resolve_resume_schedule(
            cfg.optim, meta["config"].get("optim", {}), source=cfg.train.load,
            saved_train_iters=meta["config"].get("train", {}).get("train_iters"))
    if validated:
        validated()
    ctx = distributed.initialize(cfg.parallel, seed=cfg.train.seed)
    try:
        model = build_model(cfg, ctx, tok)
        pretrained, note = pretrained_weights(cfg)
        if note and ctx.is_logging_rank:
            print_fn(note)
        if pretrained:  # weights only, before DeepSpeed partitions them
            from rtd_scale.hf.pretrained import load_pretrained

            load_pretrained(model, cfg.train.pretrained_checkpoint, cfg.model, pad_id=tok.pad_id,
                            tp_group=ctx.tp_group, tp_rank=ctx.tp_rank, pp_group=ctx.pp_group,
                            print_fn=print_fn if ctx.is_logging_rank else None)
        distributed.seed_after_build(ctx, cfg.train.seed)
        # a checkpoint saved at another layout: converted first (training/reshard.py), to
        # DeepSpeed's universal checkpoint or to rtd_scale's layout-free state
        universal = canonical = None
        if compat.needs_conversion(meta, layout):
            root, is_universal = convert_for_layout(prep.resume, ctx, meta, layout,
                                                    print_fn if ctx.is_logging_rank else None,
                                                    cfg.data.tokenizer_model)
            if is_universal:
                universal = root
                ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}),
                                                         "load_universal": True}}
            else:
                canonical = root
        eng = engine_mod.build_engine(model, cfg, ds_config, distributed.DeepSpeedMpu())
        start_step = consumed = 0
        resumed_from = None
        if cfg.train.load:
            # the chosen checkpoint; its lr and weight decay set from this run's resolved schedule
            if canonical is not None:
                from rtd_scale.training import reshard

                client = reshard.load_canonical(eng, model, ctx, canonical, prep.resume,
                                                flag=f"--load {cfg.train.load}")
            else:
                client = ckpt_load.load(eng, cfg.train.load, rank=ctx.rank,
                                        universal_root=universal, choice=prep.resume)
            start_step = int(client.get("step", 0))
            if universal is not None or canonical is not None:
                # dropout: a fresh stream per rank (training/reshard.py)
                distributed.seed_after_build(ctx, cfg.train.seed + start_step)
            resumed_from = os.path.join(choose.split_load(cfg.train.load)[0],
                                        files.tag_for(start_step))
            consumed = int(client.get("consumed_samples", start_step * cfg.train.global_batch_size))
            old_batch = (client.get("config") or {}).get("train", {}).get("global_batch_size")
            if old_batch is not None and old_batch != cfg.train.global_batch_size:
                # the schedule continues at the step it reached, not at the samples it read
                eng.lr_scheduler.keep_iterations(old_batch, cfg.optim)
            old_data, new_data = client.get("data"), dataset["train"].state()
            read, consumed, repacked_note = consumed, *dataset["train"].continue_after(
                consumed, old_data)
            if ctx.is_logging_rank:
                print_fn(f"resumed from {cfg.train.load} at iteration {start_step} "
                         f"({read} samples consumed)")
                if old_batch is not None and old_batch != cfg.train.global_batch_size:
                    print_fn(f"note: --global-batch-size {cfg.train.global_batch_size} (the "
                             f"checkpoint's {old_batch}): iterations from {start_step + 1} on "
                             f"read {cfg.train.global_batch_size} samples each; the optimizer "
                             "state, the step count and the schedule carry on")
                if repacked_note:
                    print_fn(repacked_note)
                elif old_data is not None and old_data != new_data:
                    print_fn(f"note: the training data differ from the checkpoint's ({old_data} → "
                             f"{new_data}); the run continues at sample {consumed} of the new "
                             "data's order, not where the old order would have gone")
                old_iters = (client.get("config") or {}).get("train", {}).get("train_iters")
                if old_iters is not None and old_iters != cfg.train.train_iters:
                    if cfg.optim.lr_decay_iters is None and cfg.optim.lr_decay_samples is None:
                        follows = "the learning-rate schedule follows the new value from this " \
                                  "step on"
                    else:  # e.g. phase 2 of a two-phase run: the decay spans the whole run
                        follows = ("the learning-rate schedule keeps its length, "
                                   + (f"--lr-decay-iters {cfg.optim.lr_decay_iters}"
                                      if cfg.optim.lr_decay_iters is not None else
                                      f"--lr-decay-samples {cfg.optim.lr_decay_samples}"))
                    print_fn(f"note: --train-iters changed from {old_iters} to "
                             f"{cfg.train.train_iters}; {follows}")
                if schedule_note:
                    print_fn(schedule_note)
                saved_seed = (client.get("config") or {}).get("train", {}).get("seed")
                if saved_seed is not None and saved_seed != cfg.train.seed:  # allowed: prepare
                    print_fn(compat.data_order_note(saved_seed, cfg.train.seed, consumed,
                                                        dataset["train"]))
                print_fn(f"learning rate of iteration {start_step + 1}: {eng.get_lr()[0]!r}")
        if ctx.is_logging_rank and cfg.train.save:
            write_atomic(os.path.join(cfg.train.save, "config.json"), cfg.to_json() + "\n")
            write_atomic(os.path.join(cfg.train.save, "ds_config.json"),
                         json.dumps(ds_config, indent=2, sort_keys=True) + "\n")
        if ctx.is_logging_rank:
            n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                           for p in {id(p): p for p in model.parameters()}.values())
            print_fn(f"rtd_scale: preset {cfg.preset}, sharing {cfg.model.sharing.value}, "
                     f"{cfg.model.attention_type.value} attention, "
                     f"{cfg.model.layernorm_position.value}-LN layers, "
                     f"{n_params / 1e6:.2f}M parameters on this rank's model-parallel shard, vocab "
                     f"{cfg.model.vocab_size} (padded {model.padded_vocab_size}), world "
                     f"{ctx.world_size} = TP {ctx.tp_size} × PP {ctx.pp_size} × DP {ctx.dp_size}, micro-batch "
                     f"{cfg.train.micro_batch_size} × accumulation {gas} × DP {dp} = global "
                     f"{cfg.train.global_batch_size}, ZeRO stage "
                     f"{ds_config.get('zero_optimization', {}).get('stage', 0)}, "
                     f"{cfg.train.precision.value}, packed samples of {cfg.data.seq_length} "
                     f"tokens, {cfg.data.num_workers} loader workers")
            for split in dataset.values():
                print_fn(f"  data {split.describe()}")
        # a crashed run's events after its last checkpoint are hidden: one value per step
        tb = MetricsLogger(TensorBoardLogger(
            cfg.train.tensorboard_dir if ctx.is_logging_rank else None, purge_step=start_step + 1))
        profiler = None
        try:
            if ctx.is_logging_rank and cfg.monitor.uses_wandb:  # the same scalars as TensorBoard
                from rtd_scale.training.wandb_logger import WandbLogger

                ds_resolved = eng.config if isinstance(getattr(eng, "config", None), dict) else \
                    ds_config
                tb.sinks.append(WandbLogger(
                    cfg.monitor, config={**cfg.to_dict(), "ds_config": ds_resolved},
                    save=cfg.train.save,
                    resume_dir=choose.split_load(cfg.train.load)[0] if cfg.train.load
                    else None))
            profiler = StepProfiler(cfg.monitor, rank=ctx.rank, device=ctx.device,
                                    tensorboard_dir=cfg.train.tensorboard_dir,
                                    first_step=start_step + 1, print_fn=print_fn)
            result = train(cfg, ctx, eng, dataset, start_step=start_step,
                           consumed_samples=consumed, tb=tb, print_fn=print_fn,
                           stop=stop, layout=layout, resumed_from=resumed_from,
                           profiler=profiler)
        finally:
            if profiler is not None:
                profiler.close()
            tb.close()
        if cfg.train.export and not result.interrupted:
            export_consolidated(eng, model, cfg, ctx, cfg.train.export)
            if ctx.is_logging_rank:
                print_fn(f"exported consolidated weights to {cfg.train.export}")
        if cfg.train.export_hf and not result.interrupted:
            from rtd_scale.hf.consolidate import gather_full_state
            from rtd_scale.hf.export import write_export

            state = gather_full_state(eng, model, ctx, cfg.model.vocab_size)
            if ctx.rank == 0:  # every rank holds the state; transformers saves on rank 0 only
                write_export(state, cfg.model, cfg.train.export_hf, pad_id=tok.pad_id,
                             cls_id=tok.cls_id, sep_id=tok.sep_id,
                             tokenizer_model=cfg.data.tokenizer_model, flag="--export-hf",
                             note=print_fn)
                print_fn(f"exported to Hugging Face: {cfg.train.export_hf} (discriminator), "
                         f"{cfg.train.export_hf}/generator")
            del state
            torch.distributed.barrier()
        summary = {"history": result.history, "valid_history": result.valid_history,
                   "test": result.test,
                   "checkpoint_dir": result.checkpoint_dir,
                   "interrupted": result.interrupted, "last_step": result.last_step,
                   "tensorboard_dir": cfg.train.tensorboard_dir, "start_step": start_step,
                   "export_hint": export_hint(cfg)}
        if ctx.is_logging_rank and result.history:
            print_fn(summary_text(summary))
            if cfg.train.save:  # draws --save/curves.png; a failure warns, never fails the run
                from rtd_scale.training.curves import write_after_run

                print_fn(write_after_run(cfg.train.save, cfg.train.tensorboard_dir,
                                         result.valid_history))
        torch.distributed.barrier()
        return summary
    finally:
        distributed.teardown()


def export_consolidated(engine, model, cfg: RunConfig, ctx, path: str) -> None:
    """Gather ZeRO-3 partitions and TP shards; the logging rank writes {"config", "model"}
    atomically. Collective: every rank must call it."""
    import torch

    from rtd_scale.hf.consolidate import gather_full_state

    state = gather_full_state(engine, model, ctx, cfg.model.vocab_size)
    if ctx.is_logging_rank:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"config": cfg.to_dict(), "model": state}, tmp)
        os.replace(tmp, path)
    torch.distributed.barrier()


def export_hint(cfg: RunConfig) -> Optional[str]:
    """The summary's line that exports this run to Hugging Face, and what the export loads as
    (``rtd_scale.hf.adapters.adapter_for``); None without ``--save``."""
    from rtd_scale.hf.adapters import adapter_for
    from rtd_scale.hf.common import RTD_HEAD_FILE

    if not cfg.train.save:
        return None
    out = os.path.join("hf", os.path.basename(os.path.normpath(cfg.train.save)))
    adapter = adapter_for(cfg.model)
    disc = adapter.discriminator_class
    head = ("RTD head included" if adapter.rtd_head_in_model
            else f"its RTD head in {out}/{RTD_HEAD_FILE}")
    return (f"python tools/export_hf.py --load {cfg.train.save} --output {out}   "
            f"(loads as {disc}, {head}; the generator in {out}/generator)")


def summary_text(summary: dict) -> str:
    """Human summary: first and last logged losses, arXiv 2111.09543 Table 1's average
    embedding cosines, the held-out RTD AUC and a verdict on it, where the logs and checkpoint
    are.

    The verdict reads the AUC at the last validation (``valid/rtd/auc``) in units of its chance
    standard deviation σ (``diagnostics.auc_chance_sd`` for that validation's class sizes):
    more than 3σ above 0.5 and more than 3σ above the first validation's (or only one
    validation): learning; more than 3σ above 0.5 but not rising: above chance, on a plateau;
    within 3σ of 0.5: on the prior plateau (a discriminator that knows only the replaced
    fraction); more than 3σ below: below chance (a fault)."""
    import math

    from rtd_scale.training.diagnostics import (AVG_COSINE_DISCRIMINATOR, AVG_COSINE_GENERATOR,
                                                VALID_AUC, VALID_AUC_CHANCE_SD, prior_bce)

    hist = summary["history"]
    (s0, first), (s1, last) = hist[0], hist[-1]
    p = last["rtd/replaced_fraction"]
    prior = prior_bce(p)
    lines = [
        "",
        "RTD pretraining summary",
        f"  L_MLM  first {first['loss/mlm']:.4f} (iteration {s0})  →  last {last['loss/mlm']:.4f}"
        f" (iteration {s1})",
        f"  L_RTD  first {first['loss/rtd']:.4f} (iteration {s0})  →  last {last['loss/rtd']:.4f}"
        f" (iteration {s1}); knowing only the replaced fraction {p:.3f} gives {prior:.4f}",
        f"  MLM accuracy {first['mlm/accuracy']:.3f} → {last['mlm/accuracy']:.3f}; discriminator "
        f"accuracy on replaced {last['rtd/accuracy_replaced']:.3f}, on original "
        f"{last['rtd/accuracy_original']:.3f} (at logit 0)",
    ]
    if AVG_COSINE_GENERATOR in last:
        lines.append(f"  average cosine within each token table (arXiv 2111.09543 Table 1): "
                     f"generator {last[AVG_COSINE_GENERATOR]:.3f}, discriminator "
                     f"{last[AVG_COSINE_DISCRIMINATOR]:.3f}")
    valid = list(summary.get("valid_history") or [])
    if valid:
        (v0, a), (v1, b) = valid[0], valid[-1]
        lines.append(f"  validation L_MLM {a['valid/loss/mlm']:.4f} (iteration {v0}) → "
                     f"{b['valid/loss/mlm']:.4f} (iteration {v1}), L_RTD "
                     f"{a['valid/loss/rtd']:.4f} → {b['valid/loss/rtd']:.4f}")
    auc = [(k, v[VALID_AUC]) for k, v in valid if not math.isnan(v.get(VALID_AUC, math.nan))]
    if not auc:
        lines.append("  verdict: no held-out RTD AUC (no validation ran; set --eval-interval "
                     "and --eval-iters above 0 with a validation share in --split or a "
                     "--valid-data-path)")
    else:
        (a0, auc0), (a1, auc1) = auc[0], auc[-1]
        sd = dict(valid)[a1].get(VALID_AUC_CHANCE_SD, math.nan)
        z = (auc1 - 0.5) / sd if sd > 0 else math.nan
        trend = (f"; {auc0:.4f} at iteration {a0}, {auc1 - auc0:+.4f} since" if a0 != a1
                 else "")
        lines.append(f"  held-out RTD AUC {auc1:.4f} at iteration {a1} (0.5 = chance, "
                     f"± {sd:.4f} for these token counts{trend})")
        rising = a0 == a1 or auc1 - auc0 > 3 * sd
        if z > 3 and rising:
            verdict = ("learning: the discriminator ranks replaced tokens above original ones "
                       f"({z:.1f} chance standard deviations above 0.5); early in a run, while "
                       "L_MLM is near ln V, the generator samples rare tokens and the token "
                       "alone can give them away, so read this as use of context only once "
                       "L_MLM has fallen well below ln V")
        elif z > 3:
            verdict = (f"above chance ({z:.1f} chance standard deviations above 0.5) but not "
                       f"rising since iteration {a0}: the discriminator tells some replaced tokens "
                       "apart (early on, often by the token alone) and is on a plateau; "
                       "train longer (see the README, "
                       "\"What 300 CPU steps can and cannot show\")")
        elif z < -3:
            verdict = ("below chance: the discriminator ranks replaced tokens below original "
                       "ones, which training should never do; check the data and the labels")
        else:
            verdict = ("on the prior plateau: the discriminator does not yet tell replaced "
                       "tokens from original ones (AUC within 3 chance standard deviations of "
                       "0.5); train longer (see the README, \"What 300 CPU steps can and "
                       "cannot show\")")
        lines.append(f"  verdict: {verdict}")
    test = summary.get("test")
    if test:
        lines.append(f"  test (--test-data-path) L_MLM {test['test/loss/mlm']:.4f}, L_RTD "
                     f"{test['test/loss/rtd']:.4f}, RTD AUC "
                     f"{test.get('test/rtd/auc', math.nan):.4f}")
    if summary.get("tensorboard_dir"):
        lines.append(f"  TensorBoard: tensorboard --logdir {summary['tensorboard_dir']}")
    if summary.get("checkpoint_dir"):
        lines.append(f"  checkpoint:  {summary['checkpoint_dir']}")
    if summary.get("export_hint"):
        lines.append(f"  export:      {summary['export_hint']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    # library noise that says nothing about the run
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="megatron")
    import signal

    from rtd_scale.training.signals import DEFAULT_SIGNALS, StopRequest

    rank = 0
    try:
        rank = launch_env.read().rank
        # every rank parses the same flags: a flag error is rank 0's one line, the other ranks
        # exit with the same status silently
        # (tests/e2e/test_pretrain_errors.py::test_launcher_prints_a_flag_error_once)
        args = build_parser(quiet=rank != 0).parse_args(argv)
        # entered first: a signal during start-up or load counts too (training/signals.py)
        signums = [*DEFAULT_SIGNALS, *([getattr(signal, args.exit_signal)]
                                       if args.exit_signal_handler else [])]
        if rank != 0:  # every rank would repeat the same configuration warnings
            warnings.simplefilter("ignore", UserWarning)
        # config warnings wait until the whole run is validated: a refused run prints only its
        # error line (tests/e2e/test_pretrain_errors.py::test_refused_run_prints_no_config_warning)
        with HeldWarnings() as held, StopRequest(signums) as stop:
            cfg = config_from_args(args)
            run(cfg, stop=stop, validated=held.release)
    except (UserInputError, OSError) as e:  # user errors; bugs keep their traceback
        if os.environ.get("RTD_SCALE_TRACEBACK") == "1":
            raise
        if rank == 0 or getattr(e, "every_rank", False):  # a file only that rank reads
            print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    one_line_warnings()  # as a program only: a caller of main() keeps its own warning display
    sys.exit(main())
