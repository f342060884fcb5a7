"""bench/lever_study.py: each lever is the main job's own command plus its flags, its numbers are
read back from TensorBoard at the main job's steps, and the table prints them."""
from __future__ import annotations

import argparse
import re

from tests.helpers.env import REPO

from bench import lever_study


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"ranks": 2, "master_port": 29571, "steps": 600,
                                 "eval_interval": 100, **kw})


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_a_lever_is_the_main_jobs_command_with_its_flags_added():
    script = (REPO / "tools" / "run_default.sh").read_text()
    cmd = lever_study.command(_args(), ("--mask-prob", "0.25"), 600, "s.model", "p", REPO / "r")
    assert _flag(cmd, "--preset") == re.search(r"--preset (\S+)", script)[1] == "debertav3-tiny"
    assert _flag(cmd, "--ds_config") == re.search(r"RTD_DS_CONFIG:-([^}]+)}", script)[1]
    assert _flag(cmd, "--train-iters") == re.search(r"RTD_STEPS:-(\d+)", script)[1] == "600"
    for name in ("--log-interval", "--eval-iters"):
        assert _flag(cmd, name) == re.search(rf"{name} (\d+)", script)[1]
    assert _flag(cmd, "--num_gpus") == re.search(r"RTD_RANKS:-(\d+)", script)[1]
    assert cmd[-12:-2] == list(lever_study.BASE) and cmd[-2:] == ["--mask-prob", "0.25"]
    assert _flag(cmd, "--eval-interval") == "100"
    # half the steps at twice the batch: validation at the same samples
    half = lever_study.command(_args(), (), 300, "s.model", "p", REPO / "r")
    assert (_flag(half, "--train-iters"), _flag(half, "--eval-interval")) == ("300", "50")


def test_results_are_read_from_tensorboard_at_the_main_jobs_steps(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run = tmp_path / "batch-64"
    with SummaryWriter(str(run / "tensorboard")) as w:
        for step, auc, mlm in ((50, 0.55, 7.0), (100, 0.61, 6.5), (150, 0.66, 6.25)):
            w.add_scalar("valid/rtd/auc", auc, step)
            w.add_scalar("valid/loss/mlm", mlm, step)
            w.add_scalar("valid/mlm/accuracy", mlm / 50, step)
    got = lever_study.results_of("batch-64", run, ("--global-batch-size", "64"), 90.0, 150, 2)
    assert {k: round(v, 6) for k, v in got["auc"].items()} == {100: 0.55, 200: 0.61, 300: 0.66}
    assert (got["valid_mlm"], round(got["valid_mlm_accuracy"], 6)) == (6.25, 0.125)
    assert got["mlm"] == {100: 7.0, 200: 6.5, 300: 6.25}
    assert got["s_per_step"] == 0.6 and got["flags"] == ["--global-batch-size", "64"]


def test_the_table_has_a_row_per_lever_with_the_mean_over_seeds_and_marks_auc_past_065():
    base = {"flags": [], "valid_mlm": 6.2, "valid_mlm_accuracy": 0.14, "s_per_step": 0.45}
    results = {"baseline": [{**base, "auc": {"100": 0.566, "200": 0.574}},
                            {**base, "auc": {"100": 0.560, "200": 0.730}, "valid_mlm": 6.4,
                             "s_per_step": 0.55}],
               "dropout-0": [{"flags": ["--hidden-dropout", "0"], "auc": {"100": 0.571},
                              "valid_mlm": 6.0, "valid_mlm_accuracy": None, "s_per_step": None}]}
    lines = lever_study.table(results, 200, 100).splitlines()
    assert lines[0] == ("| lever | flags added to the main job | seeds | AUC @100 | AUC @200 | "
                        "last AUC of each seed | valid L_MLM | MLM acc | s/step |")
    assert lines[2] == ("| baseline | (none) | 2 | 0.563 | **0.652** | 0.574, 0.730 | 6.30 | "
                        "0.140 | 0.50 |")
    assert lines[3] == "| dropout-0 | `--hidden-dropout 0` | 1 | 0.571 | — | 0.571 | 6.00 | — | — |"
    assert len(lines) == 4
    vocab = {"flags": [], "vocab_size": 3000, "auc": {}, "valid_mlm": None,
             "valid_mlm_accuracy": None, "s_per_step": None}
    assert lever_study.table({"vocab-3000": [vocab]}, 100, 100).splitlines()[2] == (
        "| vocab-3000 | a 3,000-piece tokenizer | 1 | — | — | — | — | — |")
    # the L_MLM table: the mean over seeds at each validation; a run without the record: —
    mlm = {"modern-block": [{"mlm": {"100": 6.5, "200": 6.0}}, {"mlm": {"100": 6.7, "200": 6.2}}],
           "combined": [{"auc": {}}]}
    assert lever_study.mlm_table(mlm, 200, 100).splitlines() == [
        "| lever | seeds | L_MLM @100 | L_MLM @200 |", "|---|---|---|---|",
        "| modern-block | 2 | 6.60 | 6.10 |", "| combined | 1 | — | — |"]
    assert (lever_study.run_key("generator-1/3", 1234), lever_study.run_key("mask-0.25", 7)) == (
        "generator-1_3", "mask-0.25-seed7")
