"""tools/curves.py: the six panels and their reference lines on synthetic scalars, the end-of-run
curves.png as the summary draws it (rtd_scale.training.summary.write_curves loads the file) and its
failures (a warning line, never an exception)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.diagnostics import VALID_AUC_CHANCE_SD, prior_bce
from rtd_scale.training.summary import CURVES_TOOL, write_curves
from tests.helpers.images import png_size, synthetic_scalars, write_events
from tests.helpers.tools import load_tool

curves = load_tool("curves")


def _lines(fig) -> dict:
    return {l.get_gid(): l for ax in fig.axes for l in ax.lines if l.get_gid()}


def _run(name="run-a", **kw) -> curves.RunCurves:
    return curves.RunCurves(name=name, scalars=synthetic_scalars(), vocab_size=1000,
                            valid_tokens=2000, **kw)


def test_prior_is_the_binary_entropy_of_the_replaced_fraction():
    assert prior_bce(0.15) == pytest.approx(0.4227, abs=5e-5)
    assert prior_bce(0.5) == pytest.approx(math.log(2))
    assert math.isnan(prior_bce(0.0)) and math.isnan(prior_bce(1.0))


def test_six_panels_with_their_series_and_reference_lines():
    fig = curves.build_figure([_run()])
    assert [ax.get_title() for ax in fig.axes] == list(curves.PANEL_TITLES)
    lines = _lines(fig)
    mlm, rtd, auc_ax, cos, lr, tps = fig.axes
    assert {l.get_gid() for l in mlm.lines} == {"mlm_train:run-a", "mlm_valid:run-a", "ln_v:run-a"}
    assert list(lines["mlm_train:run-a"].get_xdata()) == [1, 5, 10]
    assert list(lines["mlm_train:run-a"].get_ydata()) == [7.0, 6.5, 6.0]
    assert list(lines["mlm_valid:run-a"].get_ydata()) == [6.6, 6.1]
    assert list(lines["ln_v:run-a"].get_ydata()) == pytest.approx([math.log(1000)] * 2)
    assert lines["ln_v:run-a"].get_linestyle() == ":"
    # L_RTD: train, validation and the prior of p = 0.15 at every logged iteration
    rtd_lines = {l.get_gid(): l for l in rtd.lines}
    assert set(rtd_lines) == {"rtd_train:run-a", "rtd_valid:run-a", "prior:run-a"}
    assert list(rtd_lines["prior:run-a"].get_xdata()) == [1, 5, 10]
    assert list(rtd_lines["prior:run-a"].get_ydata()) == pytest.approx([0.4227] * 3, abs=5e-5)
    assert list(rtd_lines["rtd_train:run-a"].get_ydata()) == [0.69, 0.45, 0.40]
    # AUC with 0.5 and the band 0.5 ± 3σ, σ for 300 replaced / 1700 original tokens
    auc_lines = {l.get_gid(): l for l in auc_ax.lines}
    assert list(auc_lines["auc:run-a"].get_xdata()) == [5, 10]
    assert list(auc_lines["auc:run-a"].get_ydata()) == [0.55, 0.62]
    assert list(auc_lines["chance:0.5"].get_ydata()) == [0.5, 0.5]
    sd = math.sqrt(2001 / (12 * 300 * 1700))
    (band,) = [c for c in auc_ax.collections if c.get_gid() == "chance_band:run-a"]
    ys = np.concatenate([p.vertices[:, 1] for p in band.get_paths()])
    xs = np.concatenate([p.vertices[:, 0] for p in band.get_paths()])
    assert ys.min() == pytest.approx(0.5 - 3 * sd) and ys.max() == pytest.approx(0.5 + 3 * sd)
    assert xs.min() == 5 and xs.max() == 10
    cos_lines = {l.get_gid(): l for l in cos.lines}
    assert list(cos_lines["cos_generator:run-a"].get_ydata()) == [0.0, 0.2, 0.4]
    assert list(cos_lines["cos_discriminator:run-a"].get_ydata()) == [0.0, 0.1, 0.3]
    assert list(lr.lines[0].get_ydata()) == [0.0, 1e-3, 5e-4]
    assert list(tps.lines[0].get_ydata()) == [1000.0, 2000.0, 2100.0]
    # the legend names the run; the key of each panel says what its line styles are
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run-a"]
    assert "ln V = 6.91: uniform guess over V = 1000" in [
        t.get_text() for t in mlm.get_legend().get_texts()]
    assert f"chance: 0.5 ± 3σ (σ {sd:.4f})" in [
        t.get_text() for t in auc_ax.get_legend().get_texts()]


def test_the_runs_own_chance_sd_wins_over_the_computed_one():
    run = _run(auc_chance_sd={10: 0.01})
    assert curves.chance_sd(run, 10) == 0.01
    assert curves.chance_sd(run, 5) == pytest.approx(math.sqrt(2001 / (12 * 300 * 1700)))
    run.valid_tokens = None
    assert math.isnan(curves.chance_sd(run, 5))


def test_several_runs_one_colour_each_and_the_legend_names_them():
    b = _run("run-b")
    b.scalars["loss/mlm"] = {1: 8.0, 10: 5.0}
    fig = curves.build_figure([_run(), b])
    lines = _lines(fig)
    assert lines["mlm_train:run-a"].get_color() != lines["mlm_train:run-b"].get_color()
    assert lines["mlm_train:run-b"].get_color() == lines["prior:run-b"].get_color()
    assert list(lines["mlm_train:run-b"].get_ydata()) == [8.0, 5.0]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run-a", "run-b"]


def test_a_tag_not_logged_leaves_its_panel_saying_so():
    run = _run()
    del run.scalars["throughput/tokens_per_s"]
    run.vocab_size = None
    fig = curves.build_figure([run])
    assert not fig.axes[5].lines
    assert [t.get_text() for t in fig.axes[5].texts] == ["throughput/tokens_per_s not logged"]
    assert "ln_v:run-a" not in _lines(fig)


def test_a_directory_without_events_is_one_line_naming_it(tmp_path):
    with pytest.raises(UserInputError, match=f"^{tmp_path}: no TensorBoard events "):
        curves.load_run(str(tmp_path))
    with pytest.raises(UserInputError, match=f"^{tmp_path / 'nope'}: no such run directory$"):
        curves.load_run(str(tmp_path / "nope"))
    (tmp_path / "events.txt").write_text("x")  # a file given for the directory
    with pytest.raises(UserInputError, match=f"^{tmp_path / 'events.txt'}: a file, not a run "
                       "directory; pass a --save directory or its tensorboard/ folder$"):
        curves.load_run(str(tmp_path / "events.txt"))


def _finished_run(tmp_path):
    run = tmp_path / "run"
    write_events(run / "tensorboard", synthetic_scalars())
    (run / "config.json").write_text(json.dumps({
        "model": {"vocab_size": 1000}, "data": {"seq_length": 50},
        "train": {"eval_iters": 2, "global_batch_size": 20}}))
    return run


def test_end_of_run_curves_png_with_the_runs_exact_chance_sd(tmp_path):
    run = _finished_run(tmp_path)
    loaded = curves.load_run(str(run))
    assert loaded.name == "run" and loaded.vocab_size == 1000 and loaded.valid_tokens == 2000
    assert loaded.scalars["loss/mlm"] == {1: 7.0, 5: 6.5, 10: 6.0}
    line = curves.write_after_run(str(run), str(run / "tensorboard"),
                                  [(5, {VALID_AUC_CHANCE_SD: 0.02}), (10, {})])
    assert line == f"  curves:      {run}/curves.png"
    assert png_size(run / "curves.png") == (1500, 860)
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "curves.png", "tensorboard"]


def test_a_failure_to_draw_is_a_warning_line_and_leaves_nothing(tmp_path, monkeypatch):
    run = _finished_run(tmp_path)
    line = curves.write_after_run(str(tmp_path), str(tmp_path / "absent"), [])
    assert line == (f"warning: {tmp_path}/curves.png not drawn ({tmp_path}: no TensorBoard "
                    "events (events.out.tfevents.*) in it or in its tensorboard/ folder; pass a "
                    "--save directory of a run that has logged at least one iteration)")

    def half_written(self, fname, **kw):  # the disk fills up in the middle of the PNG
        with open(fname, "wb") as f:
            f.write(b"\x89PNG\r\n")
        raise OSError("No space left on device")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", half_written)
    line = curves.write_after_run(str(run), None, [])
    assert line == f"warning: {run}/curves.png not drawn (No space left on device)"
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "tensorboard"]


def test_the_summary_draws_with_the_tools_figure_and_names_the_command_without_it(tmp_path):
    """The route a run takes (rtd_scale/run.py's finish): the same picture and line as the tool's
    own ``write_after_run``; a package without its repository's tools/ prints the command."""
    run = _finished_run(tmp_path)
    assert str(CURVES_TOOL) == curves.__file__  # the file tools/plot_run.py draws with
    line = write_curves(str(run), str(run / "tensorboard"), [(5, {VALID_AUC_CHANCE_SD: 0.02})])
    assert line == f"  curves:      {run}/curves.png"
    assert png_size(run / "curves.png") == (1500, 860)
    (run / "curves.png").unlink()
    line = write_curves(str(run), None, [], tool=tmp_path / "absent" / "curves.py")
    assert line == f"  curves:      python tools/plot_run.py {run}"
    assert not (run / "curves.png").exists()
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('no module named matplotlib')\n")
    line = write_curves(str(run), None, [], tool=broken)
    assert line == (f"warning: {run}/curves.png not drawn ({broken}: no module named "
                    "matplotlib)")
