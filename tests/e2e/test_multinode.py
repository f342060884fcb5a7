"""Two nodes for real: a two-node Slurm cluster in network namespaces on this machine
(tools/slurm_multinode_start.sh; 2 nodes × 2 CPUs, one controller; one cluster for the module).

- the cluster's network stays inside the private /24 it made (no default route anywhere, every
  daemon in its own namespace) and everything is removed again at the end;
- a bare `srun python` step over both nodes: rank discovery from SLURM_* (rtd_scale.launch_env),
  MASTER_ADDR on the first node, megatron-core's TP groups inside a node, DP groups across, and
  the gloo traffic crossing the bridge;
- slurm/pretrain_base.sh with --nodes=2 at TP 2 × DP 2 (ZeRO-3, the script's own): each rank
  logs where it sits; preempted by SIGUSR1, requeued, resumed at the saved step; then rank 3 (on
  the second node) segfaults at the last iteration and the job restarts itself in the same
  allocation from the saved step; its losses, before and after both, equal a single-node run of
  the same layout (the `deepspeed` launcher, 4 local ranks);
- the same job with RTD_LAUNCHER=torchrun (one `torchrun --nnodes 2 --rdzv-backend c10d` per
  node, started by srun): the same losses;
- an elastic requeue at TP 1: preempted on 2 nodes (DP 4), shrunk to 1 node (DP 2) with
  `scontrol update` while Slurm holds it, continued from the same checkpoint; its losses equal
  an uninterrupted run's within 1e-5 relative;
- tools/estimate_cost.py prints the node counts and batch arithmetic the job prints.

The cluster tests skip, with one line, only where the cluster cannot be made (not root, no
network namespaces, Slurm not installable); the skip itself is tested as an unprivileged user.
"""
from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.env import REPO, free_port
from tests.helpers.launcher import NO_DROPOUT, scalars
from tests.helpers.slurm import SlurmClient, shellcheck, wait_for

# installs Slurm with apt and runs a cluster's daemons on fixed ports: one machine-wide module
# at a time (tests/conftest.py)
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("machine-wide")]

START = REPO / "tools" / "slurm_multinode_start.sh"
STOP = REPO / "tools" / "slurm_multinode_stop.sh"
BASE = str(REPO / "slurm" / "pretrain_base.sh")
ITERATION = re.compile(r"^ iteration\s+(\d+)/\s*(\d+) \|.*\| total loss: (\S+) \|", re.M)
RANK_LINE = re.compile(r"^\[rank_env\] host (\S+) node (\d+): RANK (\d+) LOCAL_RANK (\d+) of "
                       r"WORLD_SIZE (\d+); TP rank (\d+) DP rank (\d+) \(TP (\d+)\); master (\S+)$",
                       re.M)
LOSSES = ("loss/mlm", "loss/rtd", "loss/total")
ITERS = 6


# ------------------------------------------------------------------------------ the cluster ----

@dataclass
class Cluster:
    """A running two-node cluster: run id, its directory, SLURM_CONF, names and addresses."""

    id: str
    home: Path
    conf: str
    subnet: str
    ctl: str
    nodes: list[str]
    addrs: list[str]
    env: dict[str, str]

    @property
    def slurm(self) -> SlurmClient:
        """Commands (sbatch, srun, squeue, ...) run inside the controller's namespace."""
        return SlurmClient(self.env, (str(self.home / "bin" / "in-ns"), self.ctl))


def start_or_skip(run_id: str, prefix: tuple[str, ...] = ()) -> dict[str, str]:
    """Run the start script (behind ``prefix``, e.g. a user switch); its KEY=value lines.
    Status 3 (cannot be made here) skips the calling test with the script's one line."""
    r = subprocess.run([*prefix, "bash", str(START), run_id], capture_output=True, text=True,
                       timeout=900)
    if r.returncode == 3:
        pytest.skip((r.stderr.strip().splitlines() or ["no two-node cluster here"])[-1])
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)


def _leftovers(run_id: str) -> list[str]:
    """Interfaces and namespaces of run ``run_id`` that still exist."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = re.findall(rf"\brtd{run_id}[a-z0-9]*", links + netns)
    return sorted(set(found))


@pytest.fixture(scope="module")
def cluster():
    run_id = secrets.token_hex(3)
    t0 = time.monotonic()
    out = start_or_skip(run_id)
    print(f"\n[multinode] run {run_id}: cluster up in {time.monotonic() - t0:.1f} s")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["SLURM_CONF"] = out["SLURM_CONF"]
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}:/usr/sbin:/sbin"
    c = Cluster(id=run_id, home=Path(out["RTD_MN_HOME"]), conf=out["SLURM_CONF"],
                subnet=out["RTD_MN_SUBNET"], ctl=out["RTD_MN_CTL"],
                nodes=out["RTD_MN_NODES"].split(), addrs=out["RTD_MN_ADDRS"].split(), env=env)
    try:
        yield c
    finally:
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(STOP), run_id], capture_output=True, text=True,
                           timeout=300)
        print(f"[multinode] teardown: {time.monotonic() - t0:.1f} s")
        assert r.returncode == 0, r.stdout + r.stderr
        assert _leftovers(run_id) == [] and not c.home.exists()


def test_skip_path_when_the_cluster_cannot_be_made(tmp_path):
    """As an unprivileged user the start script refuses in one line (status 3), the fixture
    turns that into a skip with the same line, and nothing is left behind."""
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("setpriv (util-linux) is needed to run the start script unprivileged")
        prefix = (setpriv, "--reuid=65534", "--regid=65534", "--clear-groups")
    run_id = "s" + secrets.token_hex(2)
    r = subprocess.run([*prefix, "bash", str(START), run_id], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert r.stdout == ""
    assert r.stderr == ("slurm_multinode_start: cannot make a two-node cluster here: needs root "
                        "(network namespaces, a bridge, daemons)\n")
    with pytest.raises(pytest.skip.Exception) as skipped:
        start_or_skip(run_id, prefix)
    assert str(skipped.value) == r.stderr.strip()
    assert _leftovers(run_id) == [] and not Path(f"/var/tmp/rtd_mn_{run_id}").exists()


def test_scripts_parse_and_passshellcheck():
    for script in (START, STOP):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"{script}: {r.stderr}"
    r = subprocess.run([shellcheck(), "-x", str(START), str(STOP)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_bad_run_id_is_one_line():
    r = subprocess.run(["bash", str(START), "Bad_Id"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 1
    assert r.stderr == ("slurm_multinode_start: run id 'Bad_Id': expected 1-6 characters "
                        "a-z0-9\n")


def _ns_of(pid_file: Path) -> str:
    pid = pid_file.read_text().strip()
    return subprocess.run(["ip", "netns", "identify", pid], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_network_stays_inside_the_private_subnet(cluster):
    """No namespace has a default route or any route outside the /24 the fixture made; every
    address is on that /24 (or loopback); every daemon runs in its own namespace; the bridge
    (host side .1) is the only interface of this machine with an address on the subnet."""
    prefix = cluster.subnet.rsplit(".", 1)[0]  # 10.A.B
    assert re.fullmatch(r"10\.\d+\.\d+\.0/24", cluster.subnet)
    for ns in (cluster.ctl, *cluster.nodes):
        assert subprocess.run(["ip", "-n", ns, "route", "show", "default"], capture_output=True,
                              text=True, check=True).stdout == ""
        assert subprocess.run(["ip", "-n", ns, "-6", "route", "show", "default"],
                              capture_output=True, text=True, check=True).stdout == ""
        routes = subprocess.run(["ip", "-n", ns, "-4", "route", "show", "table", "all"],
                                capture_output=True, text=True, check=True).stdout.splitlines()
        for route in routes:
            dest = route.split()[0] if not route.startswith(("local", "broadcast")) \
                else route.split()[1]
            assert dest == cluster.subnet or dest.startswith(f"{prefix}.") or \
                dest.startswith("127."), (ns, route)
        addrs = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr", "show"], capture_output=True,
                               text=True, check=True).stdout
        assert sorted(re.findall(r"inet (\S+)", addrs)) == sorted(
            ["127.0.0.1/8", f"{dict(zip(cluster.nodes, cluster.addrs)).get(ns, prefix + '.2')}/24"])
        links = subprocess.run(["ip", "-n", ns, "-o", "link", "show"], capture_output=True,
                               text=True, check=True).stdout
        assert sorted(re.findall(r"^\d+: ([^:@]+)", links, re.M)) == ["eth0", "lo"], links
    host = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", cluster.subnet],
                          capture_output=True, text=True, check=True).stdout
    assert re.findall(r"^\d+: (\S+)\s+inet (\S+)", host, re.M) == \
        [(f"rtd{cluster.id}br", f"{prefix}.1/24")]
    run = cluster.home / "run"
    assert _ns_of(run / "slurmctld.pid") == cluster.ctl
    assert _ns_of(run / "munged.pid") == cluster.ctl
    for node in cluster.nodes:
        assert _ns_of(run / f"slurmd.{node}.pid") == node
    states = cluster.slurm.run("sinfo", "-h", "-N", "-o", "%N %c %T").stdout.split("\n")
    assert sorted(s for s in states if s) == [f"{n} 2 idle" for n in cluster.nodes]


# --------------------------------------------------------------- a bare srun step, 2 nodes ----

PROBE = r"""
import json, socket
import torch
import torch.distributed as dist
from rtd_scale import distributed, launch_env
from rtd_scale.config import ParallelConfig
launch = launch_env.read()
ctx = distributed.initialize(ParallelConfig(tensor_model_parallel_size=2), seed=1)
hosts = [None] * ctx.world_size
dist.all_gather_object(hosts, socket.gethostname())
t = torch.tensor([float(ctx.rank + 1)])
dist.all_reduce(t)
print("PROBE " + json.dumps(dict(
    host=socket.gethostname(), source=launch.source, rank=ctx.rank, local_rank=ctx.local_rank,
    master=launch.master_addr, port=launch.master_port, tp_rank=ctx.tp_rank, dp_rank=ctx.dp_rank,
    tp_group=dist.get_process_group_ranks(ctx.tp_group),
    dp_group=dist.get_process_group_ranks(ctx.dp_group), hosts=hosts, sum=t.item())), flush=True)
distributed.teardown()
"""


def _veth_bytes(cluster: Cluster, node_index: int) -> int:
    """Bytes through the host side of node ``node_index``'s veth (on the bridge), both ways."""
    stats = Path(f"/sys/class/net/rtd{cluster.id}v{node_index + 1}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def test_deepspeed_slurm_launcher_ranks_groups_and_traffic_across_nodes(cluster, tmp_path):
    """DeepSpeed's own `deepspeed --launcher slurm` (run in the controller's namespace, with a
    hostfile of the two nodes) starts a bare `srun -n 4 python` step, which sets no RANK: the
    4 ranks come from SLURM_* (rtd_scale.launch_env) on two hosts, LOCAL_RANK 0/1 on each,
    MASTER_ADDR the first node, TP groups {0,1} and {2,3} each on one host, DP groups {0,2} and
    {1,3} across the hosts, and the collective's bytes crossed the bridge."""
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "hostfile").write_text("".join(f"{n} slots=2\n" for n in cluster.nodes))
    before = _veth_bytes(cluster, 1)
    env = {**cluster.env, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    # --master_addr only spares the runner an ssh to the first host (`hostname -I`); the
    # Slurm runner does not pass it on, the ranks find the first host themselves
    r = cluster.slurm.run(str(Path(sys.executable).with_name("deepspeed")), "--launcher", "slurm",
                          "--hostfile", str(tmp_path / "hostfile"), "--no_ssh_check",
                          "--master_addr", cluster.nodes[0],
                          "--launcher_args", "--nodes=2 --ntasks-per-node=2",
                          str(tmp_path / "probe.py"), cwd=REPO, env=env, timeout=480)
    assert re.search(r"cmd = srun -n 4 --nodes=2 --ntasks-per-node=2 --export=ALL\S* "
                     rf"\S*python\S* -u {tmp_path}/probe.py", r.stdout + r.stderr), r.stderr[-3000:]
    crossed = _veth_bytes(cluster, 1) - before
    ranks = sorted((json.loads(line[6:]) for line in r.stdout.splitlines()
                    if line.startswith("PROBE ")), key=lambda d: d["rank"])
    n1, n2 = cluster.nodes
    assert [(d["rank"], d["host"], d["local_rank"]) for d in ranks] == \
        [(0, n1, 0), (1, n1, 1), (2, n2, 0), (3, n2, 1)], r.stdout + r.stderr
    for d in ranks:
        assert d["source"] == "slurm" and d["master"] == n1 and d["hosts"] == [n1, n1, n2, n2]
        assert d["tp_rank"] == d["rank"] % 2 and d["dp_rank"] == d["rank"] // 2
        assert d["tp_group"] == [2 * d["dp_rank"], 2 * d["dp_rank"] + 1]
        assert {d["hosts"][i] for i in d["tp_group"]} == {d["host"]}  # TP stays on the node
        assert d["dp_group"] == [d["tp_rank"], d["tp_rank"] + 2]
        assert {d["hosts"][i] for i in d["dp_group"]} == {n1, n2}  # DP crosses the nodes
        assert d["sum"] == 1.0 + 2.0 + 3.0 + 4.0
    assert len({d["port"] for d in ranks}) == 1
    assert crossed > 10_000, crossed  # the rendezvous and the gloo collectives went over n2's veth


# ------------------------------------------------------ slurm/pretrain_base.sh, two nodes ----

@pytest.fixture(scope="module")
def job_env(cluster, wiki_shards):
    tok, prefix = wiki_shards
    venv = Path(sys.executable).parent.parent
    return {**cluster.env, "RTD_PRESET": "tiny", "RTD_DEVICE": "cpu", "RTD_BF16": "0",
            "RTD_EXPECT_VOCAB": "", "RTD_GLOBAL_BATCH": "16", "RTD_MICRO_BATCH": "4",
            "RTD_SEQ_LENGTH": "64", "RTD_WARMUP_ITERS": "2", "RTD_LOG_INTERVAL": "1",
            "RTD_SEED": "7", "RTD_TP": "2", "RTD_TRAIN_ITERS": str(ITERS),
            "RTD_SAVE_INTERVAL": "100", "RTD_DATA_PATH": prefix, "RTD_TOKENIZER": tok,
            "RTD_VENV": str(venv if (venv / "bin" / "activate").is_file() else REPO / ".venv")}


TWO_NODES = ("--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0")


def _losses(tb_dir: Path) -> dict[str, dict[int, float]]:
    s = scalars(str(tb_dir))
    return {tag: s[tag] for tag in LOSSES}


@dataclass
class Preempted:
    job: int
    out: str
    save: Path


def _preempt_and_requeue(cluster, env: dict, work: Path, while_held=None
                         ) -> tuple[int, str, float]:
    """slurm/pretrain_base.sh on TWO_NODES with ``env``: SIGUSR1 once iteration 2 is logged,
    wait for the requeue, call ``while_held(job)`` while Slurm holds it, cut the hold short
    (as tests/e2e/test_slurm.py does) and wait for the end. The job must have completed after
    one restart. Returns (job id, its log, seconds)."""
    t0 = time.monotonic()
    job = cluster.slurm.sbatch(work, *TWO_NODES, BASE, env=env)
    log = work / f"slurm-rtd-debertav3-base-{job}.out"
    try:
        wait_for("iteration 2", lambda: log.exists() and
              any(int(m[1]) >= 2 for m in ITERATION.finditer(log.read_text())), 400, log)
        cluster.slurm.run("scancel", "--signal=USR1", "--batch", str(job))
        wait_for("the job to be requeued",
              lambda: cluster.slurm.queued(job) in ("PENDING BeginTime", ""), 300, log)
        assert cluster.slurm.queued(job) == "PENDING BeginTime", \
            (f"the job ended instead of requeueing: {cluster.slurm.job(job)}\n"
             f"{log.read_text()[-3000:]}")
        if while_held is not None:
            while_held(job)
        time.sleep(2.5)  # see test_slurm.py: a start in the same second as the revocation fails
        cluster.slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        wait_for("the requeued job to end", lambda: not cluster.slurm.queued(job), 480, log)
    finally:
        cluster.slurm.run("scancel", str(job), check=False)
    seconds = time.monotonic() - t0
    state = cluster.slurm.job(job)
    out = log.read_text()
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, out[-3000:])
    assert state["Restarts"] == "1", state
    return job, out, seconds


@pytest.fixture(scope="module")
def preempted_job(cluster, job_env, tmp_path_factory) -> Preempted:
    """slurm/pretrain_base.sh on 2 nodes × 2 tasks, TP 2: SIGUSR1 once training runs, requeue,
    resume, finish (Slurm's requeue hold is cut short as in tests/e2e/test_slurm.py)."""
    work = tmp_path_factory.mktemp("mn_preempt")
    save = work / "run"
    # a segfault on the second node at the last iteration: after the requeue (the preemption
    # comes at iteration 2 or later and saves before 6), restarted in the same allocation
    env = {**job_env, "RTD_SAVE": str(save), "RTD_FAULTS": f"segv@{ITERS}:3!once",
           "RTD_RESTART_BACKOFF": "1"}
    job, out, seconds = _preempt_and_requeue(cluster, env, work)
    print(f"[multinode] preempted, requeued and resumed 2-node job: {seconds:.1f} s")
    return Preempted(job=job, out=out, save=save)


def _local_run(out: str, ranks: int, save: Path) -> subprocess.CompletedProcess:
    """A job's first pretrain.py command (from its `running:` line), run on this machine by the
    `deepspeed` launcher as ``ranks`` local ranks, saving to ``save``."""
    line = re.search(r"running: srun \.\.\. python -u (\S+/pretrain\.py) (.*)$", out, re.M)
    args = line[2].split()
    for flag, value in (("--save", str(save)), ("--tensorboard-dir", str(save / "tensorboard"))):
        args[args.index(flag) + 1] = value
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    r = subprocess.run([str(Path(sys.executable).with_name("deepspeed")), "--num_gpus",
                        str(ranks), "--master_port", str(free_port()), line[1], *args], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def single_node_losses(preempted_job, tmp_path_factory) -> dict[str, dict[int, float]]:
    """The job's own pretrain.py command, run on this machine by the `deepspeed` launcher as 4
    local ranks (one node, the same TP 2 × DP 2): TensorBoard losses per step."""
    save = tmp_path_factory.mktemp("mn_single") / "run"
    t0 = time.monotonic()
    r = _local_run(preempted_job.out, 4, save)
    print(f"[multinode] single-node reference (4 local ranks): {time.monotonic() - t0:.1f} s")
    assert "world 4 = TP 2 × PP 1 × DP 2" in r.stdout and "ZeRO stage 3" in r.stdout
    losses = _losses(save / "tensorboard")
    assert sorted(losses["loss/total"]) == list(range(1, ITERS + 1))
    return losses


def test_two_nodes_ranks_log_where_they_sit(cluster, preempted_job):
    """Both runs of the job (before and after the requeue) put ranks 0-1 on the first node and
    2-3 on the second, TP groups inside a node, and MASTER_ADDR on the first node."""
    out, job = preempted_job.out, preempted_job.job
    n1, n2 = cluster.nodes
    for restart, part in enumerate(out.split(f"job {job} (restart ")[1:]):
        assert part.startswith(f"{restart}) on 2 node(s) {cluster.nodes[0][:-1]}[1-2]: 4 tasks, "
                               f"master {n1}:{10000 + job % 20000}, device cpu"), part[:300]
        assert "batch: micro-batch 4 × accumulation 2 × data-parallel 2 = global 16 (TP 2)" \
            in part
        assert "world 4 = TP 2 × PP 1 × DP 2" in part and "ZeRO stage 3" in part
        ranks = sorted({(int(m[3]), m[1], int(m[2]), int(m[4]), int(m[5]), int(m[6]),
                         int(m[7]), int(m[8]), m[9].rsplit(":", 1)[0])
                        for m in RANK_LINE.finditer(part)})  # the restart's srun: same places
        master = n1
        assert ranks == [(0, n1, 0, 0, 4, 0, 0, 2, master), (1, n1, 0, 1, 4, 1, 0, 2, master),
                         (2, n2, 1, 0, 4, 0, 1, 2, master), (3, n2, 1, 1, 4, 1, 1, 2, master)], \
            part[-3000:]
    assert out.count(f"job {job} (restart ") == 2
    print("\n" + "\n".join(line for line in out.splitlines() if "running:" not in line
                           and line.startswith(("[rank_env]", "[rtd-slurm"))))


def test_two_nodes_preemption_resumes_at_the_saved_step(preempted_job):
    out, job, save = preempted_job.out, preempted_job.job, preempted_job.save
    first, second = out.split(f"job {job} (restart 1)")
    saved = int(re.search(r"exit signal SIGUSR1 received: stopped after iteration (\d+)",
                          first)[1])
    assert 2 <= saved < ITERS, first[-3000:]
    assert f"saved checkpoint at iteration {saved:8d} to {save}/global_step{saved}" in first
    assert f"stopped at global_step{saved} (was none): requeueing job {job}" in first
    assert [int(m[1]) for m in ITERATION.finditer(first)] == list(range(1, saved + 1))
    assert f"resuming: the newest complete checkpoint in {save} is global_step{saved}" in second
    assert f"resumed from {save} at iteration {saved}" in second
    # rank 3 segfaulted in the last iteration; the job's own restart resumed from the same step
    assert [int(m[1]) for m in ITERATION.finditer(second)] == \
        [*range(saved + 1, ITERS), *range(saved + 1, ITERS + 1)], second[-3000:]
    (restart,) = [line.split("] ", 1)[1] for line in second.splitlines()
                  if line.startswith("[rtd-slurm ") and "] restart " in line]
    assert restart.startswith(f"restart 1 (1 of 3 here): crash: rank 3 died of SIGSEGV at "
                              f"iteration {ITERS}; its log: {save}/logs/rank3.log; resuming "
                              f"from global_step{saved} in 1 s"), restart
    assert second.count(f"resumed from {save} at iteration {saved}") == 2
    assert "training finished" in second
    assert (save / "latest").read_text().strip() == f"global_step{ITERS}"
    for tag in (f"global_step{saved}", f"global_step{ITERS}"):  # both nodes' ranks saved
        assert sorted(p.name for p in (save / tag).glob("rng_rank*.pt")) == \
            [f"rng_rank0000{r}.pt" for r in range(4)]


def test_two_nodes_losses_equal_a_single_node_run(preempted_job, single_node_losses):
    """Every step of the preempted-and-resumed two-node job, before and after the requeue,
    has the single-node run's losses within 1e-6."""
    two = _losses(preempted_job.save / "tensorboard")
    worst = max(abs(two[t][s] - v) for t in LOSSES for s, v in single_node_losses[t].items())
    print(f"\n[multinode] two nodes (preempted, resumed) vs one node: largest loss difference "
          f"{worst:.3g} over {ITERS} steps × {len(LOSSES)} losses; total loss "
          + " ".join(f"{s}:{two['loss/total'][s]:.7g}/{v:.7g}"
                     for s, v in sorted(single_node_losses["loss/total"].items())))
    for tag in LOSSES:
        assert sorted(two[tag]) == list(range(1, ITERS + 1)), (tag, two[tag])
        for step, value in single_node_losses[tag].items():
            assert math.isfinite(value)
            assert abs(two[tag][step] - value) <= 1e-6, (tag, step, two[tag][step], value)


def test_torchrun_once_per_node_matches(cluster, job_env, single_node_losses, tmp_path):
    """RTD_LAUNCHER=torchrun: srun starts one `torchrun --nnodes 2 --rdzv-backend c10d` per
    node, which starts that node's 2 ranks; the run has the single-node losses."""
    save = tmp_path / "run"
    env = {**job_env, "RTD_SAVE": str(save), "RTD_LAUNCHER": "torchrun"}
    t0 = time.monotonic()
    job = cluster.slurm.sbatch(tmp_path, *TWO_NODES, BASE, env=env)
    log = tmp_path / f"slurm-rtd-debertav3-base-{job}.out"
    try:
        wait_for("the torchrun job to end", lambda: not cluster.slurm.queued(job), 480, log)
    finally:
        cluster.slurm.run("scancel", str(job), check=False)
    print(f"[multinode] torchrun 2-node job: {time.monotonic() - t0:.1f} s")
    out = log.read_text()
    state = cluster.slurm.job(job)
    assert state["JobState"] == "COMPLETED" and state["ExitCode"] == "0:0", (state, out[-3000:])
    assert "running: srun ... torchrun ... python -u " in out
    assert "[rank_env]" not in out  # torchrun, not the wrapper, set the ranks
    assert "world 4 = TP 2 × PP 1 × DP 2" in out
    assert [int(m[1]) for m in ITERATION.finditer(out)] == list(range(1, ITERS + 1))
    losses = _losses(save / "tensorboard")
    worst = max(abs(losses[t][s] - v) for t in LOSSES for s, v in single_node_losses[t].items())
    print(f"\n[multinode] torchrun two nodes vs one node: largest loss difference {worst:.3g}")
    for tag in LOSSES:
        for step, value in single_node_losses[tag].items():
            assert abs(losses[tag][step] - value) <= 1e-6, (tag, step, losses[tag][step], value)


def test_tp_spanning_nodes_is_refused(cluster, job_env, tmp_path):
    """One task per node at TP 2 would put a TP group across the nodes: the job stops at once
    with one line saying so."""
    env = {**job_env, "RTD_SAVE": str(tmp_path / "run")}
    job = cluster.slurm.sbatch(tmp_path, "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
                               BASE, env=env)
    wait_for("the job to end", lambda: not cluster.slurm.queued(job), 120)
    state = cluster.slurm.job(job)
    out = (tmp_path / f"slurm-rtd-debertav3-base-{job}.out").read_text()
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "1:0", (state, out)
    assert "error: RTD_TP=2 does not divide the 1 tasks per node: tensor-parallel groups would " \
        "span nodes; use a TP size that divides --ntasks-per-node" in out
    assert not (tmp_path / "run").exists()


# ----------------------------------------------- tools/estimate_cost.py and the Slurm scripts ----

def _estimate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / "estimate_cost.py"), "--preset",
                           "tiny", "--seq-length", "64", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def _slurm_arithmetic(world: int, tp: int, global_batch: int, micro: int):
    code = (f'source "{REPO}/slurm/lib/pretrain_job.sh"; '
            f'rtd_batch_arithmetic {world} {tp} {global_batch} {micro}')
    env = {**os.environ, "RTD_REPO": str(REPO), "RTD_PRESET": "tiny", "RTD_TRAIN_ITERS": "1",
           "RTD_GLOBAL_BATCH": str(global_batch), "RTD_MICRO_BATCH": str(micro),
           "RTD_SEQ_LENGTH": "64", "RTD_LR": "1e-3", "RTD_WARMUP_ITERS": "0"}
    return subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True,
                          timeout=30)


def test_estimate_cost_prints_the_slurm_scripts_arithmetic():
    """For node counts 1-16 the tool's layout and batch lines carry the DP size and accumulation
    that slurm/lib/pretrain_job.sh computes, and both refuse the same impossible layouts."""
    for nodes, per_node, tp, global_batch, micro, dp, gas in (
            (2, 2, 2, 16, 4, 2, 2), (2, 8, 1, 8192, 16, 16, 32), (16, 8, 2, 8192, 8, 64, 16),
            (1, 8, 1, 8192, 8, 8, 128)):
        r = _estimate("--nodes", str(nodes), "--gpus-per-node", str(per_node), "--tp", str(tp),
                      "--global-batch-size", str(global_batch), "--micro-batch-size", str(micro))
        assert r.returncode == 0, r.stderr
        assert _slurm_arithmetic(nodes * per_node, tp, global_batch, micro).stdout.split() == \
            [str(dp), str(gas)]
        assert f"layout:    {nodes} node(s) × {per_node} GPUs = {nodes * per_node} ranks = TP " \
            f"{tp} × DP {dp}\n" in r.stdout
        assert f"batch:     micro-batch {micro} × accumulation {gas} × data-parallel {dp} = " \
            f"global {global_batch} (TP {tp})\n" in r.stdout
        assert f"per step:  {global_batch * 64:,} tokens" in r.stdout
    for nodes, per_node, global_batch, micro, why in (
            (6, 8, 8192, 8, "global batch 8192 is not divisible by the data-parallel size 48"),
            (8, 8, 8192, 3, "micro-batch 3 does not divide the 128 samples")):
        r = _estimate("--nodes", str(nodes), "--gpus-per-node", str(per_node),
                      "--global-batch-size", str(global_batch), "--micro-batch-size", str(micro))
        assert r.returncode == 2 and r.stdout == "" and why in r.stderr, r.stderr
        assert _slurm_arithmetic(nodes * per_node, 1, global_batch, micro).returncode == 1
    r = _estimate("--nodes", "2", "--gpus-per-node", "1", "--tp", "2")
    assert r.returncode == 2 and r.stderr == ("error: --tp 2 does not divide the 1 GPUs per node: "
                                              "tensor-parallel groups would span nodes\n")
    r = _estimate("--nodes", "2", "--gpus-per-node", "8", "--gpus", "8")
    assert r.returncode == 2 and "--gpus 8 differs from --nodes 2 × --gpus-per-node 8 = 16" \
        in r.stderr


def test_estimate_cost_agrees_with_the_two_node_job(cluster, preempted_job):
    """The two-node job's own log and the tool, given the job's numbers, print the same node
    count, rank count and batch arithmetic."""
    r = _estimate("--nodes", "2", "--gpus-per-node", "2", "--tp", "2", "--global-batch-size",
                  "16", "--micro-batch-size", "4")
    assert r.returncode == 0, r.stderr
    tool = re.search(r"^layout: +(\d+) node\(s\) × \d+ GPUs = (\d+) ranks = TP (\d+) × DP (\d+)$",
                     r.stdout, re.M)
    job = re.search(r"on (\d+) node\(s\) \S+: (\d+) tasks", preempted_job.out)
    assert job.groups() == tool.groups()[:2] == ("2", "4")
    world = re.search(r"world (\d+) = TP (\d+) × PP 1 × DP (\d+)", preempted_job.out)
    assert world.groups() == (tool[2], tool[3], tool[4]) == ("4", "2", "2")
    batch = re.search(r"^batch:     (.*)$", r.stdout, re.M)[1]
    assert f"] batch: {batch}\n" in preempted_job.out, batch


# ------------------------------------------------- elastic requeue: 2 nodes, then 1 node ----

def test_elastic_requeue_continues_on_fewer_nodes(cluster, job_env, tmp_path_factory):
    """TP 1 on 2 nodes × 2 tasks (DP 4, accumulation 1): SIGUSR1, save, requeue; while Slurm
    holds the requeued job it is shrunk to 1 node × 2 tasks (`scontrol update NumNodes=1
    NumTasks=2`). The same job id then redoes the batch arithmetic (DP 2, accumulation 2),
    converts the checkpoint (its layout-free state, read from its 4 ranks' ZeRO-3 partition files)
    and continues at the saved step.
    Every step's losses equal an uninterrupted run's (2 local ranks) within 1e-5 relative; the
    two sizes sum the global batch's gradients in different orders. Dropout is off: at a new
    size each rank seeds a fresh dropout stream (training/checkpoint/layout_free.py)."""
    work = tmp_path_factory.mktemp("mn_elastic")
    save = work / "run"
    env = {**job_env, "RTD_SAVE": str(save), "RTD_TP": "1", "RTD_EXTRA_ARGS": " ".join(NO_DROPOUT)}

    def shrink(job: int) -> None:
        # NumNodes=1 alone sets the minimum only, and the old CPU count stays required: the job
        # would pend with Reason BadConstraints (measured on Slurm 22.05)
        cluster.slurm.run("scontrol", "update", f"JobId={job}", "NumNodes=1-1", "NumTasks=2",
                          "NumCPUs=2")
        held = cluster.slurm.job(job)
        assert held["NumTasks"] == "2" and "cpu=2," in held["TRES"] and "node=1," in \
            held["TRES"], held

    job, out, seconds = _preempt_and_requeue(cluster, env, work, shrink)
    print(f"\n[multinode] elastic job, 2 nodes then 1: {seconds:.1f} s")

    first, second = out.split(f"job {job} (restart 1)")
    assert f"job {job} (restart 0) on 2 node(s) " in first and ": 4 tasks, " in first
    assert "batch: micro-batch 4 × accumulation 1 × data-parallel 4 = global 16 (TP 1)" in first
    assert "world 4 = TP 1 × PP 1 × DP 4" in first
    saved = int(re.search(r"exit signal SIGUSR1 received: stopped after iteration (\d+)",
                          first)[1])
    assert 2 <= saved < ITERS, first[-3000:]
    assert f"stopped at global_step{saved} (was none): requeueing job {job}" in first
    assert re.match(rf" on 1 node\(s\) {cluster.nodes[0][:-1]}[12]: 2 tasks, ", second), \
        second[:300]
    assert "this allocation holds 2 tasks (SLURM_TASKS_PER_NODE=2), not the submission's " \
        "SLURM_NTASKS=4: the job was resized; using 2" in second
    assert "batch: micro-batch 4 × accumulation 2 × data-parallel 2 = global 16 (TP 1)" in second
    assert "world 2 = TP 1 × PP 1 × DP 2" in second
    assert re.search(rf"^converted {re.escape(str(save))}/global_step{saved} from TP 1 × PP 1 × "
                     r"DP 4, ZeRO-3 to TP 1 × PP 1 × DP 2, ZeRO-3 ", second, re.M), second[-3000:]
    assert f"resumed from {save} at iteration {saved} ({saved * 16} samples consumed)" in second
    assert [int(m[1]) for m in ITERATION.finditer(second)] == list(range(saved + 1, ITERS + 1))
    assert (save / "latest").read_text().strip() == f"global_step{ITERS}"

    ref_save = tmp_path_factory.mktemp("mn_elastic_ref") / "run"
    t0 = time.monotonic()
    r = _local_run(out, 2, ref_save)
    print(f"[multinode] uninterrupted reference (2 local ranks): {time.monotonic() - t0:.1f} s")
    assert "world 2 = TP 1 × PP 1 × DP 2" in r.stdout
    ref, got = _losses(ref_save / "tensorboard"), _losses(save / "tensorboard")
    rel = {(t, s): abs(got[t][s] - v) / max(abs(got[t][s]), abs(v))
           for t in LOSSES for s, v in ref[t].items()}
    worst = max(rel.values())
    print(f"[multinode] elastic (DP 4 to step {saved}, then DP 2) vs uninterrupted DP 2: largest "
          f"relative loss difference {worst:.3g} (after the resume "
          f"{max(v for (t, s), v in rel.items() if s > saved):.3g}); total loss "
          + " ".join(f"{s}:{got['loss/total'][s]:.7g}/{v:.7g}"
                     for s, v in sorted(ref["loss/total"].items())))
    for tag in LOSSES:
        assert sorted(got[tag]) == sorted(ref[tag]) == list(range(1, ITERS + 1)), tag
    assert worst <= 1e-5, sorted(rel.items(), key=lambda kv: -kv[1])[:5]
