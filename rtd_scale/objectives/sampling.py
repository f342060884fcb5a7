"""Sampling the generator's replacements without gathering the vocabulary.

Gumbel-max (Gumbel 1954; Maddison et al., arXiv 1411.0199): argmax_v(logits_v / T + g_v) with
g_v ~ Gumbel(0, 1) i.i.d. is an exact sample from softmax(logits / T). Under tensor parallelism
each rank holds a shard of the vocabulary; it adds noise to its shard, takes its local maximum,
and an all-reduce over the tensor-parallel group picks the global winner (one all-reduce of the
values, one of the indices): O(n) communication instead of O(n·V).

The noise is counter-based: g = -log(-log(u)), u = hash(seed, step, global sample index,
position, global vocab id) (``counter_rng``), so a rank computes only its shard's noise yet the
sampled id does not depend on the tensor- or data-parallel size (DESIGN.md §3).

RTD samples, never takes the argmax of the generator (arXiv 2111.09543 §3.1; ELECTRA
arXiv 2003.10555 §2). Special and padded ids are never sampled.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from rtd_scale.objectives import counter_rng as rng


def gumbel_noise(
    row_keys: tuple[torch.Tensor | int, ...], vocab_start: int, vocab_local: int
) -> torch.Tensor:
    """Counter-based Gumbel(0, 1) noise for one vocabulary shard.

    Args:
        row_keys: integer keys of each row, tensors shaped [n] (or ints), e.g.
            (seed, step, sample_index [n], position [n]).
        vocab_start: global id of the shard's first column.
        vocab_local: number of columns in the shard.
    Returns:
        [n, vocab_local] float32 noise; column j is the noise of global id vocab_start + j.
    """
    keys = [k.view(-1, 1) if isinstance(k, torch.Tensor) else k for k in row_keys]
    device = next((k.device for k in keys if isinstance(k, torch.Tensor)), torch.device("cpu"))
    vocab = torch.arange(vocab_start, vocab_start + vocab_local, device=device, dtype=torch.int64)
    u = rng.uniform(rng.STREAM_GUMBEL, *keys, vocab.view(1, -1), dtype=torch.float64)
    return (-torch.log(-torch.log(u))).to(torch.float32)


@torch.no_grad()
def sample_from_logits(
    logits: torch.Tensor,
    *,
    seed: int,
    step: int,
    sample_index: torch.Tensor,
    position: torch.Tensor,
    vocab_start: int,
    sampleable: torch.Tensor,
    temperature: float = 1.0,
    disallow_ids: Optional[torch.Tensor] = None,
    tp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Draw one id per row from softmax(logits / temperature) with vocab-parallel Gumbel-max.

    Args:
        logits: [n, V_local] this rank's vocabulary shard of the generator's logits at the
            n masked positions (any float dtype; computed in fp32).
        seed: run seed.
        step: optimizer step (part of the noise key).
        sample_index: [n] int64 global sample index of each row.
        position: [n] int64 position of each row within its sample.
        vocab_start: global id of this shard's first column.
        sampleable: [V_local] bool, False for special and padded ids (never sampled).
        temperature: softmax temperature T > 0.
        disallow_ids: optional [n] int64 global id per row that must not be drawn
            (ELECTRA's ``disallow_correct``: the original token).
        tp_group: tensor-parallel group over which the vocabulary is split (None: unsplit).
    Returns:
        [n] int64 global ids.
    Raises:
        ValueError: if temperature <= 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n, v_local = logits.shape
    scores = logits.float() / temperature
    scores = scores + gumbel_noise((seed, step, sample_index, position), vocab_start, v_local)
    scores = scores.masked_fill(~sampleable.view(1, -1), float("-inf"))
    if disallow_ids is not None:
        local = disallow_ids - vocab_start
        inside = (local >= 0) & (local < v_local)
        rows = torch.nonzero(inside, as_tuple=True)[0]
        scores[rows, local[rows]] = float("-inf")
    best, best_local = scores.max(dim=-1)
    best_global = best_local + vocab_start
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        winner = best.clone()
        dist.all_reduce(winner, op=dist.ReduceOp.MAX, group=tp_group)
        sentinel = torch.iinfo(torch.int64).max
        candidate = torch.where(best == winner, best_global, torch.full_like(best_global, sentinel))
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=tp_group)
        best_global = candidate
    return best_global
