"""The one place where megatron-core is adapted to run without a GPU.

megatron-core 0.16.1 runs on CPU except for its model-parallel RNG tracker, which stores and
restores *CUDA* generator states (``tensor_parallel.random.CudaRNGStatesTracker``). On a machine
without CUDA we install a tracker with the same interface and semantics over the CPU generator,
so dropout inside tensor-parallel regions follows megatron-core's policy on CPU too (different
across TP ranks, the same across data-parallel replicas).

Its pipeline schedules allocate two kinds of tensors on CUDA unconditionally (a token counter with
``device="cuda"`` in ``schedules.py`` and the receive buffers on ``torch.cuda.current_device()`` in
``p2p_communication.py``). Those two modules get a ``torch`` stand-in that places such tensors on
the CPU and delegates everything else to torch; nothing outside them is touched. Activation
recompute (``tensor_parallel.CheckpointFunction``) saves and restores the "CUDA" generator
state; on CPU that state is the CPU generator's.

Everything else megatron-core would do on "cuda" is avoided by configuration, not patched:
``use_cpu_initialization=True``, the fusions off (gradient_accumulation_fusion,
bias_dropout_fusion, masked_softmax_fusion, persist_layer_norm), and our own SDPA core attention
instead of the local ``DotProductAttention`` (see ``model/specs.py``).

``install()`` is applied only when CUDA is unavailable and is idempotent.
"""
from __future__ import annotations

import contextlib

import torch
from megatron.core.tensor_parallel import random as mcore_random


class CpuRNGStatesTracker(mcore_random.CudaRNGStatesTracker):
    """megatron-core's RNG-states tracker over the CPU default generator."""

    def __init__(self) -> None:
        super().__init__(use_cudagraphable_rng=False)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _CpuDevice:
    """``torch.cuda`` as seen by megatron-core's pipeline modules on a CPU-only machine."""

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(*args, **kwargs) -> None:
        return None

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` for megatron-core's pipeline modules: "cuda" placements become "cpu"."""

    cuda = _CpuDevice()

    @staticmethod
    def _cpu(kwargs):
        dev = kwargs.get("device")
        if dev is not None and "cuda" in str(dev):
            kwargs["device"] = "cpu"
        return kwargs

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **self._cpu(kwargs))

    def empty(self, *args, **kwargs):
        return torch.empty(*args, **self._cpu(kwargs))

    def tensor(self, *args, **kwargs):
        return torch.tensor(*args, **self._cpu(kwargs))

    def __getattr__(self, name):
        return getattr(torch, name)


def needed() -> bool:
    """True when this process computes on CPU (no CUDA device)."""
    return not torch.cuda.is_available()


def install() -> None:
    """Make megatron-core's RNG tracker, activation recompute and pipeline schedules work on
    the CPU (no-op when CUDA is available)."""
    if not needed():
        return
    if not isinstance(mcore_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mcore_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        mcore_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # activation recompute: the "CUDA" generator state is the CPU one
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    schedules.torch = p2p_communication.torch = _TorchOnCpu()


def model_parallel_manual_seed(seed: int, tp_rank: int) -> None:
    """megatron-core's ``model_parallel_cuda_manual_seed`` policy, on whichever device is used.

    default generator: ``seed`` (same across TP ranks, differs per DP rank when the caller
    offsets it); tracker "model-parallel-rng": seed + 2718 + tp_rank (megatron-core's offsets).
    """
    if not needed():
        mcore_random.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
        return
    install()
    tracker = mcore_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mcore_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mcore_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024)
