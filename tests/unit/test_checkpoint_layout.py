"""The layout rules of ``--load`` (training/checkpoint.py) and the universal conversion's
all-or-nothing write (training/reshard.py); the conversions themselves run in
tests/e2e/test_resume_layout.py."""
from __future__ import annotations

import pytest

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training import checkpoint, reshard

DP2_Z3 = {"world_size": 2, "data_parallel_size": 2, "tensor_model_parallel_size": 1,
          "pipeline_model_parallel_size": 1, "zero_stage": 3}
DP1_Z1 = {**DP2_Z3, "world_size": 1, "data_parallel_size": 1, "zero_stage": 1}


def test_another_dp_size_or_zero_stage_needs_a_conversion_and_passes():
    assert checkpoint.describe_layout(DP2_Z3) == "TP 1 × PP 1 × DP 2, ZeRO-3"
    assert not checkpoint.needs_conversion({"layout": dict(DP2_Z3)}, DP2_Z3)
    assert checkpoint.needs_conversion({"layout": dict(DP2_Z3)}, DP1_Z1)
    assert not checkpoint.needs_conversion(None, DP1_Z1)
    checkpoint.check_convertible("run", "global_step3", DP2_Z3, DP1_Z1)  # no error


def test_another_tp_size_is_one_line_naming_both_layouts():
    # a vocabulary padded for TP 2 (128 × 2) cannot be re-split for TP 3 by a DP conversion
    tp2 = {**DP2_Z3, "data_parallel_size": 1, "tensor_model_parallel_size": 2}
    tp3 = {**DP2_Z3, "world_size": 3, "data_parallel_size": 1, "tensor_model_parallel_size": 3}
    with pytest.raises(UserInputError) as e:
        checkpoint.check_convertible("run", "global_step3", tp2, tp3)
    assert str(e.value).startswith(
        "--load run: global_step3 was saved at TP 2 × PP 1 × DP 1, ZeRO-3, this run is "
        "TP 3 × PP 1 × DP 1, ZeRO-3: ")
    assert "resume with --tensor-model-parallel-size 2" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_failed_conversion_leaves_nothing_and_the_checkpoint_untouched(tmp_path):
    tag = tmp_path / "global_step3"
    tag.mkdir()
    (tag / "rtd_meta.json").write_text("{}")  # no DeepSpeed files: the converter fails
    with pytest.raises(UserInputError) as e:
        reshard.convert(str(tmp_path), "global_step3")
    assert str(e.value).startswith(f"--load {tmp_path}: DeepSpeed's universal conversion of "
                                   "global_step3 failed (")
    assert str(e.value).endswith("); resume at the checkpoint's layout")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3"]
    assert sorted(p.name for p in tag.iterdir()) == ["rtd_meta.json"]
    assert not reshard.is_converted(str(tmp_path), "global_step3")


def test_another_dp_size_at_tp_2_is_refused_until_tp_patterns_exist():
    tp2_dp2 = {**DP2_Z3, "world_size": 4, "tensor_model_parallel_size": 2}
    tp2_dp1 = {**tp2_dp2, "world_size": 2, "data_parallel_size": 1}
    with pytest.raises(UserInputError) as e:
        checkpoint.check_convertible("run", "global_step3", tp2_dp2, tp2_dp1)
    assert str(e.value) == (
        "--load run: global_step3 was saved at TP 2 × PP 1 × DP 2, ZeRO-3, this run is "
        "TP 2 × PP 1 × DP 1, ZeRO-3: --load changes the data-parallel size or ZeRO stage at "
        "TP 1 × PP 1 only; resume with the checkpoint's number of ranks and --ds_config, or "
        "start from its weights only with --pretrained-checkpoint (the optimizer starts fresh)")
