"""Relative positions of DeBERTa's disentangled attention: the log buckets, the index δ(i, j)
and the rows of the relative table a sequence reads (arXiv 2006.03654 §3.1; Hugging Face
``models/deberta_v2/modeling_deberta_v2.py``, ``make_log_bucket_position`` and
``build_relative_position``).

Torch only (no megatron-core), so ``rtd_scale.flops`` and ``tools/estimate_cost.py`` can count
the rows without importing the model; ``model/disentangled.py`` re-exports all three.
"""
from __future__ import annotations

import functools

import torch


def log_bucket_position(relative_pos: torch.Tensor, position_buckets: int,
                        max_position: int) -> torch.Tensor:
    """DeBERTa's log buckets of relative distances (Hugging Face ``make_log_bucket_position``).

    Distances with |r| ≤ position_buckets / 2 stay as they are; longer ones map to
    sign(r)·(⌈log(|r| / m) / log((max_position − 1) / m) · (m − 1)⌉ + m), m = position_buckets / 2,
    so |bucket| reaches position_buckets − 1 at |r| = max_position − 1.

    Args:
        relative_pos: int64 tensor of any shape, distances i − j.
        position_buckets: total buckets k (> 0).
        max_position: the longest distance mapped (``max_relative_positions``).
    Returns:
        int64, same shape.
    """
    mid = position_buckets // 2
    magnitude = relative_pos.abs()
    near = magnitude <= mid
    # the log is computed for near distances too (and discarded): keep its argument ≥ 1
    safe = torch.where(near, torch.full_like(magnitude, mid), magnitude).float()
    # log((max − 1) / m) rounded to float32 as Hugging Face computes it; a Python number, so
    # no host tensor meets a device one
    denom = torch.log(torch.tensor((max_position - 1) / mid, dtype=torch.float32)).item()
    far = torch.ceil(torch.log(safe / mid) / denom * (mid - 1)) + mid
    return torch.where(near, relative_pos, (far * relative_pos.sign()).long())


def relative_position_index(seq_length: int, span: int, position_buckets: int,
                            max_position: int, device=None) -> torch.Tensor:
    """δ(i, j) [s, s] int64: the row of the 2·span relative embeddings that query i uses for
    key j, clamp(bucket(i − j) + span, 0, 2·span − 1) (Hugging Face ``c2p_pos``).

    Args:
        position_buckets: buckets (> 0), or ≤ 0 for plain distances (no buckets).
    """
    pos = torch.arange(seq_length, device=device)
    rel = pos[:, None] - pos[None, :]
    if position_buckets > 0:
        rel = log_bucket_position(rel, position_buckets, max_position)
    return (rel + span).clamp(0, 2 * span - 1)


@functools.lru_cache(maxsize=64)
def used_rows(seq_length: int, span: int, position_buckets: int,
              max_position: int) -> tuple[int, int]:
    """[lo, hi): the rows of the 2·span relative embeddings that a sequence of ``seq_length``
    reads (δ is monotone in i − j, so the longest distance bounds them). Only these rows are
    projected: at seq 128 with 256 buckets, 255 of 512. Host arithmetic, no device sync."""
    far = torch.tensor([seq_length - 1])
    if position_buckets > 0:
        far = log_bucket_position(far, position_buckets, max_position)
    reach = int(far.item())
    return max(span - reach, 0), min(span + reach, 2 * span - 1) + 1
