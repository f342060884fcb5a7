"""The Slurm launchers on a real Slurm: a single-node cluster on localhost started from Debian
packages by tools/slurm_local_start.sh (stopped again at the end of this module).

- slurm/preprocess.sh as a 2-task array job makes the shards the training jobs read;
- slurm/pretrain_large.sh with the small-test overrides (tiny preset, CPU, 2 tasks) trains 20
  steps and checkpoints, meeting on the way a SIGSTOP of rank 0 (the test-only fault hook,
  RTD_FAULTS): the hang is found within the heartbeat's budget with every rank's stack, the run
  is restarted in the same allocation from the newest checkpoint, and the job completes by
  itself (a segfault's restart on Slurm: tests/e2e/test_multinode.py);
- a user-input error stops a job in one line with no restart; a crash loop (the same iteration
  failing RTD_MAX_FAILURES_AT_STEP times) stops it in one line naming the iteration and the
  rank's log;
- a second job, in two phases (BERT's schedule: steps 1-10 at 32 tokens and global batch 32,
  11-20 at 64 tokens and batch 16), gets the preemption signal in phase 1 (scancel
  --signal=USR1 --batch, as Slurm's --signal=B:USR1@600 would send it): it saves, requeues
  itself, resumes in phase 1 at the saved step and goes on to phase 2 in the same job, with the
  AdamW step count and the learning-rate schedule of one run.

The Slurm tests skip only when Slurm cannot be installed (no root/sudo, no apt-get, no package
mirror); any other failure fails. The script checks (bash -n, shellcheck) need no Slurm.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.env import REPO, TEST_DATA
from tests.helpers.launcher import adam_steps, scalars
from tests.helpers.slurm import SlurmClient, shellcheck, wait_for

# installs Slurm with apt and runs its daemons on fixed ports: one machine-wide module at a
# time (tests/conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("machine-wide")]

SCRIPTS = sorted([*REPO.glob("slurm/*.sh"), *REPO.glob("slurm/lib/*.sh"),
                  REPO / "tools" / "slurm_local_start.sh", REPO / "tools" / "slurm_local_stop.sh"])
SLURM_HOME = Path(os.environ.get("RTD_SLURM_HOME", "/var/tmp/rtd_scale_slurm"))
ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*(\d+) \|.*\| total loss: (\S+) \|", re.M)


# ---------------------------------------------------------------- the scripts, without Slurm ----

def test_scripts_parse():
    assert len(SCRIPTS) >= 7, SCRIPTS
    for script in SCRIPTS:
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{script}: {r.stderr}"


def test_scripts_passshellcheck():
    r = subprocess.run([shellcheck(), "-x", *map(str, SCRIPTS)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _arithmetic(world: int, tp: int, global_batch: int, micro: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "RTD_REPO": str(REPO), "RTD_PRESET": "tiny", "RTD_TRAIN_ITERS": "1",
           "RTD_GLOBAL_BATCH": str(global_batch), "RTD_MICRO_BATCH": str(micro),
           "RTD_SEQ_LENGTH": "64", "RTD_LR": "1e-3", "RTD_WARMUP_ITERS": "0"}
    code = (f'source "{REPO}/slurm/lib/pretrain_job.sh"; '
            f'rtd_batch_arithmetic {world} {tp} {global_batch} {micro}')
    return subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True,
                          timeout=30)


def test_batch_arithmetic_for_any_node_count():
    # micro-batch × accumulation × data-parallel size = 8192
    for nodes, micro, want in ((8, 8, "64 16"), (1, 8, "8 128"), (16, 8, "128 8"),
                               (128, 8, "1024 1"), (2, 16, "16 32")):
        r = _arithmetic(8 * nodes, 1, 8192, micro)
        assert r.returncode == 0 and r.stdout.split() == want.split(), (nodes, r.stdout, r.stderr)
    assert _arithmetic(64, 2, 8192, 8).stdout.split() == ["32", "32"]  # TP 2: DP = 32
    r = _arithmetic(48, 1, 8192, 8)  # 6 nodes × 8 GPUs: 8192 / 48 is not an integer
    assert r.returncode == 1
    assert "RTD_GLOBAL_BATCH=8192 is not divisible by the data-parallel size 48" in r.stderr
    r = _arithmetic(64, 1, 8192, 3)
    assert r.returncode == 1
    assert "RTD_MICRO_BATCH=3 does not divide the 128 samples" in r.stderr
    assert "micro-batch sizes that do: 1 2 4 8 16 32 64 128" in r.stderr
    r = _arithmetic(6, 4, 8192, 8)
    assert r.returncode == 1 and "6 tasks are not divisible by RTD_TP=4" in r.stderr


# ----------------------------------------------------------------------- a real local Slurm ----

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@pytest.fixture(scope="module")
def slurm():
    """Start (or reuse) the local Slurm; yield the environment for its commands; stop it."""
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(REPO / "tools" / "slurm_local_start.sh")],
                       capture_output=True, text=True, timeout=900)
    if r.returncode == 3:  # the only skip: Slurm cannot be installed on this machine
        pytest.skip((r.stderr.strip().splitlines() or ["Slurm cannot be installed here"])[-1])
    assert r.returncode == 0, r.stdout + r.stderr
    conf = re.search(r"^export SLURM_CONF=(\S+)$", r.stdout, re.M).group(1)
    print(f"\n[slurm] install + start: {time.monotonic() - t0:.1f} s")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = conf
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}:/usr/sbin:/sbin"
    pid_files = [SLURM_HOME / "run" / "slurmctld.pid", SLURM_HOME / "run" / "slurmd.pid",
                 SLURM_HOME / "munged.started"]
    try:
        yield env
    finally:
        pids = [int(p.read_text()) for p in pid_files if p.is_file() and p.read_text().strip()]
        r = subprocess.run(["bash", str(REPO / "tools" / "slurm_local_stop.sh")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        deadline = time.monotonic() + 15
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if _alive(p)], f"daemons left running: {pids}"


def _venv() -> str:
    venv = Path(sys.executable).parent.parent
    return str(venv if (venv / "bin" / "activate").is_file() else REPO / ".venv")


@pytest.fixture(scope="module")
def slurm_shards(slurm, wiki_shards, tmp_path_factory):
    """Shards made by slurm/preprocess.sh: an array job of 2 tasks over 2 input files.
    Returns (env for slurm/pretrain_*.sh with the small-test overrides, shard dir)."""
    tokenizer, _ = wiki_shards
    work = tmp_path_factory.mktemp("slurm")
    lines = (TEST_DATA / "wiki_sample.jsonl").read_text().splitlines(keepends=True)
    half = len(lines) // 2
    (work / "a.jsonl").write_text("".join(lines[:half]))
    (work / "b.jsonl").write_text("".join(lines[half:]))
    (work / "inputs.txt").write_text(f"{work / 'a.jsonl'}\n{work / 'b.jsonl'}\n")
    shard_dir = work / "shards"
    env = {**slurm, "RTD_TOKENIZER": tokenizer, "RTD_SHARD_DIR": str(shard_dir),
           "RTD_VENV": _venv()}
    client = SlurmClient(env)
    t0 = time.monotonic()
    job = client.sbatch(work, "--array=0-1", "--cpus-per-task=1",
                        str(REPO / "slurm" / "preprocess.sh"), "inputs.txt")
    try:
        wait_for("the preprocessing array job", lambda: not client.queued(job), 300)
    finally:
        client.run("scancel", str(job), check=False, timeout=30)
    print(f"[slurm] preprocess array job: {time.monotonic() - t0:.1f} s")
    for task in (0, 1):
        out = (work / f"slurm-rtd-preprocess-{job}_{task}.out").read_text()
        assert f"task {task} of 2" in out and "done: " in out, out
    env.update(RTD_PRESET="tiny", RTD_DEVICE="cpu", RTD_BF16="0", RTD_EXPECT_VOCAB="",
               RTD_GLOBAL_BATCH="16", RTD_MICRO_BATCH="4", RTD_SEQ_LENGTH="64",
               RTD_WARMUP_ITERS="5", RTD_LOG_INTERVAL="1", RTD_SEED="7")
    return env, shard_dir


def _output_name(path: Path) -> str:
    """slurm/preprocess.sh's dataset name for an input: its stem and a hash of its real path."""
    digest = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:10]
    return f"{path.name.split('.')[0]}-{digest}_text_document"


def test_preprocess_array_job(slurm_shards):
    _, shard_dir = slurm_shards
    names = sorted(p.name for p in shard_dir.iterdir())
    datasets = [_output_name(shard_dir.parent / f) for f in ("a.jsonl", "b.jsonl")]
    assert names == sorted([f"{d}_00000.{ext}" for d in datasets
                            for ext in ("bin", "idx", "meta.json")]
                           + [f"{d}.manifest.json" for d in datasets])


def test_mpi_world_through_srun_pmi2(slurm):
    """The local Slurm launches MPI programs: srun --mpi=pmi2 gives mpi4py (PyPI mpich) a world
    of 2. (A wrong --mpi silently gives each rank a world of 1, hence the size check.)"""
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; print('rank', c.Get_rank(), 'of', c.Get_size())"
    out = SlurmClient(slurm).run("srun", "--ntasks=2", "--mpi=pmi2", sys.executable, "-c", code,
                                 timeout=120).stdout
    assert sorted(out.split("\n")[:2]) == ["rank 0 of 2", "rank 1 of 2"], out


LARGE = str(REPO / "slurm" / "pretrain_large.sh")
SMALL_TEST = ("--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0")  # override #SBATCH lines


def test_impossible_batch_arithmetic_stops_the_job(slurm_shards, tmp_path):
    env, _ = slurm_shards
    env = {**env, "RTD_GLOBAL_BATCH": "15", "RTD_TRAIN_ITERS": "2", "RTD_SAVE": str(tmp_path / "r")}
    client = SlurmClient(env)
    job = client.sbatch(tmp_path, *SMALL_TEST, LARGE)
    wait_for("the job to end", lambda: not client.queued(job), 120)
    state = client.job(job)
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "1:0", state
    out = (tmp_path / f"slurm-rtd-debertav3-large-{job}.out").read_text()
    assert "error: global batch RTD_GLOBAL_BATCH=15 is not divisible by the data-parallel size 2" \
        in out, out
    assert not (tmp_path / "r").exists()


def test_pretrain_large_small_overrides_two_ranks(slurm_shards, tmp_path):
    """The job completes by itself through a SIGSTOP of rank 0 at iteration 12, restarted from
    the checkpoint at 10."""
    env, shard_dir = slurm_shards
    save = tmp_path / "run"
    env = {**env, "RTD_TRAIN_ITERS": "20", "RTD_SAVE_INTERVAL": "10", "RTD_SAVE": str(save),
           "RTD_FAULTS": "stop@12:0!once", "RTD_RESTART_BACKOFF": "1",
           "RTD_EXTRA_ARGS": f"--ft-rank-section-timeouts setup:300,step:{STEP_BUDGET} "
                             "--data-digest " + str(tmp_path / "digest.jsonl")}
    client = SlurmClient(env)
    t0 = time.monotonic()
    job = client.sbatch(tmp_path, *SMALL_TEST, LARGE)  # submitted from outside the repository
    log = tmp_path / f"slurm-rtd-debertav3-large-{job}.out"
    try:
        wait_for("the training job to end", lambda: not client.queued(job), 480, log)
    finally:
        client.run("scancel", str(job), check=False, timeout=30)
    print(f"[slurm] 20-step training job: {time.monotonic() - t0:.1f} s")
    out = log.read_text()
    state = client.job(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, out[-3000:])
    assert f"job {job} (restart 0) on 1 node(s) localhost: 2 tasks" in out
    assert "micro-batch 4 × accumulation 2 × data-parallel 2 = global 16" in out
    assert "starting fresh" in out
    running = [line for line in out.splitlines() if "] running: srun" in line]
    assert len(running) == 2 and "--load" not in running[0], running  # a fresh start loads nothing
    assert all(f"--load {save} " in line for line in running[1:]), running
    a, b = (_output_name(shard_dir.parent / f) for f in ("a.jsonl", "b.jsonl"))
    assert f"--data-path {shard_dir}/{a} {shard_dir}/{b} " in out
    assert re.search(r"world 2 = TP 1 ×.* DP 2", out), out[-3000:]  # 2 ranks joined one group
    steps = [(int(m[1]), int(m[2]), float(m[3])) for m in ITERATION.finditer(out)]
    # 11 ran before the hang in 12 and again after it
    assert [s for s, _, _ in steps] == [*range(1, 12), *range(11, 21)], out[-3000:]
    assert all(total == 20 and math.isfinite(loss) for _, total, loss in steps), steps
    _assert_restarts(out, save, tmp_path / "digest.jsonl")
    assert (save / "latest").read_text().strip() == "global_step20"
    for tag in ("global_step10", "global_step20"):  # every rank wrote its own RNG state
        assert sorted(p.name for p in (save / tag).glob("rng_rank*.pt")) == \
            ["rng_rank00000.pt", "rng_rank00001.pt"]
    assert (save / "config.json").is_file() and list((save / "tensorboard").glob("events.*"))
    assert "training finished" in out

    # the same submission again finds the final checkpoint and stops at once
    again = client.sbatch(tmp_path, *SMALL_TEST, LARGE)
    wait_for("the second submission to end", lambda: not client.queued(again), 120)
    assert client.job(again)["JobState"] == "COMPLETED"
    out = (tmp_path / f"slurm-rtd-debertav3-large-{again}.out").read_text()
    assert "already holds the final checkpoint (global_step20): nothing to do" in out, out
    assert "running: srun" not in out


STEP_BUDGET = 10  # the heartbeat's step budget in the fault tests, seconds


def _assert_restarts(out: str, save: Path, digest: Path) -> None:
    """The hang of test_pretrain_large_small_overrides_two_ranks: one line, the stack file with
    every rank, the restart, the repeated iteration bitwise equal, the restart's event."""
    restarts = [line.split("] ", 1)[1] for line in out.splitlines()
                if line.startswith("[rtd-slurm ") and "] restart " in line]
    assert len(restarts) == 1, out[-3000:]
    assert restarts[0].startswith(
        f"restart 1 (1 of 3 here): hang: rank 0 stopped beating at iteration 12; its log: "
        f"{save}/logs/rank0.log; every rank's stack: {save}/hangs/iteration12-"), restarts[0]
    assert "resuming from global_step10 in 1 s" in restarts[0]
    (record,) = [json.loads(p.read_text()) for p in (save / "hangs").glob("*/hang.json")]
    assert record["ranks"] == [0] and STEP_BUDGET < record["waited_s"] < STEP_BUDGET + 2
    print(f"\n[slurm] hang found {record['waited_s']:.1f} s after rank 0's last beat")
    stacks = Path(record["stacks"]).read_text()
    assert "=== rank 0 ===\nrank 0: no stack: did not answer" in stacks
    assert "=== rank 1 ===\nrank 1 (host " in stacks and "distributed_c10d.py" in stacks
    assert f"error: hang: rank 0 stopped beating at iteration 12 (" in out
    assert "[rtd-fault] rank 0: injecting stop@12:0!once" in (save / "logs" / "rank0.log"
                                                              ).read_text()
    rows: dict[int, list[str]] = {}
    for line in digest.read_text().splitlines():
        rows.setdefault(json.loads(line)["step"], []).append(line)
    assert {s: len(v) for s, v in rows.items() if len(v) > 1} == {11: 2}
    assert json.loads(rows[11][0]) == json.loads(rows[11][1])
    tb = scalars(str(save / "tensorboard"))
    assert tb["restarts/count"] == {10: 1.0} and tb["restarts/failed_iteration"] == {10: 12.0}
    print(f"[slurm] time lost to the hang: {tb['restarts/time_lost_s'][10]:.1f} s")


def test_a_user_error_and_a_crash_loop_stop_the_job_in_one_line(slurm_shards, tmp_path):
    """With them, a third job stopped by SIGTERM to its batch shell (kill, scancel
    --signal=TERM --batch): the tasks save at the end of their step, no restart, no requeue,
    one line naming the checkpoint, exit status 143."""
    env, _ = slurm_shards
    client = SlurmClient(env)
    jobs = {}
    for name, extra in (("user", {"RTD_EXTRA_ARGS": "--mask-prob 2"}),
                        ("loop", {"RTD_FAULTS": "exit=3@2:1", "RTD_MAX_FAILURES_AT_STEP": "2",
                                  "RTD_RESTART_BACKOFF": "0"}),
                        ("stop", {"RTD_FAULTS": "sleep=0.25@1:*", "RTD_TRAIN_ITERS": "40",
                                  "RTD_SAVE_INTERVAL": "100"})):
        (tmp_path / name).mkdir()
        jobs[name] = client.sbatch(tmp_path / name, *SMALL_TEST, LARGE, env={
            **env, "RTD_TRAIN_ITERS": "3", "RTD_WARMUP_ITERS": "1",
            "RTD_SAVE": str(tmp_path / name / "run"), **extra})
    stop_log = tmp_path / "stop" / f"slurm-rtd-debertav3-large-{jobs['stop']}.out"
    try:
        wait_for("iteration 2 of the stop job", lambda: stop_log.exists() and any(
            int(m[1]) >= 2 for m in ITERATION.finditer(stop_log.read_text())), 480, stop_log)
        client.run("scancel", "--signal=TERM", "--batch", str(jobs["stop"]))
        for name, job in jobs.items():
            wait_for(f"the {name} job to end", lambda: not client.queued(job), 480)
    finally:
        for job in jobs.values():
            client.run("scancel", str(job), check=False, timeout=30)
    stop_job = jobs.pop("stop")
    out = {name: (tmp_path / name / f"slurm-rtd-debertav3-large-{job}.out").read_text()
           for name, job in jobs.items()}
    stop, save = stop_log.read_text(), tmp_path / "stop" / "run"
    state = client.job(stop_job)
    assert (state["JobState"], state["ExitCode"], state["Restarts"]) == ("FAILED", "143:0", "0"), \
        (state, stop[-3000:])
    saved = int(re.search(r"exit signal SIGUSR1 received: stopped after iteration (\d+); saved ",
                          stop)[1])
    assert 2 <= saved < 40 and (save / f"global_step{saved}" / "rtd_complete.json").is_file()
    assert stop.count("] running: srun") == 1 and "] restart " not in stop, stop[-3000:]
    assert "requeueing" not in stop and not (save / "restarts.jsonl").exists()
    assert re.search(rf"^\[rtd-slurm [\d-]+ [\d:]+\] stopped by SIGTERM: the newest complete "
                     rf"checkpoint is {save}/global_step{saved}; resume with: the same sbatch "
                     rf"command \(it passes --load {save}\)$", stop, re.M), stop[-3000:]
    for name, job in jobs.items():
        state = client.job(job)
        assert state["JobState"] == "FAILED" and state["ExitCode"] == "1:0", (state, out[name])
    user = out["user"]
    assert user.count("] running: srun") == 1 and "] restart " not in user
    assert "error: not restarting: the run stopped on a user-input error (exit status 2: its " \
        "error line is above); fix it and resubmit (its checkpoints are as they were)" in user
    assert len([line for line in user.splitlines() if "--mask-prob" in line
                and line.startswith("error: ")]) == 1, user[-3000:]
    loop = out["loop"]
    assert loop.count("] running: srun") == 2 and loop.count("] restart 1 (1 of 3 here)") == 1
    save = tmp_path / "loop" / "run"
    assert (f"error: iteration 2 failed 2 times in a row, the last time: rank 1 exited with exit "
            f"status 3 (its log: {save}/logs/rank1.log); not restarting "
            f"(RTD_MAX_FAILURES_AT_STEP=2); the newest complete checkpoint is none") in loop, \
        loop[-3000:]


PHASE1 = 10  # the two-phase job: steps 1-10 in phase 1, 11-20 in phase 2


def test_preemption_saves_requeues_and_resumes_in_two_phases(slurm_shards, tmp_path):
    env, _ = slurm_shards
    save = tmp_path / "run"
    env = {**env, "RTD_TRAIN_ITERS": "20", "RTD_SAVE_INTERVAL": "100", "RTD_SAVE": str(save),
           "RTD_PHASE1_ITERS": str(PHASE1), "RTD_PHASE1_SEQ_LENGTH": "32",
           "RTD_PHASE1_GLOBAL_BATCH": "32", "RTD_LR": "3e-4"}
    client = SlurmClient(env)
    t0 = time.monotonic()
    job = client.sbatch(tmp_path, *SMALL_TEST, LARGE)
    log = tmp_path / f"slurm-rtd-debertav3-large-{job}.out"
    try:
        # once training runs, preempt it the way --signal=B:USR1@600 does: SIGUSR1 to the batch
        # shell, which forwards it to the tasks
        wait_for("iteration 2", lambda: log.exists() and
              any(int(m[1]) >= 2 for m in ITERATION.finditer(log.read_text())), 300, log)
        client.run("scancel", "--signal=USR1", "--batch", str(job))
        # requeued: Slurm holds it for AuthInfo cred_expire (120 s; EligibleTime = requeue +
        # 121 s) because slurmd refuses a credential issued no later (in whole seconds) than its
        # revocation of the killed run's: StartTime=now 0.2 s after the requeue made the job
        # FAILED ("Job credential revoked"). Two seconds later it is safe; skip the rest.
        wait_for("the job to be requeued", lambda: client.queued(job) in ("PENDING BeginTime", ""),
              300, log)
        assert client.queued(job) == "PENDING BeginTime", \
            f"the job ended instead of requeueing: {client.job(job)}\n{log.read_text()[-3000:]}"
        time.sleep(2.5)
        client.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        wait_for("the requeued job to end", lambda: not client.queued(job), 600, log)
    finally:
        client.run("scancel", str(job), check=False, timeout=30)
    print(f"[slurm] two-phase job, preempted, requeued and resumed: {time.monotonic() - t0:.1f} s")
    out = log.read_text()
    state = client.job(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, out[-3000:])
    assert state["Restarts"] == "1", state

    first, second = out.split(f"job {job} (restart 1)")  # one output file, appended on requeue
    saved = int(re.search(r"exit signal SIGUSR1 received: stopped after iteration (\d+)",
                          first)[1])
    assert 2 <= saved < PHASE1, first[-3000:]
    assert (f"phase 1 of 2: steps 1-{PHASE1} at sequence length 32, global batch 32 "
            "(RTD_PHASE1_*); the learning-rate schedule spans all 20 steps") in first
    assert "micro-batch 4 × accumulation 4 × data-parallel 2 = global 32 (TP 1)" in first
    running = [line for line in first.splitlines() if "] running: srun" in line]
    assert len(running) == 1 and "--train-iters 10 --lr-decay-iters 20 --seq-length 32 " \
        "--micro-batch-size 4 --global-batch-size 32 " in running[0], running
    assert f"saved checkpoint at iteration {saved:8d} to {save}/global_step{saved}" in first
    assert f"stopped at global_step{saved} (was none): requeueing job {job}" in first
    assert [int(m[1]) for m in ITERATION.finditer(first)] == list(range(1, saved + 1))

    # the requeued job resumes in phase 1 (its checkpoint's), then goes on to phase 2 itself
    resume1, phase2 = second.split("phase 1 finished: ")
    assert f"phase 1 of 2: steps {saved + 1}-{PHASE1} at sequence length 32" in resume1
    assert f"resuming: the newest complete checkpoint in {save} is global_step{saved}" in resume1
    assert f"--load {save}" in resume1
    assert f"resumed from {save} at iteration {saved}" in resume1
    assert [(int(m[1]), int(m[2])) for m in ITERATION.finditer(resume1)] == \
        [(s, PHASE1) for s in range(saved + 1, PHASE1 + 1)], resume1[-3000:]
    assert phase2.startswith(f"{save}/global_step{PHASE1}\n"), phase2[:300]
    assert "phase 2 of 2: steps 11-20 at sequence length 64, global batch 16" in phase2
    assert "micro-batch 4 × accumulation 2 × data-parallel 2 = global 16 (TP 1)" in phase2
    assert f"resuming: the newest complete checkpoint in {save} is global_step{PHASE1}" in phase2
    assert re.search(r"^note: --seq-length 64 \(the checkpoint's 32\): the checkpoint had read "
                     r"320 of the [\d,]+ samples an epoch of its packing; the run continues at "
                     r"the same fraction of the data", phase2, re.M), phase2[-3000:]
    assert ("note: --global-batch-size 16 (the checkpoint's 32): iterations from 11 on read 16 "
            "samples each; the optimizer state, the step count and the schedule carry on"
            in phase2)
    assert ("note: --train-iters changed from 10 to 20; the learning-rate schedule keeps its "
            "length, --lr-decay-iters 20") in phase2
    # the schedule is the whole run's, at its step: warm-up 5, linear decay to 0 at step 20, so
    # iteration 11 has 3e-4 × (1 − (10 − 5) / (20 − 5)) (at the 320 samples read it would be 0)
    lr = float(re.search(r"^learning rate of iteration 11: (\S+)$", phase2, re.M)[1])
    assert lr == pytest.approx(3e-4 * (1 - 5 / 15), rel=1e-9), lr
    resumed = [(int(m[1]), int(m[2]), float(m[3])) for m in ITERATION.finditer(phase2)]
    assert [(s, t) for s, t, _ in resumed] == [(s, 20) for s in range(11, 21)], phase2[-3000:]
    assert all(math.isfinite(loss) for _, _, loss in resumed)
    assert "training finished" in phase2
    assert (save / "latest").read_text().strip() == "global_step20"
    # one optimizer over both phases: AdamW's step count is the run's
    assert adam_steps(save / f"global_step{PHASE1}") == {float(PHASE1)}
    assert adam_steps(save / "global_step20") == {20.0}
