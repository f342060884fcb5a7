"""tools/plot_run.py and tools/screenshot_tensorboard.sh as a user runs them: runs' TensorBoard
events → one PNG of curves, or a headless-Chromium screenshot of TensorBoard; bad run
directories are one line naming them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import REPO
from tests.helpers.images import png_size, synthetic_scalars, write_events
from tests.helpers.slurm import debian_program, shellcheck

# installs shellcheck and chromium with apt (apt's lock): one machine-wide module at a time
# (tests/conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("machine-wide")]


def _plot(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "plot_run.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_two_runs_on_one_png_and_one_run_into_its_own_directory(tmp_path):
    a, b = tmp_path / "run-a", tmp_path / "run-b"
    write_events(a / "tensorboard", synthetic_scalars())
    write_events(b, {"loss/mlm": {1: 7.5, 2: 7.0}})  # a TensorBoard folder itself, little logged
    out = tmp_path / "pictures" / "ab.png"
    r = _plot(a, b, "--output", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == f"wrote {out} (run-a, run-b)\n"
    assert png_size(out) == (1500, 860)
    r = _plot(a)
    assert r.returncode == 0, r.stderr[-3000:]
    assert png_size(a / "curves.png") == (1500, 860)


def test_a_run_directory_without_events_is_one_line_naming_it(tmp_path):
    good, empty = tmp_path / "good", tmp_path / "empty"
    write_events(good / "tensorboard", synthetic_scalars())
    empty.mkdir()
    r = _plot(good, empty, "--output", tmp_path / "x.png")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"error: {empty}: no TensorBoard events (events.out.tfevents.*) in it or "
                        "in its tensorboard/ folder; pass a --save directory of a run that has "
                        "logged at least one iteration\n")
    assert not (tmp_path / "x.png").exists()
    r = _plot(good, good)
    assert r.returncode == 1
    assert r.stderr == "error: 2 run directories on one figure: name the picture with --output FILE.png\n"


SCREENSHOT = REPO / "tools" / "screenshot_tensorboard.sh"


def _screenshot(*args, **env) -> subprocess.CompletedProcess:
    tensorboard = str(Path(sys.executable).with_name("tensorboard"))
    return subprocess.run(["bash", str(SCREENSHOT), *map(str, args)], capture_output=True,
                          text=True, timeout=180,
                          env={**os.environ, "TENSORBOARD": tensorboard, **env})


def test_screenshot_script_passes_shellcheck_and_refuses_a_logdir_without_events(tmp_path):
    r = subprocess.run([shellcheck(), str(SCREENSHOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    r = _screenshot(tmp_path, tmp_path / "x.png")
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == (f"error: {tmp_path}: no TensorBoard events (events.out.tfevents.*) in "
                        "it; pass a run's tensorboard/ folder\n")
    r = _screenshot(tmp_path / "nope", tmp_path / "x.png")
    assert r.stderr == (f"error: {tmp_path / 'nope'}: no such directory (LOGDIR is a run's "
                        "tensorboard/ folder)\n")
    assert not (tmp_path / "x.png").exists()


def test_screenshot_of_a_runs_scalars_in_headless_chromium(tmp_path):
    debian_program(("chromium", "chromium-browser"), "chromium")  # the script finds it on PATH
    run = tmp_path / "run-a"
    write_events(run / "tensorboard", synthetic_scalars())
    out = tmp_path / "shots" / "scalars.png"
    r = _screenshot(run / "tensorboard", out, WINDOW="800,600")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == f"wrote {out} (TensorBoard scalars of run-a, {run / 'tensorboard'})\n"
    assert png_size(out) == (800, 600)
    assert sorted(p.name for p in out.parent.iterdir()) == ["scalars.png"]  # no temporary left
