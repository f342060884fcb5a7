"""Batch arithmetic: how a global batch splits over data-parallel ranks, micro-batches and
gradient-accumulation steps (Megatron-LM's ``global = micro × accumulation × DP``, with
DP = world / (TP × PP)).

:func:`batch_layout` checks the numbers and explains, in the caller's words (:class:`BatchNames`),
those that do not divide; :func:`rank_share` is the split once DP is known; :func:`batch_arithmetic`
is pretrain.py's call, with its flag names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rtd_scale.config import ConfigError, RunConfig, divisors


@dataclass(frozen=True)
class BatchNames:
    """How :func:`batch_layout`'s errors name its numbers: a format per value ("{}" is the
    value), what a rank is called in the job as a whole and on one node, and what each error
    suggests changing."""

    global_batch: str = "--global-batch-size {}"
    micro_batch: str = "--micro-batch-size {}"
    tp: str = "--tensor-model-parallel-size {}"
    pp: str = "--pipeline-model-parallel-size {}"
    ranks: str = "ranks"
    ranks_per_node: str = "ranks"
    global_fix: str = "change --global-batch-size or the number of ranks"
    per_node_fix: str = ""


def batch_layout(world_size: int, global_batch: int, micro_batch: int, *, tp: int = 1,
                 pp: int = 1, ranks_per_node: Optional[int] = None,
                 names: BatchNames = BatchNames()) -> tuple[int, int]:
    """(data-parallel size, gradient-accumulation steps) of ``world_size`` ranks at
    tensor × pipeline parallel size ``tp`` × ``pp``: DP = world / (TP × PP) and
    global = micro × accumulation × DP. The one implementation of that arithmetic: pretrain.py
    (:func:`batch_arithmetic`), the Slurm job before it starts its tasks
    (``python -m rtd_scale.launch_env batch-arithmetic``) and tools/estimate_cost.py; where DP
    is already known (the loader, the training loop, the resolved ds_config) the split is
    :func:`rank_share`'s.
    With ``ranks_per_node`` (a job of several nodes), TP must divide it too: megatron-core puts
    consecutive ranks in one TP group and Slurm numbers ranks node by node, so otherwise a TP
    group would span two nodes.

    Raises:
        ConfigError: one line, in ``names``' words, when the numbers do not divide, with the
            sizes that would.
    """
    mp = tp * pp
    tp_name = names.tp.format(tp)
    if world_size % mp:
        what = (f"{tp_name} (tensor-parallel size)" if pp == 1 else
                f"{tp_name} × {names.pp.format(pp)} (model-parallel size {mp})")
        raise ConfigError(f"{world_size} {names.ranks} are not divisible by {what}; launch a "
                          f"multiple of {mp} {names.ranks}")
    if ranks_per_node is not None and ranks_per_node % tp:
        raise ConfigError(f"{tp_name} does not divide the {ranks_per_node} "
                          f"{names.ranks_per_node} per node: tensor-parallel groups would span "
                          f"nodes{names.per_node_fix}")
    dp = world_size // mp
    model_parallel = f"TP {tp}" + (f" × PP {pp}" if pp > 1 else "")
    if global_batch % dp:
        fix = names.global_fix
        if ranks_per_node is not None and (ranks_per_node * 1024) % mp == 0:
            nodes = [n for n in range(1, 1025) if (n * ranks_per_node) % mp == 0
                     and global_batch % (n * ranks_per_node // mp) == 0][:8]
            fix += (f" (node counts that work at {ranks_per_node} {names.ranks_per_node} per "
                    f"node: {' '.join(map(str, nodes))})" if nodes else "")
        raise ConfigError(f"{names.global_batch.format(global_batch)} is not divisible by the "
                          f"data-parallel size {dp} (= {world_size} {names.ranks} / "
                          f"{model_parallel}): no micro-batch and accumulation give exactly "
                          f"{global_batch}; {fix}")
    per_rank = global_batch // dp
    if per_rank % micro_batch:
        raise ConfigError(f"{names.micro_batch.format(micro_batch)} does not divide the "
                          f"{per_rank} samples per data-parallel rank per step (global "
                          f"{global_batch} / DP {dp}); micro-batch sizes that do: "
                          f"{' '.join(map(str, divisors(per_rank)))}")
    return dp, rank_share(global_batch, micro_batch, dp)[1]


def rank_share(global_batch: int, micro_batch: int, data_parallel_size: int) -> tuple[int, int]:
    """(samples, micro-batches) of one data-parallel rank in one optimizer step: its
    global / DP samples, run as global / (micro × DP) micro-batches — the gradient-accumulation
    steps. For numbers :func:`batch_layout` accepts (it explains, in the user's words, those
    that do not divide); anything else is a programming error.
    """
    per_rank, rest = divmod(global_batch, data_parallel_size)
    assert rest == 0 and per_rank % micro_batch == 0, (global_batch, micro_batch,
                                                       data_parallel_size)
    return per_rank, per_rank // micro_batch


def batch_arithmetic(cfg: RunConfig, world_size: int) -> tuple[int, int]:
    """(data_parallel_size, gradient_accumulation_steps) of ``cfg`` on ``world_size`` ranks
    (:func:`batch_layout` with pretrain.py's flag names).

    Raises:
        ConfigError: naming the flags, when the numbers do not divide.
    """
    return batch_layout(world_size, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                        tp=cfg.parallel.tensor_model_parallel_size,
                        pp=cfg.parallel.pipeline_model_parallel_size)
