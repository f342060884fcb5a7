"""Real faults through the real `deepspeed` launcher, restarted by tools/supervise.py: one run
of 10 iterations (2 ranks, ZeRO-3, the tiny preset, a checkpoint every 3) meets, with the
test-only hook (RTD_FAULTS, rtd_scale/training/faults.py):

- a segfault of rank 1 at iteration 5: restarted from global_step3, and iteration 4, which ran
  before and after the restart, has the same losses, samples and masks to the bit (its
  --data-digest lines);
- a SIGSTOP of rank 1 at iteration 8: the heartbeat (step budget 10 s) finds it within the
  budget and a poll, the stack file has a section per rank (rank 0's stack in its collective,
  rank 1 named as stopped), one line names rank 1, the run restarts from global_step6 and
  iteration 7 repeats exactly;
- rank 1 sleeping 1.5 s before each of iterations 9 and 10: named as a straggler in those log
  lines, in TensorBoard and in the summary; iterations 1–8 name no rank (the control).

Each restart is one [rtd-supervise] line, a restarts.jsonl record and a TensorBoard event in
the restarted run. The user error (no restart) and the crash loop (stopped after K) of the
same tool: tests/tools/test_supervise.py; the Slurm job: tests/e2e/test_slurm.py and
tests/e2e/test_multinode.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import wandb_history
from tests.helpers.env import REPO, free_port
from tests.helpers.launcher import common, scalars

pytestmark = pytest.mark.e2e

ITERS, STEP_BUDGET = 10, 10
FAULTS = "segv@5:1!once,stop@8:1!once,sleep=1.5@9:1"
LINE = re.compile(r"^ iteration\s+(\d+)/\s*\d+ \|.*$", re.M)


@pytest.fixture(scope="module")
def run(wiki_shards, tmp_path_factory):
    work = tmp_path_factory.mktemp("unattended")
    save, digest = work / "run", work / "digest.jsonl"
    cmd = [sys.executable, str(REPO / "tools" / "supervise.py"), "--backoff", "1", "--",
           str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2",
           "--master_port", str(free_port()), "rtd_scale/pretrain.py",
           *common(wiki_shards, save, ITERS, ["--data-digest", str(digest), "--eval-iters", "0",
                                              "--ft-rank-section-timeouts",
                                              f"setup:300,step:{STEP_BUDGET}",
                                              "--wandb-project", "rtd-e2e"],
                   save_interval=3)]
    t0 = time.monotonic()
    wandb_home = str(work / "wandb_home")
    env = {**os.environ, "RTD_FAULTS": FAULTS, "WANDB_MODE": "offline",
           **{var: wandb_home for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}}
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    seconds = time.monotonic() - t0
    print(f"\n[unattended] supervised run, 2 restarts: {seconds:.1f} s")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r, save, digest


def _supervise_lines(r) -> list[str]:
    return [line for line in r.stdout.splitlines() if line.startswith("[rtd-supervise ")]


def test_each_fault_is_one_restart_line_and_record(run):
    r, save, _ = run
    lines = _supervise_lines(r)
    assert len(lines) == 2, r.stdout[-3000:]
    assert re.fullmatch(r"\[rtd-supervise [\d-]+ [\d:]+\] restart 1 \(1 of 3 here\): crash: "
                        r"rank 1 died of SIGSEGV at iteration 5; resuming from global_step3 in "
                        r"1 s; \d+\.\d min of training since it is redone", lines[0]), lines[0]
    assert "hang: rank 1 stopped beating at iteration 8; every rank's stack: " in lines[1]
    assert "resuming from global_step6 in 2 s" in lines[1]
    records = [json.loads(x) for x in (save / "restarts.jsonl").read_text().splitlines()]
    assert [(x["restart"], x["cause"], x["rank"], x["iteration"], x["resume_from"])
            for x in records] == [(1, "crash", 1, 5, "global_step3"),
                                  (2, "hang", 1, 8, "global_step6")]
    # the launcher's status: 256 - SIGSEGV (DeepSpeed's launch.py), then the heartbeat's 75 for
    # the hang (the reporter's own, not 247: the SIGKILL of the stopped rank it ended)
    assert [x["status"] for x in records] == [245, 75]
    assert r.stdout.count("resumed from ") == 2


def test_losses_after_each_restart_equal_the_first_run_of_the_same_steps(run):
    _, _, digest = run
    rows: dict[int, list[str]] = {}
    for line in digest.read_text().splitlines():
        rows.setdefault(json.loads(line)["step"], []).append(line)
    assert sorted(rows) == list(range(1, ITERS + 1))
    # iteration 4 ran before the segfault and again after it; 7 before the hang and after it
    assert {s: len(v) for s, v in rows.items() if len(v) > 1} == {4: 2, 7: 2}
    for step in (4, 7):
        first, again = (json.loads(x) for x in rows[step])
        assert again == first, step  # losses (hex floats), sample ids, input and mask hashes


def test_the_stopped_rank_is_found_within_the_budget_and_named_in_every_ranks_stack_file(run):
    r, save, _ = run
    (record_path,) = (save / "hangs").glob("iteration8-*/hang.json")
    record = json.loads(record_path.read_text())
    assert record["ranks"] == [1] and record["answered"] == [0] and record["section"] == "step"
    poll = STEP_BUDGET / 20
    print(f"\n[unattended] hang found {record['waited_s']:.1f} s after rank 1's last beat "
          f"(budget {STEP_BUDGET} s)")
    # over the budget (recorded to 0.1 s, so 10.04 s reads 10.0) and within a poll and a second
    assert STEP_BUDGET <= record["waited_s"] <= STEP_BUDGET + poll + 1.0, record
    stacks = Path(record["stacks"]).read_text()
    rank0, rank1 = stacks.split("=== rank 0 ===")[1].split("=== rank 1 ===")
    assert "torch/distributed/distributed_c10d.py" in rank0  # waiting for rank 1
    assert "rtd_scale/training/loop.py" in rank0
    assert rank1.strip().startswith("rank 1: no stack: did not answer (stopped, dead, or "
                                    "holding the GIL in native code); last seen host ")
    assert "iteration 8 (stopped: /proc state T)" in rank1
    hang = [line for line in r.stderr.splitlines() if line.startswith("error: hang:")]
    assert hang == [f"error: hang: rank 1 stopped beating at iteration 8 ("
                    f"{record['waited_s']:.0f} s without a finished step, the step budget is "
                    f"{STEP_BUDGET} s; --ft-rank-section-timeouts); every rank's Python stack: "
                    f"{record['stacks']}"]


def test_each_restarted_run_writes_its_event(run):
    _, save, _ = run
    s = scalars(str(save / "tensorboard"))
    assert s["restarts/count"] == {3: 1.0, 6: 2.0}  # at the step each resumed from
    assert s["restarts/failed_iteration"] == {3: 5.0, 6: 8.0}
    assert s["restarts/rank"] == {3: 1.0, 6: 1.0}
    lost = s["restarts/time_lost_s"]
    print(f"\n[unattended] time lost per restart (checkpoint to restarted run's start): "
          f"{lost[3]:.1f} s (segfault), {lost[6]:.1f} s (hang)")
    assert 0 < lost[3] < 120 and STEP_BUDGET < lost[6] < 120, lost
    # the same event in W&B (offline), each in its restarted run's file: the counts, and the
    # cause as the supervisor's line, at the step the run resumed from
    files = sorted((save / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"),
                   key=lambda f: f.stat().st_mtime)
    assert len(files) == 3, files  # the first run and its two restarts
    lines = _supervise_lines(run[0])
    for f, step, count in zip(files[1:], (3, 6), (1.0, 2.0)):
        rows = [row for row in wandb_history.history(f) if "restarts/count" in row
                or "restarts/cause" in row]
        assert {row["_step"] for row in rows} == {step}, rows
        merged = {k: v for row in rows for k, v in row.items()}
        assert merged["restarts/count"] == count and merged["restarts/rank"] == 1.0, merged
        assert [ln for ln in lines if ln.endswith("] " + merged["restarts/cause"])], (merged, lines)


def test_the_slow_rank_is_named_and_no_rank_before_it(run):
    r, save, _ = run
    final = {}
    for m in LINE.finditer(r.stdout):  # the last line of each iteration (after the restarts)
        final[int(m[1])] = m[0]
    assert sorted(final) == list(range(1, ITERS + 1))
    for step, line in final.items():
        if step >= 9:
            assert re.search(r" stragglers \(< 0\.70 of the median peer\): rank 1 0\.\d\d \|$",
                             line), line
        else:
            assert "stragglers" not in line, line  # the control: nobody is slow
    s = scalars(str(save / "tensorboard"))
    assert {k: v for k, v in s["stragglers/count"].items() if k >= 9} == {9: 1.0, 10: 1.0}
    assert s["stragglers/slowest_rank"][9] == 1.0
    assert s["stragglers/slowest_relative_speed"][10] < 0.7
    assert all(v == 0 for k, v in s["stragglers/count"].items() if k < 9)
    assert re.search(r"^  stragglers \(own work below 0\.70 of the median peer's\): rank 1 in "
                     r"2 of \d+ log intervals \(lowest 0\.\d\d\)$", r.stdout, re.M), \
        r.stdout[-2000:]
