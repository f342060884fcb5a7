"""Megatron-LM's model and optimizer flags (rtd_scale/megatron_args.py): a Megatron-style command
line builds the same config as the preset plus ``--set``; generator twins and ratios; precedence;
the refused flags."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from rtd_scale.config import ConfigError, apply_override
from rtd_scale.presets import PRESETS, preset
from rtd_scale.megatron_args import REFUSED
from rtd_scale.arguments import build_parser, config_from_args
from rtd_scale.pretrain import main
from rtd_scale.cli_errors import EXIT_USER_ERROR

BASE = ["--ds_config", "ds_configs/zero0.json", "--data-path", "data/x_text_document",
        "--tokenizer-model", "spm.model"]


def from_flags(*argv: str):
    return config_from_args(build_parser().parse_args([*BASE, *argv]))


def from_sets(name: str, *assignments: str):
    cfg = preset(name)
    cfg.data.data_path, cfg.data.tokenizer_model = ["data/x_text_document"], "spm.model"
    cfg.train.ds_config = "ds_configs/zero0.json"
    for a in assignments:
        apply_override(cfg, a)
    cfg.validate()
    return cfg


def test_megatron_command_line_builds_the_preset_plus_set_config():
    megatron = from_flags(
        "--preset", "electra-base", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "2", "--max-position-embeddings", "128", "--seq-length", "128",
        "--hidden-dropout", "0.05", "--attention-dropout", "0", "--init-method-std", "0.01",
        "--make-vocab-size-divisible-by", "64", "--layernorm-epsilon", "1e-5",
        "--adam-beta1", "0.85", "--adam-beta2", "0.99", "--adam-eps", "1e-8",
        "--generator-hidden-size-ratio", "0.25")
    expected = from_sets(
        "electra-base",
        "model.discriminator.num_layers=2", "model.discriminator.hidden_size=64",
        "model.discriminator.num_attention_heads=2",
        "model.discriminator.ffn_hidden_size=256",  # Megatron: 4 × --hidden-size
        "model.discriminator.hidden_dropout=0.05", "model.discriminator.attention_dropout=0",
        "model.discriminator.layernorm_epsilon=1e-5",
        "model.embedding_size=64",  # Megatron: the embedding width is the hidden size
        # ELECTRA's generator rule: depth × 1 (the preset's), width × 0.25, head size kept
        # (64 / 2 = 32, so 16 // 32 → at least one head), FFN 4 × width, dropout and eps copied
        "model.generator.num_layers=2", "model.generator.hidden_size=16",
        "model.generator.num_attention_heads=1", "model.generator.ffn_hidden_size=64",
        "model.generator.hidden_dropout=0.05", "model.generator.attention_dropout=0",
        "model.generator.layernorm_epsilon=1e-5",
        "model.max_position_embeddings=128", "data.seq_length=128",
        "model.init_method_std=0.01", "model.make_vocab_size_divisible_by=64",
        "optim.adam_beta1=0.85", "optim.adam_beta2=0.99", "optim.adam_eps=1e-8")
    assert megatron.to_dict() == expected.to_dict()
    assert megatron.model.generator.hidden_size == 16


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_without_model_flags_every_preset_is_unchanged(name):
    assert from_flags("--preset", name).to_dict() == from_sets(name).to_dict()


def test_debertav3_style_generator_keeps_the_presets_depth_ratio_and_head_size():
    cfg = from_flags("--preset", "tiny", "--num-layers", "6", "--hidden-size", "64",
                     "--num-attention-heads", "4")
    d, g = cfg.model.discriminator, cfg.model.generator
    assert (d.num_layers, d.hidden_size, d.num_attention_heads, d.ffn_hidden_size) == (6, 64, 4, 256)
    # tiny's generator: half depth, same width; heads keep the discriminator's head size 16
    assert (g.num_layers, g.hidden_size, g.num_attention_heads, g.ffn_hidden_size) == (3, 64, 4, 256)
    assert cfg.model.embedding_size == 64


def test_depth_only_leaves_the_generator_width_alone():
    cfg = from_flags("--preset", "electra-small", "--num-layers", "6")
    g = cfg.model.generator
    assert (g.num_layers, g.hidden_size, g.num_attention_heads, g.ffn_hidden_size) == (6, 64, 1, 256)
    assert cfg.model.embedding_size == 128  # no --hidden-size: the preset's factorised width


def test_generator_twins_set_the_field_outright():
    cfg = from_flags("--preset", "tiny", "--generator-num-layers", "1",
                     "--generator-hidden-size", "48", "--generator-ffn-hidden-size", "100",
                     "--generator-hidden-dropout", "0.2", "--generator-layernorm-epsilon", "1e-6")
    g, d = cfg.model.generator, cfg.model.discriminator
    # heads: 48 // tiny's head size 48 = 1; FFN as given, not 4 × 48
    assert (g.num_layers, g.hidden_size, g.num_attention_heads, g.ffn_hidden_size) == (1, 48, 1, 100)
    assert (g.hidden_dropout, g.attention_dropout, g.layernorm_epsilon) == (0.2, 0.1, 1e-6)
    assert (d.num_layers, d.hidden_size, d.hidden_dropout) == (4, 96, 0.1)  # untouched
    cfg = from_flags("--preset", "tiny", "--generator-num-attention-heads", "3",
                     "--generator-attention-dropout", "0")
    assert (cfg.model.generator.num_attention_heads, cfg.model.generator.hidden_size) == (3, 96)
    assert cfg.model.generator.attention_dropout == 0.0


def test_ratio_flags_scale_the_discriminator_rounding_to_nearest():
    cfg = from_flags("--preset", "debertav3-base", "--num-layers", "10",
                     "--generator-num-layers-ratio", "0.25", "--generator-hidden-size-ratio",
                     "0.5")
    g = cfg.model.generator
    # round(2.5) = 2 (Python's and ELECTRA's int(round(·))); 768 × 0.5 = 384 with head size 64
    assert (g.num_layers, g.hidden_size, g.num_attention_heads, g.ffn_hidden_size) == (2, 384, 6, 1536)
    assert cfg.model.embedding_size == 768  # the shared table keeps the discriminator's width
    cfg = from_flags("--preset", "tiny", "--generator-hidden-size-ratio", "0.5")  # ratio alone
    assert (cfg.model.generator.hidden_size, cfg.model.generator.num_attention_heads) == (48, 1)
    # head size 64: 21 // 64 → 1 head; 320 // 64 = 5 heads; 200 // 64 = 3 does not divide 200 → 2
    for ratio, width, heads in (("0.0833", 21, 1), ("1.25", 320, 5), ("0.78125", 200, 2)):
        g = from_flags("--preset", "electra-small", "--generator-hidden-size-ratio", ratio).model.generator
        assert (g.hidden_size, g.num_attention_heads, g.ffn_hidden_size) == (width, heads, 4 * width)


def test_set_can_repair_what_the_flags_leave_inconsistent():
    # electra-base has 12 heads: --hidden-size 100 alone does not divide, --set fixes the heads
    cfg = from_flags("--preset", "electra-base", "--hidden-size", "100",
                     "--set", "model.discriminator.num_attention_heads=4",
                     "--set", "model.generator.num_attention_heads=1")
    assert (cfg.model.discriminator.hidden_size, cfg.model.discriminator.num_attention_heads) == (100, 4)


def test_precedence_preset_then_flags_then_set():
    cfg = from_flags("--preset", "tiny", "--hidden-size", "64",
                     "--set", "model.discriminator.hidden_size=128",
                     "--set", "model.generator.num_layers=4")
    assert cfg.model.discriminator.hidden_size == 128  # --set beats the flag
    assert cfg.model.discriminator.ffn_hidden_size == 256  # derived from the flag, not re-derived
    assert cfg.model.generator.num_layers == 4  # --set beats the derived value
    assert cfg.model.generator.hidden_size == 64  # derived from --hidden-size
    assert from_flags("--preset", "tiny", "--adam-beta2", "0.95").optim.adam_beta2 == 0.95


def test_vocab_padding_follows_megatrons_rule():
    # Megatron-LM's _vocab_size_with_padding: round up to divisible_by × TP
    cfg = from_flags("--make-vocab-size-divisible-by", "64")
    cfg.model.vocab_size = 30_522
    assert cfg.model.padded_vocab_size(1) == 30_528
    assert cfg.model.padded_vocab_size(2) == 30_592
    cfg = from_flags("--make-vocab-size-divisible-by", "1")
    cfg.model.vocab_size = 30_522
    assert cfg.model.padded_vocab_size(1) == 30_522
    assert cfg.model.padded_vocab_size(4) == 30_524
    assert from_flags().model.make_vocab_size_divisible_by == 128
    with pytest.raises(ConfigError, match=r"--make-vocab-size-divisible-by "
                       r"\(model.make_vocab_size_divisible_by\) must be > 0, got 0"):
        from_flags("--make-vocab-size-divisible-by", "0")


def test_megatron_deepspeeds_spelling_is_accepted():
    args = build_parser().parse_args(["--deepspeed", "--deepspeed_config", "ds_configs/zero3.json",
                                      *BASE[2:], "--bert-no-binary-head"])
    assert args.deepspeed and config_from_args(args).train.ds_config == "ds_configs/zero3.json"


def test_megatron_tokenizer_flags():
    assert from_flags("--tokenizer-type", "SentencePieceTokenizer").data.tokenizer_model == "spm.model"
    args = build_parser().parse_args(["--ds_config", "z.json", "--data-path", "d",
                                      "--vocab-file", "bert/vocab.txt",
                                      "--tokenizer-type", "BertWordPieceLowerCase"])
    assert config_from_args(args).data.tokenizer_model == "bert/vocab.txt"
    with pytest.raises(ConfigError, match=r"--tokenizer-type BertWordPieceCase does not fit "
                       r"spm.model \(a sentencepiece file\); pass --tokenizer-type "
                       r"GPTSentencePieceTokenizer or SentencePieceTokenizer"):
        from_flags("--tokenizer-type", "BertWordPieceCase")
    with pytest.raises(ConfigError, match="--vocab-file v.txt and --tokenizer-model spm.model"):
        from_flags("--vocab-file", "v.txt")


@pytest.mark.parametrize("argv, message", [
    (["--generator-hidden-size", "32", "--generator-hidden-size-ratio", "0.5"],
     "--generator-hidden-size and --generator-hidden-size-ratio both set"),
    (["--generator-num-layers-ratio", "0"], "--generator-num-layers-ratio 0.0: must be a positive"),
    (["--generator-hidden-size-ratio", "nan"], "must be a positive number"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be >= 1, got 0"),
    (["--hidden-size", "100", "--num-attention-heads", "3"],
     r"--hidden-size \(model.discriminator.hidden_size\) \(100\) must be divisible by "
     r"--num-attention-heads \(model.discriminator.num_attention_heads\) \(3\); use 2 or 4 "
     r"heads \(the nearest counts that divide 100\)$"),
    (["--hidden-size", "96", "--num-attention-heads", "200"],
     r"\(200\); use 96 heads \(the nearest counts that divide 96\)$"),
    (["--generator-num-layers-ratio", "0.1"],
     r"model.generator.num_layers would be 0 \(round\(0.1 × 4\)\); pass --generator-num-layers"),
])
def test_bad_generator_flags_are_one_line_errors(argv, message):
    with pytest.raises(ConfigError, match=message):
        from_flags(*argv)


@pytest.mark.parametrize("argv, message", [
    # --hidden-dropout sets the discriminator (the generator follows it), which is checked first
    (["--hidden-dropout", "1.5"],
     "--hidden-dropout (model.discriminator.hidden_dropout) must be in [0, 1], got 1.5"),
    (["--generator-attention-dropout", "2"],
     "--generator-attention-dropout (model.generator.attention_dropout) must be in [0, 1], "
     "got 2.0"),
    (["--adam-beta1", "1.2"], "--adam-beta1 (optim.adam_beta1) must be in [0, 1], got 1.2"),
    (["--init-method-std", "-1"], "--init-method-std (model.init_method_std) must be > 0, got -1.0"),
    # --set has the last word: the field it set is no longer the flag's
    (["--hidden-dropout", "1.5", "--set", "model.generator.hidden_dropout=0.1"],
     "--hidden-dropout (model.discriminator.hidden_dropout) must be in [0, 1], got 1.5"),
    (["--set", "model.discriminator.hidden_dropout=1.5"],
     "--set model.discriminator.hidden_dropout must be in [0, 1], got 1.5"),
    (["--hidden-dropout", "0.1", "--set", "model.discriminator.hidden_dropout=1.5"],
     "--set model.discriminator.hidden_dropout must be in [0, 1], got 1.5"),
])
def test_a_bad_value_from_a_megatron_flag_names_the_flag(argv, message):
    with pytest.raises(ConfigError) as e:
        from_flags(*argv)
    assert str(e.value) == message


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch-size", "0"], "--micro-batch-size (train.micro_batch_size) must be > 0, got 0"),
    (["--lr", "-1"], "--lr (optim.lr) must be > 0, got -1.0"),
    (["--mask-prob", "1.5"], "--mask-prob (rtd.mask_prob) must be in [0, 1], got 1.5"),
    (["--rtd-lambda", "-1"], "--rtd-lambda (rtd.rtd_lambda) must be >= 0, got -1.0"),
    (["--seq-length", "0"], "--seq-length (data.seq_length) must be > 0, got 0"),
    # the masking streams' numpy.random.default_rng refused it in the first step, after --save
    (["--seed", "-1"], "--seed (train.seed) must be in [0, 2**32 - 1], got -1"),
    (["--seed", str(2**32)], "--seed (train.seed) must be in [0, 2**32 - 1], got 4294967296"),
])
def test_a_bad_value_from_any_flag_names_the_flag(argv, message):
    with pytest.raises(ConfigError) as e:
        from_flags(*argv)
    assert str(e.value) == message


@pytest.mark.parametrize("argv, message", [
    (["--lr-decay-style", "cosinee"],
     "error: argument --lr-decay-style: invalid choice: 'cosinee' (choose from 'constant', "
     "'linear', 'cosine', 'inverse-square-root', 'WSD')"),
    (["--hidden_size", "128"],
     "error: unrecognized arguments: --hidden_size 128 (did you mean --hidden-size?)"),
    # no abbreviations (allow_abbrev=False, as Megatron-LM): a prefix is not a flag
    (["--num-layer", "4"],
     "error: unrecognized arguments: --num-layer 4 (did you mean --num-layers?)"),
    (["--use-flash-attn"], "error: unrecognized arguments: --use-flash-attn"),
])
def test_a_mistyped_flag_is_one_line_not_the_usage_block(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main([*BASE, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{message}; rtd_scale/pretrain.py --help lists every flag\n"


REFUSED_CASES = [[r.flags[0]] + (["4"] if r.nargs else []) for r in REFUSED]


@pytest.mark.parametrize("argv", REFUSED_CASES, ids=[a[0] for a in REFUSED_CASES])
def test_refused_flags_are_one_line_naming_the_flag(argv, capsys):
    assert main([*BASE, *argv]) == EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {' '.join(argv)}: not supported: ")


def test_refused_flags_accept_their_no_op_value():
    cfg = from_flags("--position-embedding-type", "learned_absolute", "--normalization",
                     "LayerNorm", "--context-parallel-size", "1")
    assert cfg.to_dict() == from_sets("tiny").to_dict()
    with pytest.raises(ConfigError, match="--context-parallel-size 2: not supported: .* "
                                          r"\(or pass --context-parallel-size 1\)"):
        from_flags("--context-parallel-size", "2")


def _flags_page_section(start: str, end: str) -> str:
    """The manual's flag reference (docs/flags.md) from ``start`` to ``end``."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "flags.md").read_text(encoding="utf-8")
    return text[text.index(start):text.index(end, text.index(start))]


def test_manual_flag_table_matches_the_parser():
    parser = build_parser()
    known = parser._option_string_actions
    table = _flags_page_section("## Megatron flags", "**The generator.**")
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `--")]
    listed = {f for row in rows for f in re.findall(r"`(--[\w-]+)", row)}
    refused = {f for r in REFUSED for f in r.flags}
    assert len(listed) > 50
    assert sorted(f for f in listed if f not in known) == []  # every row is a flag we take
    assert sorted(f for f in listed if f in refused and not any(
        r.accepted for r in REFUSED if f in r.flags)) == []
    generator = _flags_page_section("**The generator.**", "**Refused**")
    model_flags = {o for a in parser._actions for o in a.option_strings
                   if o in known and a.help != argparse.SUPPRESS
                   and a.container.title and a.container.title.startswith("Megatron-LM model")}
    documented = listed | set(re.findall(r"`(--[\w-]+)", generator))
    assert sorted(model_flags - documented) == []
    refusals = _flags_page_section("**Refused**", "Our own flags")
    assert sorted(f for f in refused if f"`{f}" not in refusals) == []


def test_another_vocab_multiple_pads_only(single_process_group):
    """--make-vocab-size-divisible-by 64: 300 ids pad to 320 rather than 384; the real rows and
    the MLM loss are the same (padded ids are never predicted), and no padded or special id is
    sampled (the shard is not whole 128-id blocks, so sampling takes one level)."""
    import torch

    from tests.helpers.tiny_model import build

    out, models = {}, {}
    for multiple in (128, 64):
        cfg = from_flags("--make-vocab-size-divisible-by", str(multiple), "--hidden-size", "32",
                         "--num-attention-heads", "2", "--num-layers", "2",
                         "--hidden-dropout", "0", "--attention-dropout", "0")
        cfg.model.vocab_size = 300
        torch.manual_seed(0)
        m = build(cfg, seed=5)  # ids 0-4 special, [PAD] 0, [MASK] 4
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(5, 300, (8, 32), generator=g)
        ids[:, 0], ids[:, -1] = 1, 2
        out[multiple], models[multiple] = m(ids, torch.arange(8)), m
    assert (models[128].padded_vocab_size, models[64].padded_vocab_size) == (384, 320)
    w128, w64 = (models[k].generator_table.weight for k in (128, 64))
    assert w64.shape[0] == 320 and torch.equal(w128[:300], w64[:300])
    torch.testing.assert_close(out[64].mlm_loss, out[128].mlm_loss)
    sampled = out[64].corrupted_ids[out[64].masked]
    assert sampled.numel() > 0 and sampled.max().item() < 300
    assert not torch.isin(sampled, torch.tensor([0, 1, 2, 3, 4])).any()


@pytest.mark.parametrize("flag, value, field", [("--lr-warmup-fraction", "0.1", "lr_warmup_fraction"),
                                                ("--lr-warmup-samples", "320", "lr_warmup_samples")])
def test_warmup_in_another_unit_replaces_the_presets_iterations(flag, value, field):
    """Every preset warms up in iterations; a Megatron user's --lr-warmup-fraction or
    --lr-warmup-samples replaces that warm-up instead of contradicting it. Given together
    with --lr-warmup-iters, it is still refused."""
    for name in ("tiny", "electra-base", "debertav3-large"):
        cfg = from_flags("--preset", name, flag, value)
        assert cfg.optim.lr_warmup_iters == 0
        assert getattr(cfg.optim, field) == pytest.approx(float(value))
    from rtd_scale.cli_errors import UserInputError

    with pytest.raises(UserInputError, match="both give the same length"):
        from_flags(flag, value, "--lr-warmup-iters", "5")


def test_own_warnings_are_one_line_and_others_keep_pythons_format(capsys):
    import warnings
    from pathlib import Path

    import rtd_scale.config
    from rtd_scale.cli_errors import one_line_warnings

    ours = rtd_scale.config.__file__
    passed_on = []
    with warnings.catch_warnings():  # restores warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, filename, lineno, *rest: \
            passed_on.append((str(message), category, filename, lineno))
        one_line_warnings()
        warnings.warn_explicit("the learning-rate warm-up (960 samples) is not shorter\n   than "
                               "the run", UserWarning, ours, 582)
        warnings.warn_explicit("note: rebuilding the cache", UserWarning, ours, 1)
        warnings.warn_explicit("a library's", UserWarning, str(Path("/elsewhere/lib.py")), 7)
    assert capsys.readouterr().err.splitlines() == [
        "warning: the learning-rate warm-up (960 samples) is not shorter than the run",
        "note: rebuilding the cache"]
    # another package's warning goes to the hook that was there before, untouched
    assert passed_on == [("a library's", UserWarning, str(Path("/elsewhere/lib.py")), 7)]
