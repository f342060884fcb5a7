"""``tools/export_hf.py --output`` onto an earlier export, on a real 2-rank run.

A tiny run saves global_step1 … global_step3; the tool exports the newest (global_step3), then
``--tag global_step1`` onto the same directory is refused in one line naming the directory and
``--overwrite`` (the export untouched); with ``--overwrite`` it replaces it (other weights, no
temporary sibling left) and says, once, that it exports global_step1 and that a newer
checkpoint exists — in export words, none of ``--load``'s words about resuming training. Then a
NaN written into global_step2 in place (the file keeps its size) makes its export refuse in one
line naming the damaged file and the fix, writing nothing, as training's ``--load`` does (both
run ``training/checkpoint/checks.py``'s ``CHECKS``). Last, a run directory is never taken for
an export (it holds a ``config.json`` too): ``--output RUN --overwrite`` is refused, and so is
``--export-hf`` onto the run's own ``--save``, before anything is built, the run untouched.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.damage import nan_into_first_float
from tests.helpers.env import REPO
from tests.helpers.launcher import common, launch

pytestmark = pytest.mark.e2e


def _tool(*args):
    return subprocess.run([sys.executable, "tools/export_hf.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_export_onto_an_earlier_export_needs_overwrite(wiki_shards, tmp_path):
    run = tmp_path / "run"
    r = launch(common(wiki_shards, run, 3, ["--eval-iters", "0"], ds_config="ds_configs/zero1.json",
                      save_interval=1, micro_batch_size=2, global_batch_size=4,
                      lr_warmup_iters=1, seed=7))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = tmp_path / "hf"
    r = _tool("--load", str(run), "--output", str(out))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count(f"exporting global_step3 from {run}\n") == 1
    step3 = (out / "model.safetensors").read_bytes()

    r = _tool("--load", str(run), "--tag", "global_step1", "--output", str(out))
    assert r.returncode == 1
    assert r.stderr == (f"error: --output {out}: already holds an export; pass --overwrite to "
                        "replace it, or a new directory\n")
    assert (out / "model.safetensors").read_bytes() == step3

    r = _tool("--load", str(run), "--tag", "global_step1", "--output", str(out), "--overwrite")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if not ln.startswith("[")]  # DeepSpeed's log
    assert lines[:2] == [f"exporting global_step1 from {run}",
                         f"note: {run} has a newer complete checkpoint, global_step3; exporting "
                         "global_step1 as --tag names"], lines
    assert lines[2].startswith(f"exported {run}/global_step1: {out} "), lines
    assert len(lines) == 3, lines
    assert "resum" not in r.stdout + r.stderr and "--load" not in r.stdout
    assert (out / "model.safetensors").read_bytes() != step3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]

    # export loads with training's checks: a checkpoint damaged in place is refused, not exported
    step2 = run / "global_step2"
    damaged = sorted(step2.glob("*model_states.pt"))
    for states in damaged:
        nan_into_first_float(str(states))
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")}
    for output in (tmp_path / "hf2", out):  # a new directory, and the earlier export
        extra = ("--overwrite",) if output == out else ()
        r = _tool("--load", str(run), "--tag", "global_step2", "--output", str(output), *extra)
        assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-3000:]
        err = r.stderr.strip().splitlines()
        assert len(err) == 1, r.stderr[-3000:]
        # each rank counts its own files; the lowest rank holding a damaged one names it
        assert err[0].startswith(f"error: {damaged[0]}: damaged: it holds 1 inf/NaN value(s) "
                                 "although its size matches the completion record (the loaded "
                                 "weights hold "), err[0]
        assert err[0].endswith("); export an earlier checkpoint (--tag global_stepN) or delete "
                               f"{step2}"), err[0]
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "hf2").exists()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*")} == before  # nothing written

    # a run directory is never an export's: refused with --overwrite too, the run untouched;
    # and --export-hf onto this run's own --save before anything is built
    kept = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    r = _tool("--load", str(run), "--output", str(run), "--overwrite")
    assert r.returncode == 1 and r.stderr == (
        f"error: --output {run}: holds a training run (global_step3); an export there would "
        "replace it: pass a new directory, e.g. hf/run\n")
    mine = tmp_path / "mine"
    r = launch(common(wiki_shards, mine, 1, ["--eval-iters", "0", "--export-hf", str(mine)],
                      ds_config="ds_configs/zero1.json"), ranks=1)
    assert r.returncode == 2 and (
        f"error: --export-hf {mine}: holds --save {mine}, whose checkpoints the export would "
        "replace; pass another directory, e.g. hf/mine\n") in r.stderr, r.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == kept
