"""--eval-dump-dir: a warning when validation is off (it would never write), and the start-up
check it shares with --tensorboard-dir (the refusal through prepare.prepare is
tests/e2e/test_pretrain_errors.py::test_unwritable_eval_dump_dir)."""
from __future__ import annotations

import warnings

import pytest

from rtd_scale import arguments

BASE = ["--ds_config", "ds_configs/zero3.json", "--data-path", "D", "--tokenizer-model", "t.model",
        "--preset", "tiny"]


def _config(*extra):
    return arguments.config_from_args(arguments.build_parser().parse_args([*BASE, *extra]))


@pytest.mark.parametrize("off, interval, iters", [(["--eval-iters", "0"], 1000, 0),
                                                  (["--eval-interval", "0"], 0, 100)])
def test_eval_dump_dir_without_validation_warns(off, interval, iters, tmp_path):
    with pytest.warns(UserWarning) as caught:
        _config("--eval-dump-dir", str(tmp_path / "d"), "--eval-interval", "1000",
                "--eval-iters", "100", *off)
    messages = [str(w.message) for w in caught if "eval-dump-dir" in str(w.message)]
    assert messages == [f"--eval-dump-dir {tmp_path / 'd'} has no effect: validation is off "
                        f"(--eval-interval {interval}, --eval-iters {iters}); pass both > 0 to "
                        "write the dumps"]


@pytest.mark.parametrize("evaluations", [
    ["--eval-interval", "5", "--eval-iters", "2"],
    # the test evaluation after the last step runs, and dumps, without periodic validation
    ["--eval-interval", "0", "--eval-iters", "2", "--test-data-path", "T"]])
def test_eval_dump_dir_with_an_evaluation_does_not_warn(evaluations, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = _config("--eval-dump-dir", str(tmp_path / "d"), *evaluations)
    assert cfg.dumps_evaluations()
    assert [str(w.message) for w in caught if "eval-dump-dir" in str(w.message)] == []


def test_shuffle_labels_not_a_bool_is_one_line():
    with pytest.raises(ValueError) as e:
        _config("--set", "rtd.shuffle_labels=maybe")
    assert str(e.value) == ("--set rtd.shuffle_labels=maybe: expected a value of type bool, "
                            "e.g. --set rtd.shuffle_labels=False")
