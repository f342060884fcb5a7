"""Entry-point flags: no abbreviations, --distributed-timeout-minutes reaching both process-group
layers, and the held-out corpora's blend syntax (--valid-data-path, --test-data-path)."""
from __future__ import annotations

import datetime
import importlib

import pytest

from rtd_scale import arguments, pretrain
from rtd_scale.cli_errors import OneLineArgumentParser
from rtd_scale.config import ConfigError, DataConfig, ParallelConfig
from tests.helpers.env import REPO

BASE = ["--ds_config", "ds_configs/zero3.json", "--data-path", "D", "--tokenizer-model", "t.model"]


def test_pretrain_refuses_an_abbreviated_flag(capsys):
    with pytest.raises(SystemExit) as e:
        arguments.build_parser().parse_args([*BASE, "--train-iter", "2"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: unrecognized arguments: --train-iter 2 (did you mean --train-iters?); "
        "rtd_scale/pretrain.py --help lists every flag\n")
    assert arguments.build_parser().parse_args([*BASE, "--train-iters", "2"]).train_iters == 2


def test_pretrain_flag_error_prints_on_rank_0_only(capsys, monkeypatch):
    """Every rank of a launch parses the same flags; only rank 0 prints the error, and the
    others exit with the same status (2, argparse's) silently."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            pretrain.main([*BASE, "--train-it", "5"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err == ("error: unrecognized arguments: --train-it 5 (did you mean "
                       "--train-iters?); rtd_scale/pretrain.py --help lists every flag\n"
                       if printed else ""), (rank, err)
    with pytest.raises(SystemExit) as e:  # --help too: rank 1 prints nothing, exits 0
        arguments.build_parser(quiet=True).parse_args(["--help"])
    assert e.value.code == 0 and capsys.readouterr() == ("", "")


def test_preset_help_and_choices_list_every_preset(capsys, monkeypatch):
    """--preset's help and choices come from presets.PRESETS, whole names even where the help
    wraps (at 60 columns debertav3-tiny would otherwise break at its hyphen)."""
    from rtd_scale.presets import PRESETS

    monkeypatch.setenv("COLUMNS", "60")
    with pytest.raises(SystemExit):
        arguments.build_parser().parse_args(["--help"])
    words = capsys.readouterr().out.replace(",", " ").split()
    assert "debertav3-tiny" in PRESETS
    for name in PRESETS:
        assert name in words, name
    for name in PRESETS:
        assert arguments.build_parser().parse_args([*BASE, "--preset", name]).preset == name
    with pytest.raises(SystemExit) as e:
        arguments.build_parser().parse_args([*BASE, "--preset", "debertav3-huge"])
    assert e.value.code == 2
    assert "invalid choice: 'debertav3-huge' (choose from 'tiny', 'debertav3-tiny'," in \
        capsys.readouterr().err


@pytest.mark.parametrize("tool, argv, flag", [
    ("preprocess_data", ["--input", "x.jsonl", "--tokenizer-model", "t.model",
                         "--output-prefix", "o", "--worker", "2"], "--workers"),
    ("train_tokenizer", ["--input", "x.jsonl", "--output-prefix", "o", "--vocab-siz", "600"],
     "--vocab-size"),
])
def test_tools_refuse_abbreviated_flags(tool, argv, flag, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    module = importlib.import_module(tool)
    with pytest.raises(SystemExit) as e:
        module.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: unrecognized arguments: {argv[-2]} "
                                                f"{argv[-1]} (did you mean {flag}?)"), err


def test_one_line_parser_has_no_abbreviations_unless_asked():
    p = OneLineArgumentParser(prog="x")
    p.add_argument("--train-iters", type=int)
    assert p.parse_known_args(["--train-iter", "2"])[1] == ["--train-iter", "2"]
    q = OneLineArgumentParser(prog="x", allow_abbrev=True)
    q.add_argument("--train-iters", type=int)
    assert q.parse_args(["--train-iter", "2"]).train_iters == 2


def test_distributed_timeout_minutes_flag():
    assert ParallelConfig().distributed_timeout_minutes == 10  # Megatron-LM's default
    args = arguments.build_parser().parse_args([*BASE, "--distributed-timeout-minutes", "3"])
    assert arguments.config_from_args(args).parallel.distributed_timeout_minutes == 3
    args = arguments.build_parser().parse_args([*BASE, "--distributed-timeout-minutes", "0"])
    with pytest.raises(ConfigError, match=r"--distributed-timeout-minutes "
                                          r"\(parallel.distributed_timeout_minutes\) must be > 0"):
        arguments.config_from_args(args)


class _Stop(Exception):
    pass


def test_distributed_timeout_reaches_torch_and_megatron(monkeypatch):
    """distributed.initialize hands the timeout to DeepSpeed's init_distributed (the default
    process group) and to megatron-core's initialize_model_parallel (its groups)."""
    import deepspeed
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rtd_scale import distributed

    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29999").items():
        monkeypatch.setenv(name, value)
    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 1)
    monkeypatch.setattr(deepspeed, "init_distributed",
                        lambda **kw: seen.__setitem__("torch", kw["timeout"]))

    def megatron(**kw):
        seen["megatron"] = kw["distributed_timeout_minutes"]
        raise _Stop

    monkeypatch.setattr(ps, "initialize_model_parallel", megatron)
    with pytest.raises(_Stop):
        distributed.initialize(ParallelConfig(distributed_timeout_minutes=3), seed=1)
    assert seen == {"torch": datetime.timedelta(minutes=3), "megatron": 3}
    with pytest.raises(_Stop):
        distributed.initialize(ParallelConfig(), seed=1)
    assert seen == {"torch": datetime.timedelta(minutes=10), "megatron": 10}


def test_held_out_corpora_take_the_blend_syntax():
    args = arguments.build_parser().parse_args(
        [*BASE, "--valid-data-path", "3", "V1", "1", "V2", "--test-data-path", "T"])
    data = arguments.config_from_args(args).data
    assert data.valid_sources() == [(0.75, ["V1"]), (0.25, ["V2"])]
    assert data.test_sources() == [(1.0, ["T"])]
    # their shares of --split go back to training: the held-out text is elsewhere
    assert data.train_split_weights() == (969.0, 0.0, 0.0)
    assert DataConfig(data_path=["D"], valid_data_path=["V"]).train_split_weights() == (
        969.0, 0.0, 1.0)
    assert DataConfig(data_path=["D"]).train_split_weights() == (969.0, 30.0, 1.0)
    with pytest.raises(ConfigError, match=r"^--valid-data-path 0.5 V W: expected either prefixes "
                                          r"only, or positive WEIGHT PREFIX pairs \(e.g. "
                                          r"--valid-data-path 0.7 A 0.3 B\)$"):
        arguments.config_from_args(arguments.build_parser().parse_args(
            [*BASE, "--valid-data-path", "0.5", "V", "W"]))


def test_train_data_path_is_data_path():
    args = arguments.build_parser().parse_args(
        ["--ds_config", "x.json", "--tokenizer-model", "t.model", "--train-data-path", "0.6", "A",
         "0.4", "B"])
    assert arguments.config_from_args(args).data.sources() == [(0.6, ["A"]), (0.4, ["B"])]
    args = arguments.build_parser().parse_args([*BASE, "--train-data-path", "E"])
    with pytest.raises(ValueError, match="--data-path and --train-data-path name two training "
                                         "corpora; pass one of them"):
        arguments.config_from_args(args)


# Every flag of pretrain.py, group by group as --help shows them (hidden ones aside: the
# launcher's --local_rank and the refused Megatron-LM flags). Frozen, as torchtitan freezes its
# CLI: a new knob is a config field, reached with --set SECTION.FIELD=VALUE or a --config file.
FROZEN_FLAGS = (
    # the run
    "--config", "--ds_config", "--preset", "--set",
    # data
    "--data-path", "--train-data-path", "--valid-data-path", "--test-data-path", "--split",
    "--data-cache-path", "--num-workers", "--reset-attention-mask", "--tokenizer-model",
    "--seq-length",
    # training
    "--train-iters", "--micro-batch-size", "--global-batch-size", "--seed", "--bf16", "--fp16",
    "--recompute-activations", "--compile-layers", "--eval-interval", "--eval-iters",
    # parallelism
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
    "--distributed-timeout-minutes",
    # the objective, attention and embedding sharing
    "--sharing", "--sharing-scope", "--layernorm-position", "--attention-type", "--rtd-lambda",
    "--mask-prob", "--mask-strategy",
    # AdamW and the learning-rate schedule
    "--lr", "--min-lr", "--lr-warmup-iters", "--lr-decay-iters", "--lr-decay-style",
    "--lr-warmup-fraction", "--lr-warmup-samples", "--lr-decay-samples", "--lr-warmup-init",
    "--lr-wsd-decay-style", "--lr-wsd-decay-iters", "--lr-wsd-decay-samples", "--weight-decay",
    "--clip-grad", "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler",
    # checkpoints, resume and exports
    "--save", "--load", "--ckpt-step", "--save-interval", "--override-data-order",
    "--exit-signal-handler", "--exit-signal", "--export", "--export-hf", "--pretrained-checkpoint",
    # logging, monitoring and profiling
    "--log-interval", "--timing-log-level", "--tensorboard-dir", "--wandb-project",
    "--wandb-exp-name", "--wandb-entity", "--wandb-save-dir", "--profile", "--profile-step-start",
    "--profile-step-end", "--profile-ranks", "--peak-tflops-per-device", "--device-peak",
    "--log-throughput", "--data-digest", "--eval-dump-dir",
    # fault tolerance
    "--max-consecutive-nonfinite-iters", "--ft-rank-section-timeouts", "--straggler-threshold",
    "--loss-spike-policy", "--loss-spike-window-iters", "--loss-spike-threshold",
    "--max-loss-spike-rollbacks",
    # Megatron-LM's model flags and their --generator- twins (megatron_args.py)
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size",
    "--hidden-dropout", "--attention-dropout", "--layernorm-epsilon", "--embedding-size",
    "--max-position-embeddings", "--init-method-std", "--make-vocab-size-divisible-by",
    "--rotary-base", "--local-rotary-base", "--global-attn-every-n-layers", "--normalization",
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--generator-num-layers",
    "--generator-hidden-size", "--generator-num-attention-heads", "--generator-ffn-hidden-size",
    "--generator-hidden-dropout", "--generator-attention-dropout", "--generator-layernorm-epsilon",
    "--generator-num-layers-ratio", "--generator-hidden-size-ratio", "--position-embedding-type",
    "--use-rotary-position-embeddings", "--swiglu", "--disable-bias-linear", "--window-size",
    "--deepspeed", "--vocab-file",
    "--tokenizer-type", "--bert-no-binary-head",
)


def _visible_flags() -> list[str]:
    import argparse

    return [a.option_strings[0] for a in arguments.build_parser()._actions
            if a.option_strings and a.help is not argparse.SUPPRESS and a.dest != "help"]


def test_the_flag_list_is_frozen():
    """The CLI is frozen: a flag added or removed fails here. A new knob is a config field
    (rtd_scale/config.py), set with --set SECTION.FIELD=VALUE or in a --config file; a flag is
    added only where Megatron-LM has one, and then to FROZEN_FLAGS too."""
    flags = _visible_flags()
    added = [f for f in flags if f not in FROZEN_FLAGS]
    removed = [f for f in FROZEN_FLAGS if f not in flags]
    assert not added and not removed, (
        f"pretrain.py's flags changed (added: {added}, removed: {removed}). New knobs go "
        "through --set SECTION.FIELD=VALUE or the --config file, not a new flag: add a field "
        "to rtd_scale/config.py instead. Only a flag with a Megatron-LM name may be added, and "
        "then to FROZEN_FLAGS in tests/unit/test_cli_flags.py as well")
    assert flags == list(FROZEN_FLAGS)  # and in --help's order of groups


def test_the_flag_table_names_real_flags_and_fields():
    """arguments.FLAG_FIELDS, the one table of flags and fields: each flag exists and each
    field is a field of the tree (what --set and a --config file reach)."""
    import dataclasses

    from rtd_scale.presets import preset

    cfg = preset("tiny")
    tables = {**arguments.FLAG_FIELDS, **arguments.DERIVED_FLAG_FIELDS}
    assert set(tables) <= set(FROZEN_FLAGS)
    for flag, path in tables.items():
        *sections, name = path.split(".")
        obj = cfg
        for s in sections:
            obj = getattr(obj, s)
        assert name in {f.name for f in dataclasses.fields(obj)}, (flag, path)


def test_a_quiet_rank_waits_for_rank_0s_line_before_it_exits_on_a_flag_error(monkeypatch):
    """A rank other than 0 prints nothing for a flag error and waits before exiting, so that a
    launcher that stops every rank at the first failure cannot kill rank 0 before its line is
    out (seen under load: the launch showed no error at all); --help and rank 0 do not wait."""
    from rtd_scale import cli_errors

    waits = []
    monkeypatch.setattr(cli_errors, "wait_for_rank0_line", lambda: waits.append(1))
    with pytest.raises(SystemExit) as e:
        arguments.build_parser(quiet=True).parse_args(["--train-it", "5"])
    assert e.value.code == 2 and waits == [1]
    with pytest.raises(SystemExit) as e:
        arguments.build_parser(quiet=False).parse_args(["--train-it", "5"])
    assert e.value.code == 2 and waits == [1]
    with pytest.raises(SystemExit) as e:
        arguments.build_parser(quiet=True).parse_args(["--help"])
    assert e.value.code == 0 and waits == [1]
    assert cli_errors.QUIET_EXIT_GRACE_S == 30.0
