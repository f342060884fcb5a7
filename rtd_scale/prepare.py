"""Every check on user input that needs no process group, run by every rank before
``distributed.initialize``: the W&B and profiler flags, the batch arithmetic against the
ds_config, the tokenizer against every shard, the sample indices, the checkpoint ``--load``
takes (chosen here, once per run) against this run's config, layout and data, the exports'
shapes and directories, and the output paths. A refused run writes nothing."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

from rtd_scale import launch_env
from rtd_scale.batch import batch_arithmetic
from rtd_scale.cli_errors import UserInputError, check_writable_dir
from rtd_scale.config import RunConfig


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
    resume: Optional[Any] = None  # training/checkpoint.py's Choice
    meta: Optional[dict[str, Any]] = None


def _within(path: str, directory: str) -> bool:
    """Whether ``path`` is ``directory`` or lies inside it (symbolic links resolved)."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


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
    from rtd_scale.training import wandb_logger
    from rtd_scale.training.checkpoint import choose, compat, files, load as ckpt_load
    from rtd_scale.training.ds_config import load_ds_config, resolve_ds_config

    wandb_logger.check_available(cfg.monitor)
    beyond = [r for r in cfg.monitor.profile_ranks if r >= world_size]
    if cfg.monitor.profile and beyond:
        raise UserInputError(f"--profile-ranks {' '.join(map(str, beyond))}: no such rank (the "
                             f"world has ranks 0 … {world_size - 1}); pass global ranks below "
                             f"{world_size}")
    dp, gas = batch_arithmetic(cfg, world_size)
    ds_config = resolve_ds_config(
        load_ds_config(cfg.train.ds_config), cfg, data_parallel_size=dp,
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
    if cfg.model.vocab_size != tok.vocab_size:  # the tokenizer is the truth: the section anew
        cfg.model = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
        cfg.model.validate()
    common = dict(seq_length=cfg.data.seq_length, seed=cfg.train.seed,
                  cache_path=cfg.data.data_cache_path, specials=tok.specials,
                  document_ids=cfg.data.document_masking)
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
    if cfg.train.save or cfg.train.load:
        dataset["train"].state()  # the shards' hashes a checkpoint records: now, not at a save

    meta = choice = None
    if cfg.train.load:
        choice = ckpt_load.take(cfg.train.load)  # checkpoint/checks.py's CHECKS, before the build
        meta = compat.check_compatible(choice.load_dir, choice.tag, cfg, layout)
        notes = list(choice.notes)
        if meta is not None:
            unchecked = compat.check_same_data(
                choice.load_dir, choice.tag, meta.get("data"), dataset["train"],
                override=bool(cfg.train.override_data_order),
                consumed=int(meta.get("consumed_samples") or 0))
            notes += [unchecked] if unchecked else []
        for line in notes if print_fn else ():
            print_fn(line)
    if cfg.train.export_hf:  # a shape Hugging Face cannot hold fails now, not after training
        from rtd_scale.hf import convert, export as hf_export

        convert.check_exportable(cfg.trained_model())
        hf_export.check_output_dir(cfg.train.export_hf, "--export-hf")
        if cfg.train.save and _within(cfg.train.save, cfg.train.export_hf):
            raise UserInputError(f"--export-hf {cfg.train.export_hf}: holds --save "
                                 f"{cfg.train.save}, whose checkpoints the export would replace; "
                                 "pass another directory, e.g. hf/"
                                 + os.path.basename(os.path.normpath(cfg.train.save)))
    if cfg.train.pretrained_checkpoint and not os.path.exists(cfg.train.pretrained_checkpoint):
        from rtd_scale.hf.adapters import import_sources

        raise UserInputError(f"--pretrained-checkpoint {cfg.train.pretrained_checkpoint}: no such "
                             f"file or directory; pass {import_sources()}")
    if cfg.train.pretrained_checkpoint and not cfg.train.load:  # its type and layout, now
        from rtd_scale.config import Objective
        from rtd_scale.hf.pretrained import check_directory

        check_directory(cfg.train.pretrained_checkpoint, cfg.trained_model(),
                        masked_lm=cfg.rtd.objective is Objective.MLM)
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
