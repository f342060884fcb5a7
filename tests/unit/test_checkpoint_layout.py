"""The layout rules of ``--load`` (training/checkpoint/compat.py) and the conversion's
all-or-nothing writes (training/checkpoint/convert.py); the conversions themselves run in
tests/multiproc/test_layout_free.py and tests/e2e/test_resume_layout.py."""
from __future__ import annotations

import types

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.checkpoint import checks, compat, convert, layout_free
from rtd_scale.training.checkpoint.files import CheckpointReadError, SafeCheckpointEngine

DP2_Z3 = {"world_size": 2, "data_parallel_size": 2, "tensor_model_parallel_size": 1,
          "pipeline_model_parallel_size": 1, "zero_stage": 3}
DP1_Z1 = {**DP2_Z3, "world_size": 1, "data_parallel_size": 1, "zero_stage": 1}


def test_another_dp_size_or_zero_stage_needs_a_conversion_and_passes():
    assert compat.describe_layout(DP2_Z3) == "TP 1 × PP 1 × DP 2, ZeRO-3"
    assert not compat.needs_conversion({"layout": dict(DP2_Z3)}, DP2_Z3)
    assert compat.needs_conversion({"layout": dict(DP2_Z3)}, DP1_Z1)
    assert not compat.needs_conversion(None, DP1_Z1)
    compat.check_convertible("run", "global_step3", DP2_Z3, DP1_Z1)  # no error


def test_dropout_streams_continue_where_the_same_ranks_keep_their_roles():
    """Another ZeRO stage (or precision, offload) at the same TP × PP × DP sizes converts, yet
    every rank continues its own dropout stream (resume.resume restores rng_rank*.pt); another
    DP, TP or PP size reseeds. The launched run: tests/e2e/test_resume_changes.py."""
    z1 = {**DP2_Z3, "zero_stage": 1}
    assert compat.needs_conversion({"layout": dict(DP2_Z3)}, z1)
    assert compat.same_ranks({"layout": dict(DP2_Z3)}, z1)
    assert not compat.same_ranks({"layout": dict(DP2_Z3)}, DP1_Z1)
    tp2 = {**DP2_Z3, "data_parallel_size": 1, "tensor_model_parallel_size": 2}
    assert not compat.same_ranks({"layout": dict(DP2_Z3)}, tp2)  # same world, other roles
    assert not compat.same_ranks(None, DP2_Z3)


def test_another_tp_pp_size_zero_stage_or_precision_converts():
    # TP 2 → 3: the layout-free state holds the real vocabulary rows, padded again for TP 3
    tp2 = {**DP2_Z3, "data_parallel_size": 1, "tensor_model_parallel_size": 2}
    tp3 = {**DP2_Z3, "world_size": 3, "data_parallel_size": 1, "tensor_model_parallel_size": 3}
    pp2 = {**DP1_Z1, "world_size": 2, "pipeline_model_parallel_size": 2}
    dp1_z0 = {**DP1_Z1, "zero_stage": 0}
    tp2_dp2 = {**DP2_Z3, "world_size": 4, "tensor_model_parallel_size": 2}
    for saved, layout in ((tp2, tp3), (pp2, DP1_Z1), (DP2_Z3, dp1_z0), (tp2_dp2, tp2),
                          (dp1_z0, DP2_Z3)):
        compat.check_convertible("run", "global_step3", saved, layout)  # no error
        assert compat.needs_conversion({"layout": saved}, layout)
    # a precision change alone converts (DeepSpeed's files differ per precision); a checkpoint
    # without a recorded precision was fp32
    fp32 = {"layout": dict(DP1_Z1), "config": {"train": {"precision": "fp32"}}}
    assert compat.needs_conversion(fp32, DP1_Z1, "bf16")
    assert not compat.needs_conversion(fp32, DP1_Z1, "fp32")
    assert compat.needs_conversion({"layout": dict(DP1_Z1)}, DP1_Z1, "bf16")
    compat.check_convertible("run", "global_step3", DP1_Z1, DP1_Z1, saved_precision="fp32",
                             precision="bf16")  # no error
    assert (compat.describe_layout(DP1_Z1, "bf16") == "TP 1 × PP 1 × DP 1, ZeRO-1, bf16")


def test_zero0_under_fp16_is_one_line_naming_both_layouts():
    dp1_z0 = {**DP1_Z1, "zero_stage": 0}
    with pytest.raises(UserInputError) as e:
        compat.check_convertible("run", "global_step3", dp1_z0, DP2_Z3,
                                     saved_precision="fp16", precision="fp16")
    assert str(e.value) == (
        "--load run: global_step3 was saved at TP 1 × PP 1 × DP 1, ZeRO-0, this run is "
        "TP 1 × PP 1 × DP 2, ZeRO-3: the checkpoint is ZeRO-0 under --fp16, whose AdamW state "
        "DeepSpeed keeps in one flat fp16 optimizer that cannot be re-split; resume at the "
        "checkpoint's layout, or use a ds_configs/zero1.json-style file on both runs")
    with pytest.raises(UserInputError, match=r"^--load run: .*: this run is ZeRO-0 under --fp16"):
        compat.check_convertible("run", "global_step3", DP2_Z3, dp1_z0,
                                     saved_precision="fp16", precision="fp16")
    compat.check_convertible("run", "global_step3", dp1_z0, DP2_Z3,
                                 saved_precision="bf16", precision="bf16")  # no error


def test_a_failed_layout_free_conversion_leaves_nothing_and_the_checkpoint_untouched(tmp_path):
    tag = tmp_path / "global_step3"
    tag.mkdir()
    (tag / "rtd_complete.json").write_text('{"files": {}}')  # complete, but no metadata
    with pytest.raises(UserInputError) as e:
        convert.convert(str(tmp_path), "global_step3")
    assert str(e.value) == (f"--load {tmp_path}: global_step3 has no rtd_meta.json (layout and "
                            "config); it was not written by rtd_scale")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3"]
    assert sorted(p.name for p in tag.iterdir()) == ["rtd_complete.json"]
    assert not convert.is_converted(str(tmp_path), "global_step3")


def test_the_conversion_runs_the_before_build_checks_of_the_one_list(tmp_path, monkeypatch):
    """A check added to checks.CHECKS at BEFORE_BUILD reaches the conversion, as it reaches a
    checkpoint's (load.take)."""
    seen = []
    probe = checks.Check("probe", checks.Moment.BEFORE_BUILD,
                         lambda ckpt_dir: seen.append(ckpt_dir))
    monkeypatch.setattr(checks, "CHECKS", (*checks.CHECKS, probe))
    canonical = tmp_path / "global_step3_canonical"
    canonical.mkdir()
    convert.check_safe(str(canonical))
    assert seen == [str(canonical)]


class _Payload:
    """Unpickled without weights_only, creates ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_the_layout_free_state_is_read_as_safely_as_a_checkpoint(tmp_path):
    """layout_free.load reads state.pt through files.safe_load: a crafted file is one line
    naming it, and its payload never runs."""
    root, marker = tmp_path / "global_step3_canonical", tmp_path / "marker"
    root.mkdir()
    torch.save({"fp32": {"w": torch.zeros(2)}, "x": _Payload(marker)},
               root / layout_free.STATE_FILE)
    engine = types.SimpleNamespace(checkpoint_engine=SafeCheckpointEngine(None))
    with pytest.raises(CheckpointReadError) as e:
        layout_free.load(engine, None, None, str(root), str(tmp_path), flag="--load run")
    assert str(e.value).startswith(f"{root / layout_free.STATE_FILE}: refused to load: it holds "
                                   "Python objects other than tensors")
    assert "\n" not in str(e.value) and not marker.exists()


def test_a_complete_conversion_is_reused_and_is_converted_says_so(tmp_path):
    """The marker that makes a conversion count is the one is_converted reads: with it, the
    conversion is reused (nothing is written)."""
    never = lambda *_: pytest.fail("a complete conversion was converted again")  # noqa: E731
    canonical = tmp_path / "global_step3_canonical"
    canonical.mkdir()
    assert not convert.is_converted(str(tmp_path), "global_step3")
    (canonical / convert.DONE_FILE).write_text("global_step3\n")
    assert convert.is_converted(str(tmp_path), "global_step3")
    assert convert.convert(str(tmp_path), "global_step3", write=never) == (
        str(canonical), 0.0, False, None)
