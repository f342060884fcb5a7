"""One spawn helper for multi-process tests (STYLE rule 11): run ``fn(ctx, *args)`` on
``world_size`` gloo processes laid out as TP × PP × DP, and return every rank's result."""
from __future__ import annotations

import os
import tempfile
import traceback
import warnings

import torch
import torch.multiprocessing as mp

from tests.helpers.env import free_port


def _worker(rank: int, world_size: int, tp: int, pp: int, port: int, out_dir: str, fn,
            args) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from rtd_scale import distributed
    from rtd_scale.config import ParallelConfig

    result = None
    try:
        ctx = distributed.initialize(
            ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), seed=0)
        try:
            result = ("ok", fn(ctx, *args))
        finally:
            distributed.teardown()
    except BaseException:  # noqa: BLE001 — reported to the parent
        result = ("error", traceback.format_exc())
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run(fn, *args, world_size: int, tp: int = 1, pp: int = 1, timeout: float = 600.0) -> list:
    """Results of ``fn(ctx, *args)`` per rank (rank order). ``fn`` must be importable
    (module level). Raises AssertionError with the worker's traceback when a rank fails."""
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_worker, args=(world_size, tp, pp, free_port(), out_dir, fn, args),
                                 nprocs=world_size, join=False, start_method="spawn")
        if not ctx.join(timeout):
            for proc in ctx.processes:
                proc.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            assert os.path.exists(path), f"rank {r} produced no result (crashed or timed out)"
            status, value = torch.load(path, weights_only=False)
            assert status == "ok", f"rank {r} failed:\n{value}"
            results.append(value)
        return results
