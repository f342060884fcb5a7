"""tools/make_known_answer_corpus.py on bad input: one line naming the flag and the fix, exit
status 1 (2 for argparse's own errors), no traceback, and nothing written; and chains that
cannot be drawn are refused up front instead of hanging (verify/known_answer.py's
chain_problem)."""
from __future__ import annotations

import json

import pytest

from rtd_scale.cli_errors import run_cli
from verify.known_answer import MAX_WORDS, MarkovLanguage, chain_problem
from tests.helpers.tools import load_tool

tool = load_tool("make_known_answer_corpus")

SMALL = ["--train-documents", "3", "--valid-documents", "2"]


def _refused(capsys, tmp_path, *argv):
    out = tmp_path / "out"
    assert run_cli(tool.main, ["--output", str(out), *SMALL, *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert not out.exists()
    return captured.err.rstrip("\n")


@pytest.mark.parametrize("argv, message", [
    (["--num-words", "0"], "--num-words must be >= 1, got 0"),
    (["--train-documents", "-1"], "--train-documents must be >= 1, got -1"),
    (["--valid-documents", "0"], "--valid-documents must be >= 1, got 0"),
    (["--seed", "-2"], "--seed must be >= 0, got -2"),
    (["--num-words", "5", "--num-successors", "6"],
     "--num-successors must be in [1, --num-words 5], got 6"),
    (["--min-words", "10", "--max-words", "5"],
     "--max-words 5 is below --min-words 10; pass --max-words >= --min-words"),
    (["--num-words", "5000"], "--num-words 5000: at most 4900 distinct made-up words (two "
     "consonant-vowel syllables) exist; pass --num-words <= 4900"),
    (["--num-words", "8", "--num-successors", "1"], "--num-successors 1 --num-words 8: with "
     "one successor per word every chain over all words is a cycle, which is periodic; use "
     "--num-successors >= 2"),
    (["--num-words", "500"], "--num-successors 3 --num-words 500: with 3 successors per word "
     "almost every chain over 500 words leaves a word unreachable; use --num-successors >= 5 "
     "or fewer words"),
])
def test_bad_numbers_are_one_line_naming_the_flag(argv, message, capsys, tmp_path):
    assert _refused(capsys, tmp_path, *argv) == f"error: {message}"


def test_abbreviated_flag_is_refused_with_the_full_name(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:  # argparse's own exit, status 2
        tool.main(["--output", str(tmp_path / "out"), "--num-word", "5"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: unrecognized arguments: --num-word 5 (did you mean --num-words?); "
        "tools/make_known_answer_corpus.py --help lists every flag\n")
    assert not (tmp_path / "out").exists()


def test_output_that_is_a_file_or_unwritable(capsys, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("keep")
    for out, message in (
            (f, f"--output {f}: exists and is not a directory; pass a writable directory to "
                "--output"),
            (f / "sub", f"--output {f / 'sub'}: cannot be created: {f} is a file, not a "
                        "directory; pass a writable directory to --output")):
        assert run_cli(tool.main, ["--output", str(out), *SMALL]) == 1
        assert capsys.readouterr().err == f"error: {message}\n"
        assert f.read_text() == "keep"
    assert run_cli(tool.main, ["--output", "/proc/rtd_scale_corpus/x", *SMALL]) == 1
    # root may write wherever os.access says, but /proc refuses a new entry
    assert capsys.readouterr().err in {
        "error: --output /proc/rtd_scale_corpus/x: cannot be created: /proc is not writable "
        f"({why}); pass a writable directory to --output\n"
        for why in ("it takes no new directories", "Permission denied")}


def test_a_good_run_writes_four_files_and_no_negative_zero(capsys, tmp_path):
    out = tmp_path / "out"
    assert run_cli(tool.main, ["--output", str(out), *SMALL, "--num-words", "1",
                               "--num-successors", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "unigram_entropy": 0.0, "bigram_entropy": 0.0, "num_words": 1, "num_successors": 1}
    assert capsys.readouterr().out == ""
    assert sorted(p.name for p in out.iterdir()) == [
        "language.json", "train.jsonl", "valid.jsonl", "vocab.txt"]


def test_chain_problem_and_the_seed_1_chain_unchanged():
    assert chain_problem(64, 3) is None and chain_problem(2, 2) is None
    assert chain_problem(1, 1) is None  # one word following itself is aperiodic
    assert chain_problem(MAX_WORDS + 1, 3).startswith("at most 4900 distinct")
    assert chain_problem(64, 2).endswith("use num_successors >= 3 or fewer words")
    # the in-degree shortcut keeps the same draws: seed 1's chain (tests/e2e/test_known_answer.py)
    assert MarkovLanguage.make(1, 64, 3).unigram_entropy() == pytest.approx(3.9055, abs=1e-4)
    with pytest.raises(ValueError, match="^seed must be >= 0"):
        MarkovLanguage.make(-1, 64, 3)
