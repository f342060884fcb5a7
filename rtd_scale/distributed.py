"""One place that starts and stops everything distributed.

``initialize`` starts torch.distributed through DeepSpeed (gloo on CPU, NCCL on GPU), builds
megatron-core's parallel state (tensor × data parallel groups), seeds the generators following the
RNG policy below, and returns a ``ParallelContext``; ``teardown`` undoes it. ``DeepSpeedMpu``
hands DeepSpeed the groups it needs (``deepspeed.initialize(mpu=...)``).

RNG policy (tested in tests/multiproc):
- model initialisation: ``torch.manual_seed(seed)`` on every rank before the model is built;
  megatron-core's CPU initialisation draws the full weight and keeps this rank's slice, so the
  initial weights are the same at any TP and DP size;
- data order and masks: pure functions of (seed, epoch) and (seed, global sample index)
  (``rtd_scale/data``, ``rtd_scale/objectives/masking.py``) — identical across TP ranks, and
  different across DP ranks only because each DP rank reads different samples;
- the generator's sampling noise: a pure function of (seed, step, global sample index, position,
  global vocab id) (``rtd_scale/objectives/sampling.py``) — independent of TP and DP sizes;
- dropout outside tensor-parallel regions (hidden dropout): the default generator, seeded with
  seed + 100·pp_rank + 10·dp_rank after the model is built — equal across TP ranks (their
  activations are replicated), different across DP ranks;
- dropout inside tensor-parallel regions (attention probabilities, split by head): megatron-core's
  model-parallel RNG tracker, state "model-parallel-rng" seeded with that seed + 2718 + tp_rank
  (megatron-core's rule), CPU-backed when there is no GPU (``cpu_compat``).
"""
from __future__ import annotations

from rtd_scale.cli_errors import UserInputError

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from rtd_scale import cpu_compat, launch_env
from rtd_scale.config import ParallelConfig


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits. Groups are torch.distributed process groups."""

    rank: int
    world_size: int
    local_rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    device: torch.device
    backend: str
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    embedding_group: Optional[dist.ProcessGroup]  # first + last stage; None elsewhere or at PP=1
    last_stage_global_rank: int  # this pipeline's last stage (same TP and DP position)
    # every rank over gloo, for values decided on the host (training/signals.py); None: the
    # default group is already gloo (CPU)
    host_group: Optional[dist.ProcessGroup] = None

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        """The one rank that writes TensorBoard and prints (STYLE rule 9): the first TP and DP
        rank of the last pipeline stage, which owns the loss (global rank 0 at PP = 1)."""
        return self.is_last_stage and self.tp_rank == 0 and self.dp_rank == 0


class DeepSpeedMpu:
    """The ``mpu`` interface ``deepspeed.initialize`` expects, over megatron-core's groups.

    megatron.core.parallel_state lacks get_model_parallel_{world_size,rank}; "model parallel"
    here is the tensor × pipeline group (gradient norms are summed over it), and ZeRO shards
    over the data-parallel group only.
    """

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self._ps = ps

    def get_model_parallel_group(self):
        return self._ps.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(self._ps.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(self._ps.get_model_parallel_group())

    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        # DeepSpeed counts a parameter replicated across TP ranks once, on TP rank 0 of every
        # pipeline stage (deepspeed.utils.bwc.bwc_tensor_model_parallel_rank)
        return self._ps.get_tensor_model_parallel_rank()

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()


def _disable_deepspeed_shm_op() -> None:
    """DeepSpeed's first init compiles a shared-memory op (60–65 s, g++ and ninja) that serves
    only its inference all-reduce; training never uses it. Marking it incompatible skips the
    build (there is no environment variable for it in DeepSpeed 0.19)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def check_master_addr(launch: launch_env.LaunchEnv) -> None:
    """Refuse a MASTER_ADDR that does not resolve, before the rendezvous: torch's TCPStore
    would retry it (c10d "gai error" warnings) until the process-group timeout.

    Raises:
        UserInputError: naming MASTER_ADDR, the host and the fix
            (tests/e2e/test_pretrain_errors.py::test_unresolvable_master_addr).
    """
    try:
        socket.getaddrinfo(launch.master_addr, launch.master_port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        how = ("the launcher's --master_addr (deepspeed, torchrun) or MASTER_ADDR"
               if launch.source == "launcher" else "MASTER_ADDR")
        raise UserInputError(
            f"MASTER_ADDR={launch.master_addr}: the host name does not resolve "
            f"({getattr(e, 'strerror', None) or e}); set {how} to the first node's host name or "
            "IP address, as this node resolves it (e.g. `getent hosts NAME`)") from None


def cuda_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device this process trains on, among the ``visible`` ones it sees.

    A launcher that shows every process all of its node's GPUs (``deepspeed``, torchrun,
    ``srun --gpus-per-node``) gives local rank i device i. A step or site that binds one GPU
    to each task (``srun --gpus-per-task=1``, ``--gpu-bind``) shows each task only its own, as
    device 0, whatever its local rank (SLURM_LOCALID 0..7): a process that sees one device
    uses it.

    Raises:
        UserInputError: the local rank is at or past the visible devices and more than one is
            visible (tests/unit/test_rank_env.py::test_a_local_rank_past_the_visible_gpus_is_one_line);
            ``every_rank`` is set on the first such local rank, so each node says it once.
    """
    if visible == 1:
        return 0
    if local_rank < visible:
        return local_rank
    err = UserInputError(
        f"local rank {local_rank} (LOCAL_RANK or SLURM_LOCALID) needs a CUDA device of its own, "
        f"but this process sees {visible} (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {visible} "
        "processes per node, or give each process one GPU (srun --gpus-per-task=1) or all of "
        "the node's (srun --gpus-per-node)")
    err.every_rank = local_rank == visible  # one line per node, not one per process past it
    raise err


def initialize(parallel: ParallelConfig, *, seed: int,
               timeout_minutes: Optional[int] = None) -> ParallelContext:
    """Start torch.distributed and megatron-core's parallel state; seed per the RNG policy.

    The rank, world and rendezvous come from ``launch_env.read``: the launcher's RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (``deepspeed``, torchrun, our Slurm
    scripts), else a Slurm job step's SLURM_* variables (``srun python rtd_scale/pretrain.py``),
    else a single process on a free port. They are exported for torch.distributed's env://.
    ``timeout_minutes`` (default ``parallel.distributed_timeout_minutes``,
    ``--distributed-timeout-minutes``) is the timeout of the default process group and of
    megatron-core's groups.

    Raises:
        UserInputError: when the world size does not divide by tensor × pipeline parallel size,
            a launch variable is malformed, the local rank has no CUDA device it sees
            (``cuda_device_index``), MASTER_ADDR does not resolve, or rank 0 cannot listen on
            MASTER_PORT (in use).
    """
    import deepspeed
    from megatron.core import parallel_state as ps

    if timeout_minutes is None:
        timeout_minutes = parallel.distributed_timeout_minutes
    launch = launch_env.export(launch_env.read())
    if not dist.is_initialized():
        check_master_addr(launch)
    local_rank = launch.local_rank
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        index = cuda_device_index(local_rank, torch.cuda.device_count())
        if index != local_rank:
            # DeepSpeed reads LOCAL_RANK as the device ordinal (the process group's device_id,
            # the engine's set_device, zero.Init's device): give it the device this task sees
            os.environ["LOCAL_RANK"] = str(index)
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        _disable_deepspeed_shm_op()
        threads = launch_env.cpu_threads_per_rank()
        if threads is not None:
            torch.set_num_threads(threads)
    if not dist.is_initialized():
        try:
            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                       verbose=False,
                                       timeout=datetime.timedelta(minutes=timeout_minutes))
        except RuntimeError as e:  # torch's DistNetworkError when the store cannot listen
            if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
                raise
            hint = ("unset MASTER_PORT to let a single process pick a free one"
                    if launch.world_size == 1 else "pass the launcher a free --master_port"
                    if launch.source == "launcher" else
                    "set MASTER_PORT to a free port on the first node (the same for every task)")
            err = UserInputError(
                f"MASTER_PORT {launch.master_port} is already in use on {launch.master_addr} "
                f"(rank 0 listens there to start the run); {hint}")
            err.restartable = True  # the port may be free again by then (pretrain.main)
            raise err from None
    world = dist.get_world_size()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world % (tp * pp):
        raise UserInputError(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} × "
            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks")
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=timeout_minutes,
        create_gloo_process_groups=False,
    )
    cpu_compat.install()
    ctx = ParallelContext(
        rank=dist.get_rank(), world_size=world, local_rank=local_rank,
        tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=tp,
        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp,
        dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
        device=device, backend=backend,
        tp_group=ps.get_tensor_model_parallel_group(), dp_group=ps.get_data_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        embedding_group=(ps.get_embedding_group() if pp > 1 and ps.is_rank_in_embedding_group()
                         else None),
        last_stage_global_rank=ps.get_pipeline_model_parallel_last_rank(),
        host_group=dist.new_group(backend="gloo") if backend == "nccl" else None,
    )
    torch.manual_seed(seed)  # model initialisation: identical on every rank
    return ctx


def seed_after_build(ctx: ParallelContext, seed: int) -> None:
    """Seed dropout after the model is built (see the module docstring's RNG policy)."""
    runtime_seed = seed + 100 * ctx.pp_rank + 10 * ctx.dp_rank
    cpu_compat.model_parallel_manual_seed(runtime_seed, tp_rank=ctx.tp_rank)


def teardown() -> None:
    """Destroy megatron-core's parallel state and the default process group."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
