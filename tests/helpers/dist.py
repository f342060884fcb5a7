"""One process-start helper for multi-process tests (STYLE rule 11): run ``fn(ctx, *args)`` on
``world_size`` gloo processes laid out as TP × PP × DP, and return every rank's result."""
from __future__ import annotations

import os
import tempfile
import time
import traceback
import warnings

import torch

from rtd_scale.launch_env import start_forked_workers
from tests.helpers.env import PORT_TAKEN, free_port


# What every worker imports, loaded once by the forkserver that run() forks its workers from
# (spawn imported them again in each worker: ~5 CPU-s a process).
PRELOAD = ["tests.helpers.dist_workers", "rtd_scale.distributed", "rtd_scale.model.build",
           "rtd_scale.training.engine", "deepspeed"]


def _worker(rank: int, world_size: int, tp: int, pp: int, port: int, out_dir: str, fn,
            args, environ: dict) -> None:
    warnings.filterwarnings("ignore")
    os.environ.clear()  # the caller's environment at run(), as spawn would give it
    os.environ.update(environ)
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
    (module level). Raises AssertionError with the worker's traceback when a rank fails.

    A world refused because its port, found free, was taken before rank 0 listened (another
    pytest-xdist worker's process took it) starts again on another port, up to 3 times."""
    for _ in range(3):
        results = _run_once(fn, args, world_size, tp, pp, timeout)
        if not any(status == "error" and PORT_TAKEN.search(v) for status, v in results):
            break
    for r, (status, value) in enumerate(results):
        assert status == "ok", f"rank {r} failed:\n{value}"
    return [value for _, value in results]


def _run_once(fn, args, world_size: int, tp: int, pp: int, timeout: float) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = start_forked_workers(_worker, (world_size, tp, pp, free_port(), out_dir, fn, args,
                                             dict(os.environ)), world_size, PRELOAD)
        deadline = time.monotonic() + timeout
        # join returns False while any rank still runs (it wakes as each one ends)
        while not ctx.join(max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                break
        results = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            assert os.path.exists(path), f"rank {r} produced no result (crashed or timed out)"
            results.append(torch.load(path, weights_only=False))
        return results
