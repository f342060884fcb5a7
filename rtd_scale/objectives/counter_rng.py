"""Counter-based random numbers: a pure function of integer keys.

Every random decision of the RTD objective (which positions are masked, what a masked slot
receives, the Gumbel noise of the sampler) is a hash of integer counters rather than a draw from a
stateful generator. So the decision for (seed, sample index, position, ...) is the same whichever
rank computes it, at any tensor-, pipeline- or data-parallel size, and after any resume
(arXiv 2111.09543 does not prescribe this; it is rtd_scale's RNG policy, see
``rtd_scale/distributed.py``).

The mixer is the 32-bit "lowbias32" integer hash (C. Wellons, "Hash function prospector", 2018),
evaluated in int64 arithmetic with every intermediate reduced modulo 2**32, so it runs identically
on any device torch supports (and on Python ints, for keys that are plain numbers). ``uniform``
gives fp64 uniforms carrying 32 random bits; ``hash_columns`` + ``uniform32`` give fp32 uniforms
(23 bits) for wide per-row draws (the sampler's noise) from one hash of each row's keys.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF

# Stream tags keep unrelated decisions independent even when their other keys coincide.
STREAM_MASK = 0x6D61736B  # "mask": is a position masked
STREAM_MASK_ACTION = 0x61637431  # what a masked slot receives ([MASK] / random / kept)
STREAM_RANDOM_TOKEN = 0x72616E64  # which random token a slot receives
STREAM_GUMBEL = 0x67756D62  # Gumbel noise of the sampler, per vocabulary id
STREAM_GUMBEL_BLOCK = 0x67626C6B  # Gumbel noise of the sampler, per block of ids
STREAM_SHUFFLE_LABELS = 0x73686666  # the shuffled-labels negative control's permutation


def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """lowbias32 avalanche mix of values in [0, 2**32): an int64 tensor, or a Python int.

    Args:
        x: int64 tensor of any shape, or an int.
    Returns:
        the same kind (int64 tensor of the same shape, or int), values in [0, 2**32).
    """
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    x = x ^ (x >> 16)
    return x


def hash_keys(*keys: torch.Tensor | int) -> torch.Tensor:
    """Hash a sequence of integer keys (tensors broadcast together, or Python ints) to 32 bits.

    Keys may be 64-bit; both halves enter the hash. The result is an int64 tensor in
    [0, 2**32) with the broadcast shape of the tensor keys (a 0-d CPU tensor when every key is
    an int). Leading int keys are folded on the host in Python arithmetic, which gives the same
    value as tensor arithmetic and creates no device tensor (on a GPU a tensor made from a Python
    number is a host-to-device copy that waits for the device).
    """
    h: torch.Tensor | int | None = None
    for k in keys:
        if not isinstance(k, torch.Tensor):
            k = int(k)
        lo, hi = k & _M32, (k >> 32) & _M32
        if h is None:
            h = mix32(lo ^ 0x9E3779B9)
        else:
            h = mix32(h ^ mix32(lo + 0x9E3779B9))
        h = mix32(h ^ mix32(hi + 0x85EBCA6B))
    assert h is not None, "hash_keys needs at least one key"
    if not isinstance(h, torch.Tensor):
        h = torch.tensor(h, dtype=torch.int64)
    return h


def hash_columns(row_hash: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Per-(row, column) hashes from one hash per row: mix32(row_hash ^ mix32(column + c)).

    The row's keys are hashed once (``hash_keys``, [n]); each column id then costs two 32-bit
    mixes instead of a hash of every key.

    Args:
        row_hash: [n] int64 in [0, 2**32), e.g. ``hash_keys(stream, seed, step, sample, position)``.
        columns: int64 column ids (e.g. global vocabulary ids): [m], shared by every row, or
            [n, m], one set per row.
    Returns:
        [n, m] int64 in [0, 2**32).
    """
    if columns.dim() == 1:
        columns = columns.view(1, -1)
    return mix32(row_hash.view(-1, 1) ^ mix32(columns + 0x9E3779B9))


def uniform32(h: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in the open interval (0, 1) from 32-bit hashes: the top 23 bits k give
    (k + 0.5) / 2**23, exact in fp32 (from 2**-24 to 1 - 2**-24)."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def uniform_from_hash(h: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Map 32-bit hashes to uniforms in the open interval (0, 1): (h + 0.5) / 2**32."""
    return (h.to(dtype) + 0.5) * (1.0 / 4294967296.0)


def uniform(*keys: torch.Tensor | int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Uniform(0, 1) values that are a pure function of the integer keys (see ``hash_keys``)."""
    return uniform_from_hash(hash_keys(*keys), dtype)
