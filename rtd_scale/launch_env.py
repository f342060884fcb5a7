"""Where this process sits in the launch: rank, world size and rendezvous address.

Read once, by :func:`read`, from the first of these that applies:

1. a launcher's variables — RANK and WORLD_SIZE (with LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as
   set by the ``deepspeed`` launcher, torchrun or slurm/lib/rank_env.sh;
2. a Slurm job step (``srun python rtd_scale/pretrain.py …`` without a wrapper): RANK =
   SLURM_PROCID, WORLD_SIZE = SLURM_STEP_NUM_TASKS (else SLURM_NTASKS), LOCAL_RANK =
   SLURM_LOCALID, MASTER_ADDR = the first host of SLURM_STEP_NODELIST (else
   SLURM_JOB_NODELIST; Slurm's hostlist syntax, :func:`expand_hostlist`), MASTER_PORT = 10000 +
   SLURM_JOB_ID mod 20000 (the rule of slurm/lib/pretrain_job.sh; PyTorch Lightning's
   SLURMEnvironment derives its port from the job id the same way). Only a job *step* counts:
   a batch script or an salloc shell also carries SLURM_PROCID=0 and the job's SLURM_NTASKS,
   but there it is one process, and taking SLURM_NTASKS as the world would wait for ranks that
   never start;
3. otherwise one process: a world of 1 on 127.0.0.1 and, unless MASTER_PORT is given, a free
   port (so a node where 29500 is taken still runs).

Nothing here imports torch: ``pretrain.main`` reads the rank before anything heavy is loaded.

Two commands slurm/lib/pretrain_job.sh runs before ``srun``, each printing one ``error:`` line
in the job's RTD_* words and exiting with status 1 when the job cannot start:

- ``python -m rtd_scale.launch_env batch-arithmetic WORLD TP GLOBAL MICRO [RANKS_PER_NODE]``
  prints "DP ACCUMULATION" (``rtd_scale.batch.batch_layout``; ``--phase1``: the numbers are
  RTD_PHASE1_GLOBAL_BATCH and RTD_PHASE1_MICRO_BATCH);
- ``python -m rtd_scale.launch_env check-tokenizer PRESET TOKENIZER [--vocab-size N]`` checks
  that the tokenizer has the preset's ``model.vocab_size`` pieces (or N: RTD_EXPECT_VOCAB).
  pretrain.py itself takes the tokenizer's size whatever the preset says, so this is where a
  regime's vocabulary is held to.
"""
from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass, replace
from typing import Mapping, MutableMapping, Optional, Sequence

from rtd_scale.cli_errors import OneLineArgumentParser, UserInputError, run_cli
from rtd_scale.batch import BatchNames, batch_layout
from rtd_scale.presets import PRESETS, preset

__all__ = ["LaunchEnv", "read", "export", "expand_hostlist", "slurm_port", "free_port",
           "cpu_threads_per_rank", "SLURM_NAMES"]

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the launch. ``master_port`` None: a single process that picks a
    free port when it starts (:func:`export`). ``source``: "launcher", "slurm" or "single"."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: Optional[int]
    source: str


def _int(environ: Mapping[str, str], name: str, default: Optional[int] = None, *,
         minimum: int = 0) -> int:
    value = environ.get(name)
    if value is None or value == "":
        if default is None:
            raise UserInputError(f"{name} is not set; the launcher must set it (or unset RANK and "
                                 "WORLD_SIZE to run as one process)")
        return default
    if not re.fullmatch(r"\d+", value.strip()) or int(value) < minimum:
        raise UserInputError(f"{name}={value!r}: expected an integer ≥ {minimum}")
    return int(value)


def _port(environ: Mapping[str, str]) -> Optional[int]:
    if environ.get("MASTER_PORT", "") == "":
        return None
    port = _int(environ, "MASTER_PORT", minimum=1)
    if port > 65535:
        raise UserInputError(f"MASTER_PORT={port}: a TCP port is 1–65535")
    return port


def read(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """The launch this process belongs to (see the module docstring for the order of sources).

    Raises:
        UserInputError: a variable that is not a non-negative integer, a rank outside the world,
            or a Slurm step whose node list or job id cannot give the rendezvous address.
    """
    env = os.environ if environ is None else environ
    if any(env.get(name, "") != "" for name in _LAUNCHER_VARS):
        rank, world = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1, minimum=1)
        out = LaunchEnv(rank=rank, world_size=world, local_rank=_int(env, "LOCAL_RANK", 0),
                        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
                        master_port=_port(env) or (None if world == 1 else 29500),
                        source="launcher")
        where = "RANK"
    elif env.get("SLURM_PROCID", "") != "" and (
            env.get("SLURM_STEP_ID", "") != "" or env.get("SLURM_STEP_NUM_TASKS", "") != ""):
        world_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
        nodelist_var = ("SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST")
                        else "SLURM_JOB_NODELIST")
        rank, world = _int(env, "SLURM_PROCID"), _int(env, world_var, minimum=1)
        if env.get("MASTER_ADDR"):
            addr = env["MASTER_ADDR"]
        else:
            nodelist = env.get(nodelist_var, "")
            if not nodelist:
                raise UserInputError(f"Slurm step without {nodelist_var}: set MASTER_ADDR to the "
                                     "first host of the job, or launch through "
                                     "slurm/lib/rank_env.sh")
            addr = expand_hostlist(nodelist)[0]
        port = _port(env)
        if port is None:
            if env.get("SLURM_JOB_ID", "") == "":
                raise UserInputError("Slurm step without SLURM_JOB_ID: set MASTER_PORT (the same "
                                     "on every task)")
            port = slurm_port(_int(env, "SLURM_JOB_ID"))
        out = LaunchEnv(rank=rank, world_size=world, local_rank=_int(env, "SLURM_LOCALID", 0),
                        master_addr=addr, master_port=port, source="slurm")
        where = "SLURM_PROCID"
    else:
        return LaunchEnv(rank=0, world_size=1, local_rank=0,
                         master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
                         master_port=_port(env), source="single")
    if out.rank >= out.world_size:
        raise UserInputError(f"{where}={out.rank} is outside a world of {out.world_size}")
    return out


def export(launch: LaunchEnv, environ: Optional[MutableMapping[str, str]] = None) -> LaunchEnv:
    """Set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for torch.distributed
    (env:// initialisation reads them); a single process without MASTER_PORT gets a free port.
    Returns ``launch`` with the port filled in."""
    env = os.environ if environ is None else environ
    port = launch.master_port if launch.master_port is not None else free_port()
    env.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size),
               LOCAL_RANK=str(launch.local_rank), MASTER_ADDR=launch.master_addr,
               MASTER_PORT=str(port))
    return LaunchEnv(rank=launch.rank, world_size=launch.world_size,
                     local_rank=launch.local_rank, master_addr=launch.master_addr,
                     master_port=port, source=launch.source)


_LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def cpu_threads_per_rank(environ: Optional[Mapping[str, str]] = None,
                         cores: Optional[int] = None) -> Optional[int]:
    """Intra-op threads for one CPU rank: the cores this process may run on, divided among the
    ranks on its node; None to keep torch's default (OMP_NUM_THREADS is set, or one rank a node).

    torchrun sets OMP_NUM_THREADS=1 when it starts more than one process a node; the
    ``deepspeed`` launcher sets nothing unless ``--bind_cores_to_rank``, so two gloo ranks on two
    cores each start two threads and spin against each other (a TP=2 step of
    tests/e2e/test_known_answer.py took 1.80 s so, 0.27 s at one thread a rank). The ranks a
    node comes from LOCAL_WORLD_SIZE (torchrun), LOCAL_SIZE (deepspeed) or
    SLURM_NTASKS_PER_NODE; pinned by tests/unit/test_rank_env.py.
    """
    env = os.environ if environ is None else environ
    if env.get("OMP_NUM_THREADS", "") != "":
        return None
    local = next((env[v] for v in _LOCAL_SIZE_VARS if env.get(v, "") != ""), "1")
    match = re.match(r"\d+", local)  # SLURM_NTASKS_PER_NODE may read "2(x3)"
    ranks = int(match.group()) if match else 1
    if ranks <= 1:
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
    return max(1, cores // ranks)


def slurm_port(job_id: int) -> int:
    """The rendezvous port of a Slurm job: 10000 + job id mod 20000 (in 10000–29999, below
    Linux's ephemeral range; the same rule as slurm/lib/pretrain_job.sh)."""
    return 10000 + job_id % 20000


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, drawn at random in 20000 up to the start of the
    kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768 on Linux): a port of
    that range (the kernel's own pick for port 0) is also what every outgoing connection on the
    machine takes (gloo's pairs, a TCPStore client), so one can be taken between this choice and
    the moment rank 0 listens on it. Where the range starts below 20000, the kernel's choice."""
    import random

    low = _ephemeral_start()
    if low > _FREE_PORT_FLOOR:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(_FREE_PORT_FLOOR, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_FREE_PORT_FLOOR = 20000  # above slurm_port(job id) for ids below 10000, below Linux's 32768


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (0 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def start_forked_workers(fn, args: tuple, nprocs: int, preload: Sequence[str]):
    """``torch.multiprocessing.start_processes(fn, args, nprocs, join=False)`` through a
    forkserver: one server process imports ``preload`` once (torch, megatron-core and DeepSpeed
    take ~5 CPU-s) and forks every worker from it, where spawn imported them again in each. The
    server starts with Python's warnings off: what its imports warn, the workers would have
    filtered, and it would reach this process's stderr. A forked worker inherits the server's
    environment, not this process's as it is now (spawn's): pass ``dict(os.environ)`` in
    ``args`` where a worker needs it. Returns torch's ProcessContext."""
    import multiprocessing.forkserver as forkserver

    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = saved
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="forkserver")


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _expand_brackets(item: str, spec: str) -> list[str]:
    """``n[01-02]x[1,3]`` → n01x1, n01x3, n02x1, n02x3 (every bracket group, in order)."""
    open_at = item.find("[")
    if open_at < 0:
        if "]" in item:
            raise UserInputError(f"node list {spec!r}: unbalanced ']' in {item!r}")
        return [item]
    close_at = item.find("]", open_at)
    if close_at < 0:
        raise UserInputError(f"node list {spec!r}: unbalanced '[' in {item!r}")
    head, body, tail = item[:open_at], item[open_at + 1:close_at], item[close_at + 1:]
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise UserInputError(f"node list {spec!r}: {part!r} is not a number or a range a-b")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise UserInputError(f"node list {spec!r}: range {part!r} runs backwards")
        width = len(lo)  # Slurm keeps the first bound's zero padding: [08-10] → 08 09 10
        values += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return [head + v + rest for v in values for rest in _expand_brackets(tail, spec)]


def expand_hostlist(spec: str) -> list[str]:
    """Expand Slurm's hostlist syntax, as ``scontrol show hostnames`` does:
    ``n[01-03,07],m5`` → ``[n01, n02, n03, n07, m5]``; ``r[1-2]-g[1-2]`` → r1-g1, r1-g2, r2-g1,
    r2-g2. Commas inside brackets separate ranges, outside them hosts.

    Raises:
        UserInputError: unbalanced brackets, a range that is not ``a`` or ``a-b``, or no host.
    """
    items, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    items.append(spec[start:])
    hosts = [h for item in items if item.strip() for h in _expand_brackets(item.strip(), spec)]
    if not hosts:
        raise UserInputError(f"node list {spec!r} names no host")
    return hosts


# slurm/lib/pretrain_job.sh's words for the numbers in batch_layout's errors
SLURM_NAMES = BatchNames(
    global_batch="global batch RTD_GLOBAL_BATCH={}", micro_batch="RTD_MICRO_BATCH={}",
    tp="RTD_TP={}", ranks="tasks", ranks_per_node="tasks",
    global_fix="choose a node count whose task count / TP divides it, or change RTD_GLOBAL_BATCH",
    per_node_fix="; use a TP size that divides --ntasks-per-node")


def _batch_arithmetic(argv: Optional[Sequence[str]]) -> None:
    p = OneLineArgumentParser(prog="python -m rtd_scale.launch_env batch-arithmetic",
                              description="DP size and gradient accumulation of a Slurm job")
    for name in ("world", "tp", "global_batch", "micro_batch"):
        p.add_argument(name, type=int)
    p.add_argument("ranks_per_node", type=int, nargs="?")
    p.add_argument("--phase1", action="store_true",
                   help="the numbers are RTD_PHASE1_GLOBAL_BATCH and RTD_PHASE1_MICRO_BATCH")
    a = p.parse_args(argv)
    names = SLURM_NAMES
    if a.phase1:
        names = replace(names, global_batch="global batch RTD_PHASE1_GLOBAL_BATCH={}",
                        micro_batch="RTD_PHASE1_MICRO_BATCH={}",
                        global_fix=names.global_fix.replace("RTD_", "RTD_PHASE1_"))
    dp, gas = batch_layout(a.world, a.global_batch, a.micro_batch, tp=a.tp,
                           ranks_per_node=a.ranks_per_node, names=names)
    print(dp, gas)


def _check_tokenizer(argv: Optional[Sequence[str]]) -> None:
    p = OneLineArgumentParser(prog="python -m rtd_scale.launch_env check-tokenizer",
                              description="the tokenizer of a Slurm job has its preset's size")
    p.add_argument("preset")
    p.add_argument("tokenizer")
    p.add_argument("--vocab-size", type=int,
                   help="the size required instead of the preset's model.vocab_size")
    a = p.parse_args(argv)
    if not os.path.isfile(a.tokenizer):
        raise UserInputError(f"RTD_TOKENIZER={a.tokenizer}: no such file")
    if a.vocab_size is None:
        if a.preset not in PRESETS:
            raise UserInputError(f"RTD_PRESET={a.preset} is unknown; choose one of "
                                 f"{', '.join(PRESETS)}")
        want, who = preset(a.preset).model.vocab_size, f"the preset {a.preset} needs"
    else:
        want, who = a.vocab_size, f"RTD_EXPECT_VOCAB={a.vocab_size} needs"
    from rtd_scale.data.tokenizer import Tokenizer

    got = Tokenizer(a.tokenizer).vocab_size
    if got != want:
        raise UserInputError(f"RTD_TOKENIZER={a.tokenizer} has {got} pieces; {who} {want} "
                             f"(tools/train_tokenizer.py --vocab-size {want}), or set "
                             "RTD_EXPECT_VOCAB= to accept it")


_COMMANDS = {"batch-arithmetic": _batch_arithmetic, "check-tokenizer": _check_tokenizer}


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in _COMMANDS:
        print("usage: python -m rtd_scale.launch_env batch-arithmetic WORLD TP GLOBAL MICRO "
              "[RANKS_PER_NODE]\n"
              "       python -m rtd_scale.launch_env check-tokenizer PRESET TOKENIZER "
              "[--vocab-size N]", file=sys.stderr)
        return 2
    return run_cli(_COMMANDS[argv[0]], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
