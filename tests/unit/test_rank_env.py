"""rtd_scale.launch_env: rank, world and rendezvous from the launcher's variables, a Slurm job
step's, or a single process; Slurm's hostlist syntax."""
from __future__ import annotations

import os
import socket

import pytest

from rtd_scale import launch_env
from rtd_scale.cli_errors import UserInputError
from rtd_scale.launch_env import LaunchEnv, expand_hostlist

# what srun puts in the environment of task 1 of a 2-task step of job 4242 on nodes n[07-08]
SRUN_TASK_1 = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
               "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_JOB_NODELIST": "n[07-08]", "SLURM_STEP_NODELIST": "n[07-08]"}


@pytest.mark.parametrize("spec, hosts", [
    ("localhost", ["localhost"]),
    ("n[01-03,07],m5", ["n01", "n02", "n03", "n07", "m5"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),  # the first bound's zero padding is kept
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("r[1-2]-g[1,3]", ["r1-g1", "r1-g3", "r2-g1", "r2-g3"]),
    ("node-[5]", ["node-5"]),
    ("x[1-2]y", ["x1y", "x2y"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec, says", [
    ("n[01-03", "unbalanced '['"), ("n01]", "unbalanced ']'"), ("n[a-b]", "'a-b' is not"),
    ("n[5-3]", "runs backwards"), ("", "names no host"), (" , ", "names no host"),
])
def test_expand_hostlist_refuses_malformed_lists(spec, says):
    with pytest.raises(UserInputError) as e:
        expand_hostlist(spec)
    assert says in str(e.value)


def test_launcher_variables_win():
    env = {**SRUN_TASK_1, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "6000"}
    assert launch_env.read(env) == LaunchEnv(3, 4, 1, "10.0.0.1", 6000, "launcher")


def test_launcher_defaults_match_torch():
    # WORLD_SIZE alone (a test or a partial launcher): rank 0, torch's default port for a world > 1
    assert launch_env.read({"WORLD_SIZE": "2"}) == LaunchEnv(0, 2, 0, "127.0.0.1", 29500,
                                                             "launcher")
    assert launch_env.read({"RANK": "0", "WORLD_SIZE": "1"}).master_port is None


def test_slurm_step_without_launcher_variables():
    assert launch_env.read(SRUN_TASK_1) == LaunchEnv(
        rank=1, world_size=2, local_rank=0, master_addr="n07", master_port=10000 + 4242,
        source="slurm")
    # the job's first host when the step has no node list of its own; the port wraps at 20000
    env = {**SRUN_TASK_1, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": "b[3-4],a1",
           "SLURM_JOB_ID": "123456", "SLURM_STEP_NUM_TASKS": ""}
    got = launch_env.read(env)
    assert (got.master_addr, got.master_port, got.world_size) == ("b3", 10000 + 3456, 2)
    # an exported MASTER_ADDR / MASTER_PORT is kept
    got = launch_env.read({**SRUN_TASK_1, "MASTER_ADDR": "head", "MASTER_PORT": "7000"})
    assert (got.master_addr, got.master_port, got.rank) == ("head", 7000, 1)


def test_batch_script_or_salloc_shell_is_one_process():
    # the batch step carries SLURM_PROCID=0 and the job's task count, but no step variables:
    # it is one process, and a world of 8 would wait for ranks that never come
    batch = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8",
             "SLURM_JOB_NODELIST": "n[1-2]"}
    assert launch_env.read(batch) == LaunchEnv(0, 1, 0, "127.0.0.1", None, "single")


@pytest.mark.parametrize("env, says", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x': expected an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is outside a world of 2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0': expected an integer ≥ 1"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000: a TCP port"),
    ({**SRUN_TASK_1, "SLURM_PROCID": "5"}, "SLURM_PROCID=5 is outside a world of 2"),
    ({**SRUN_TASK_1, "SLURM_STEP_NODELIST": "", "SLURM_JOB_NODELIST": ""},
     "Slurm step without SLURM_JOB_NODELIST"),
    ({**SRUN_TASK_1, "SLURM_JOB_ID": ""}, "Slurm step without SLURM_JOB_ID"),
])
def test_malformed_variables_are_one_line_errors(env, says):
    with pytest.raises(UserInputError) as e:
        launch_env.read(env)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_single_process_gets_a_free_port():
    env: dict[str, str] = {}
    got = launch_env.export(launch_env.read(env), env)
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["MASTER_PORT"] == str(got.master_port)
    with socket.socket() as s:  # nothing listens there: rank 0 can
        s.bind(("127.0.0.1", got.master_port))


def test_a_free_port_is_drawn_below_the_kernels_ephemeral_range():
    """Ports of the ephemeral range are what outgoing connections take (gloo, TCPStore clients),
    so a listener's port drawn there can be taken before rank 0 listens on it."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    assert low > 20000  # Linux's default 32768
    ports = {launch_env.free_port() for _ in range(50)}
    assert all(20000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn, not one port over and over


@pytest.mark.parametrize("environ,cores,want", [
    ({"LOCAL_SIZE": "2"}, 2, 1),                       # deepspeed: two ranks on two cores
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_SIZE": "9"}, 16, 8),  # torchrun's variable first
    ({"SLURM_NTASKS_PER_NODE": "4(x2)"}, 16, 4),       # Slurm's repeated-count syntax
    ({"LOCAL_SIZE": "4"}, 2, 1),                       # more ranks than cores: one each
    ({"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}, 16, None),  # the user's choice stands
    ({"LOCAL_SIZE": "1"}, 16, None),                   # one rank keeps torch's default
    ({}, 16, None),
])
def test_cpu_threads_are_the_cores_shared_among_a_nodes_ranks(environ, cores, want):
    assert launch_env.cpu_threads_per_rank(environ, cores=cores) == want


class _Started(Exception):
    """Raised by the stand-in for DeepSpeed's init_distributed: the device was chosen."""


def _initialize_as_srun_task(monkeypatch, local_rank: int, visible: int) -> dict:
    """``distributed.initialize`` as task ``local_rank`` of an 8-task ``srun`` step on one node
    (SLURM_* variables only, no launcher's) where torch.cuda sees ``visible`` devices (patched:
    the test runs on CPU), stopped where the process group would start. Returns the devices
    set and the LOCAL_RANK DeepSpeed would read."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from rtd_scale import distributed
    from rtd_scale.config import ParallelConfig

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)  # restored after the test (export sets them)
    step = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": str(local_rank),
            "SLURM_LOCALID": str(local_rank), "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NODELIST": "localhost",
            "MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(visible)))}
    for name, value in step.items():
        monkeypatch.setenv(name, value)
    seen: dict = {"set_device": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", seen["set_device"].append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def started(**kwargs):
        seen["LOCAL_RANK"] = os.environ["LOCAL_RANK"]
        raise _Started

    monkeypatch.setattr(deepspeed, "init_distributed", started)
    with pytest.raises(_Started):
        distributed.initialize(ParallelConfig(), seed=1)
    return seen


@pytest.mark.parametrize("local_rank, visible, device", [
    (3, 1, 0),  # srun --gpus-per-task=1: each task sees its own GPU as cuda:0
    (0, 1, 0),
    (5, 8, 5),  # srun --gpus-per-node, deepspeed, torchrun: local rank i uses device i
])
def test_a_task_uses_the_one_gpu_it_sees(monkeypatch, local_rank, visible, device):
    """Each rank trains on a device it sees, and DeepSpeed, which reads LOCAL_RANK as the device
    ordinal (the process group's device_id, the engine's set_device), is told the same one;
    before, task 3 of a one-GPU-per-task step called set_device(3): invalid device ordinal."""
    seen = _initialize_as_srun_task(monkeypatch, local_rank, visible)
    assert seen == {"set_device": [device], "LOCAL_RANK": str(device)}


def test_a_local_rank_past_the_visible_gpus_is_one_line(monkeypatch):
    from rtd_scale.distributed import cuda_device_index

    with pytest.raises(UserInputError) as e:
        _initialize_as_srun_task(monkeypatch, 5, 4)
    assert str(e.value) == (
        "local rank 5 (LOCAL_RANK or SLURM_LOCALID) needs a CUDA device of its own, but this "
        "process sees 4 (CUDA_VISIBLE_DEVICES=0,1,2,3); start at most 4 processes per node, or "
        "give each process one GPU (srun --gpus-per-task=1) or all of the node's "
        "(srun --gpus-per-node)")
    assert not e.value.every_rank  # printed by local rank 4 only: once per node
    with pytest.raises(UserInputError) as e:
        cuda_device_index(4, 4)
    assert e.value.every_rank
