"""Sampling the generator's replacements without gathering the vocabulary.

Gumbel-max (Gumbel 1954; Maddison et al., arXiv 1411.0199): argmax_v(logits_v / T + g_v) with
g_v ~ Gumbel(0, 1) i.i.d. is an exact sample from softmax(logits / T). Under tensor parallelism
each rank holds a shard of the vocabulary; it finds its shard's winner, and an all-reduce over
the tensor-parallel group picks the global one (one all-reduce of the values, one of the ids):
O(n) communication instead of O(n·V).

**Two-level Gumbel-max.** Noise for all n × V entries costs more than the rest of the MLM head
on CPU, so the draw is made in two exact stages over blocks of ``BLOCK`` = 128 consecutive ids
(the vocabulary is padded to 128 × TP, so every shard holds whole blocks):

1. each block b gets the score log Z_b + G_b, where log Z_b = logsumexp of its ids' logits / T
   and G_b ~ Gumbel(0, 1): the argmax is block b with probability Z_b / Z;
2. inside the winning block, plain Gumbel-max over its 128 ids picks id v with probability
   exp(logit_v / T) / Z_b.

So v is drawn with probability (Z_b / Z) · (exp(logit_v / T) / Z_b) = softmax(logits / T)_v —
the max of Gumbels shifted by log-masses is Gumbel(log Σ masses) and its argmax is independent of
its value, which is the same fact that makes Gumbel-max exact (Maddison et al., §2). Noise is
drawn for n × (V / 128 + 128) entries instead of n × V; the block sums are computed by a fixed
pairwise tree of elementwise adds, so they are bitwise the same on every rank and TP size.
A shard that is not a whole number of blocks (direct calls with a small vocabulary) falls back
to one-level Gumbel-max over single ids.

The noise is counter-based (``counter_rng``): G_b = Gumbel(hash(seed, step, global sample index,
position; global block id)) and g_v = Gumbel(hash(seed, step, global sample index, position;
global vocab id)), the row keys hashed once per row and the id mixed in with 32-bit arithmetic,
fp32 uniforms. A rank computes only its shard's noise, yet the sampled id does not depend on the
tensor- or data-parallel size (DESIGN.md §3), nor on how rows are batched.

RTD samples, never takes the argmax of the generator (arXiv 2111.09543 §3.1; ELECTRA
arXiv 2003.10555 §2). Special and padded ids are never sampled. No host synchronisation.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from rtd_scale.objectives import counter_rng as rng

BLOCK = 128  # ids per block of the first stage; divides every shard (vocab padded to 128 × TP)
_CPU_CHUNK_ELEMENTS = 1 << 22  # 16 MiB of fp32 scores
# Noise is computed on widths padded to a multiple of this, so that every element goes through
# the same (vectorised) code path of torch's CPU kernels at any shard width.
_NOISE_WIDTH_MULTIPLE = 64


def gumbel_noise(row_hash: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Counter-based Gumbel(0, 1) noise: -log(-log(u)), u = uniform32(hash_columns(row, column)).

    Args:
        row_hash: [n] int64 hashes of each row's keys (``counter_rng.hash_keys``).
        columns: [m] (shared by every row) or [n, m] int64 global column ids (vocabulary or
            block ids).
    Returns:
        [n, m] float32; entry (i, j) depends only on row_hash[i] and its column id.
    """
    m = columns.shape[-1]
    width = -(-m // _NOISE_WIDTH_MULTIPLE) * _NOISE_WIDTH_MULTIPLE
    if width != m:
        pad = columns.new_zeros(*columns.shape[:-1], width - m)
        columns = torch.cat([columns, pad], dim=-1)
    u = rng.uniform32(rng.hash_columns(row_hash, columns))
    return u.log_().neg_().log_().neg_()[:, :m]


def _block_logsumexp_(scores: torch.Tensor, block: int) -> torch.Tensor:
    """log Σ exp over each block of ``block`` consecutive columns; overwrites ``scores``.

    The sums are a fixed pairwise tree of elementwise adds (not a reduction kernel, whose order
    may depend on the tensor's shape), so a block's value is bitwise the same at any shard width.

    Args:
        scores: [n, nb · block] float32, -inf allowed (a block of only -inf gives -inf).
    Returns:
        [n, nb] float32.
    """
    n = scores.shape[0]
    blocks = scores.view(n, -1, block)
    top = blocks.amax(dim=-1)  # [n, nb]
    top = torch.where(torch.isfinite(top), top, torch.zeros((), device=top.device))
    mass = blocks.sub_(top.unsqueeze(-1)).exp_()
    while mass.shape[-1] > 1:
        half = mass.shape[-1] // 2
        mass = mass[..., :half] + mass[..., half:]
    return mass.squeeze(-1).log_().add_(top)


def _scores(logits: torch.Tensor, sampleable: torch.Tensor, temperature: float,
            local_disallow: Optional[torch.Tensor]) -> torch.Tensor:
    """[n, V_local] fp32: logits / T, -inf at ids never sampled and at each row's disallowed id
    (static shapes, no host sync). ``sampleable`` is [V_local] or [n, V_local]."""
    bias = torch.zeros(sampleable.shape, dtype=torch.float32, device=logits.device)
    scores = torch.add(logits, bias.masked_fill_(~sampleable, float("-inf")))  # a new fp32 tensor
    if temperature != 1.0:
        scores.div_(temperature)
    if local_disallow is not None:
        width = scores.shape[1]
        inside = (local_disallow >= 0) & (local_disallow < width)
        col = local_disallow.clamp(0, width - 1).view(-1, 1)
        ninf = torch.full((), float("-inf"), device=scores.device)
        scores.scatter_(1, col, torch.where(inside.view(-1, 1), ninf, scores.gather(1, col)))
    return scores


def _shard_winner(logits: torch.Tensor, row_block: torch.Tensor, row_id: torch.Tensor,
                  vocab_start: int, sampleable: torch.Tensor, temperature: float,
                  local_disallow: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's winning score [n] fp32 and global id [n] int64 for ``logits`` [n, V_local]."""
    n, v_local = logits.shape
    device = logits.device
    scores = _scores(logits, sampleable, temperature, local_disallow)
    if vocab_start % BLOCK or v_local % BLOCK:  # one level: every id is its own block
        ids = torch.arange(vocab_start, vocab_start + v_local, device=device)
        best, best_local = scores.add_(gumbel_noise(row_id, ids)).max(dim=-1)
        return best, best_local + vocab_start
    # stage 1: a block, with probability Z_b / Z
    first_block, nb = vocab_start // BLOCK, v_local // BLOCK
    log_mass = _block_logsumexp_(scores, BLOCK)  # [n, nb]; scores overwritten
    block_ids = torch.arange(first_block, first_block + nb, device=device)
    best, winner = (log_mass + gumbel_noise(row_block, block_ids)).max(dim=-1)  # [n]
    # stage 2: an id of that block, with probability exp(logit_v / T) / Z_b
    cols = winner.view(-1, 1) * BLOCK + torch.arange(BLOCK, device=device).view(1, -1)
    inner = _scores(logits.gather(1, cols), sampleable[cols], temperature, None)
    if local_disallow is not None:
        inner.masked_fill_(cols == local_disallow.view(-1, 1), float("-inf"))
    pick = inner.add_(gumbel_noise(row_id, cols + vocab_start)).argmax(dim=-1, keepdim=True)
    return best, cols.gather(1, pick).view(-1) + vocab_start


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
    """Draw one id per row from softmax(logits / temperature), vocab-parallel, two-level
    Gumbel-max (module docstring).

    Args:
        logits: [n, V_local] this rank's vocabulary shard of the generator's logits at the
            n masked positions (any float dtype; computed in fp32; not modified).
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
        [n] int64 global ids, the same on every rank of ``tp_group`` and at any TP size whose
        shards are whole blocks of 128 ids.
    Raises:
        ValueError: if temperature <= 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    n, v_local = logits.shape
    device = logits.device
    sample_index = sample_index.to(device=device, dtype=torch.int64)
    position = position.to(device=device, dtype=torch.int64)
    row_block = rng.hash_keys(rng.STREAM_GUMBEL_BLOCK, seed, step, sample_index, position)
    row_id = rng.hash_keys(rng.STREAM_GUMBEL, seed, step, sample_index, position)
    local_disallow = None if disallow_ids is None else disallow_ids.to(device) - vocab_start
    sampleable = sampleable.to(device)
    best = torch.empty(n, dtype=torch.float32, device=device)
    best_global = torch.empty(n, dtype=torch.int64, device=device)
    # On CPU, rows go in chunks of at most _CPU_CHUNK_ELEMENTS scores: larger temporaries are
    # fresh memory maps on every call, whose page faults cost more than the arithmetic.
    chunk = max(1, _CPU_CHUNK_ELEMENTS // max(1, v_local)) if device.type == "cpu" else max(1, n)
    for r0 in range(0, n, chunk):
        rows = slice(r0, min(n, r0 + chunk))
        best[rows], best_global[rows] = _shard_winner(
            logits[rows], row_block[rows], row_id[rows], vocab_start, sampleable, temperature,
            None if local_disallow is None else local_disallow[rows])
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        winner = best.clone()
        dist.all_reduce(winner, op=dist.ReduceOp.MAX, group=tp_group)
        sentinel = torch.iinfo(torch.int64).max
        candidate = torch.where(best == winner, best_global, torch.full_like(best_global, sentinel))
        dist.all_reduce(candidate, op=dist.ReduceOp.MIN, group=tp_group)
        best_global = candidate
    return best_global
