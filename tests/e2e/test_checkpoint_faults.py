"""Checkpoint faults through the real ``deepspeed`` launcher (2 ranks, ZeRO-3, tiny preset): a
damaged or half-written newest checkpoint, a SIGKILL during the save, a full disk (a real tmpfs),
an incomplete explicit tag, and a crafted pickle in each kind of checkpoint file.

The faults run through ``bench/faults.py`` at its smallest size (3 steps, a checkpoint after
each), so the benchmark keeps working; its rows give where each resume started and whether the
resumed steps equal the uninterrupted run's, bitwise (the ``--data-digest`` lines).
"""
from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.env import REPO, free_port

pytestmark = pytest.mark.e2e

FAULTS = ("truncate-optim", "truncate-rng", "latest-deleted-dir", "empty-latest",
          "kill-during-save", "disk-full")


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """(bench working directory, rows by fault) of a 3-step run with a checkpoint per step."""
    out = tmp_path_factory.mktemp("faults")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "faults.py"), "--steps", "3",
                        "--save-interval", "1", "--faults", ",".join(FAULTS), "--out", str(out),
                        "--json", str(out / "rows.json")],
                       cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["fault"]: row for row in json.loads((out / "rows.json").read_text())["rows"]}
    return out, rows


@pytest.mark.parametrize("fault,file", [("truncate-optim", "optim_states.pt"),
                                        ("truncate-rng", "rng_rank00001.pt")])
def test_a_truncated_file_in_the_newest_checkpoint_falls_back_exactly(matrix, fault, file):
    row = matrix[1][fault]
    assert (row["exit"], row["resumed_from"], row["bitwise"], row["tracebacks"]) == (0, 2, "yes", 0)
    assert row["said"].startswith(f"note: --load {matrix[0] / fault}: skipped global_step3 (")
    assert file in row["said"] and "its completion record says" in row["said"]
    assert row["said"].endswith("; resuming from global_step2")


def test_latest_naming_a_deleted_directory_takes_the_newest_complete_one(matrix):
    row = matrix[1]["latest-deleted-dir"]
    assert (row["exit"], row["resumed_from"], row["bitwise"], row["said"]) == (0, 2, "yes", "-")


def test_an_empty_latest_does_not_matter(matrix):
    """global_step3 has its record: it is complete whatever ``latest`` says (nothing left)."""
    row = matrix[1]["empty-latest"]
    assert (row["exit"], row["resumed_from"], row["steps_lost"]) == (0, 3, 0)


def test_sigkill_during_the_save_resumes_from_the_previous_checkpoint(matrix):
    row = matrix[1]["kill-during-save"]
    assert row["note"].startswith("killed after step 2; global_step2 record: no"), row
    assert (row["exit"], row["resumed_from"], row["steps_lost"], row["bitwise"]) == \
        (0, 1, 1, "yes")
    assert row["said"].startswith("note: --load") and "skipped global_step2 (" in row["said"]


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(matrix):
    row = matrix[1]["disk-full"]
    if row["resumed_from"] == "skipped":
        pytest.skip(row["note"])
    # the run itself: one error line, no traceback, naming the path and the space needed
    assert "the run exited 2 with 1 error line(s), 0 traceback(s): error: --save " in row["note"]
    assert "no space left on the device of" in row["note"]
    assert "free at least" in row["note"] and "the partial global_step2 was removed" in row["note"]
    assert row["note"].endswith("takes global_step1")
    assert (row["exit"], row["resumed_from"], row["steps_lost"], row["bitwise"]) == \
        (0, 1, 1, "yes")


# ------------------------------------------------------------------- refused in one line ----

def launch_load(save: Path, extra=()) -> subprocess.CompletedProcess:
    data = save.parent / "data"
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port",
           str(free_port()), "rtd_scale/pretrain.py", "--ds_config", "ds_configs/zero3.json",
           "--preset", "tiny", "--data-path", str(data / "wiki_text_document"),
           "--tokenizer-model", str(data / "spm.model"), "--save", str(save), "--load",
           str(save), "--train-iters", "4", "--seq-length", "64", "--micro-batch-size", "4",
           "--global-batch-size", "16", "--seed", "11", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]


class Payload:
    """Unpickling it creates the marker file: code that runs."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# one file of each format through the launcher (a torch zip file, a bare pickle); every kind of
# checkpoint file in both formats: tests/unit/test_checkpoint.py
@pytest.mark.parametrize("pattern,zipped", [("zero_pp_rank_0_*_model_states.pt", True),
                                            ("rng_rank00001.pt", False)])
def test_a_crafted_pickle_in_each_checkpoint_file_is_refused_and_never_runs(
        matrix, tmp_path, pattern, zipped):
    """The completion record is rewritten to the crafted file's size, as an attacker would, so
    the refusal comes from the weights-only unpickling itself: the globals check of a torch zip
    file, ``torch.load(weights_only=True)`` of a bare pickle."""
    import torch

    save = matrix[0] / f"crafted-{pattern.split('_')[0]}{len(pattern)}"
    shutil.rmtree(save, ignore_errors=True)
    shutil.copytree(matrix[0] / "reference", save)
    marker = tmp_path / "marker"
    target = next((save / "global_step3").glob(pattern))
    if zipped:
        torch.save({"x": Payload(str(marker)), "module": {}}, target)
    else:
        with open(target, "wb") as f:
            pickle.dump({"x": Payload(str(marker))}, f, protocol=2)
    record_path = save / "global_step3" / "rtd_complete.json"
    record = json.loads(record_path.read_text())
    record["files"][target.name] = target.stat().st_size
    record_path.write_text(json.dumps(record))

    r = launch_load(save)
    assert r.returncode != 0
    assert error_lines(r) == [f"error: {target}: refused to load: it holds Python objects other "
                              "than tensors and DeepSpeed's state (GLOBAL io.open), which could "
                              "run code when read; replace it with a trusted copy or resume from "
                              "another checkpoint (--load DIR/global_stepN)"], r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    assert not marker.exists()


def test_an_incomplete_explicit_checkpoint_is_a_one_line_error(matrix):
    save = matrix[0] / "explicit"
    shutil.rmtree(save, ignore_errors=True)
    shutil.copytree(matrix[0] / "reference", save)
    (save / "global_step3" / "rtd_complete.json").unlink()
    r = launch_load(save, ["--ckpt-step", "3"])
    assert r.returncode != 0
    assert error_lines(r) == [f"error: --load {save}/global_step3: checkpoint global_step3 is "
                              "incomplete (no completion record (the save did not finish)); "
                              f"complete ones there: global_step2, global_step1 (--load {save} "
                              "takes global_step2)"], r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
