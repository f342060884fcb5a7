"""Counter-based random numbers: a pure function of integer keys.

Every random decision of the RTD objective (which positions are masked, what a masked slot
receives, the Gumbel noise of the sampler) is a hash of integer counters rather than a draw from a
stateful generator. So the decision for (seed, sample index, position, ...) is the same whichever
rank computes it, at any tensor-, pipeline- or data-parallel size, and after any resume
(arXiv 2111.09543 does not prescribe this; it is rtd_scale's RNG policy, see
``rtd_scale/distributed.py``).

The mixer is the 32-bit "lowbias32" integer hash (C. Wellons, "Hash function prospector", 2018),
evaluated in int64 arithmetic with every intermediate reduced modulo 2**32, so it runs identically
on any device torch supports. Uniforms carry 32 random bits.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF

# Stream tags keep unrelated decisions independent even when their other keys coincide.
STREAM_MASK = 0x6D61736B  # "mask": is a position masked
STREAM_MASK_ACTION = 0x61637431  # what a masked slot receives ([MASK] / random / kept)
STREAM_RANDOM_TOKEN = 0x72616E64  # which random token a slot receives
STREAM_GUMBEL = 0x67756D62  # Gumbel noise of the sampler


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 avalanche mix of an int64 tensor holding values in [0, 2**32).

    Args:
        x: int64 tensor of any shape.
    Returns:
        int64 tensor of the same shape, values in [0, 2**32).
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
    [0, 2**32) with the broadcast shape of the tensor keys.
    """
    h: torch.Tensor | None = None
    device = next((k.device for k in keys if isinstance(k, torch.Tensor)), torch.device("cpu"))
    for k in keys:
        k = torch.as_tensor(k, dtype=torch.int64, device=device)
        lo, hi = k & _M32, (k >> 32) & _M32
        if h is None:
            h = mix32(lo ^ 0x9E3779B9)
        else:
            h = mix32(h ^ mix32(lo + 0x9E3779B9))
        h = mix32(h ^ mix32(hi + 0x85EBCA6B))
    assert h is not None, "hash_keys needs at least one key"
    return h


def uniform_from_hash(h: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Map 32-bit hashes to uniforms in the open interval (0, 1): (h + 0.5) / 2**32."""
    return (h.to(dtype) + 0.5) * (1.0 / 4294967296.0)


def uniform(*keys: torch.Tensor | int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Uniform(0, 1) values that are a pure function of the integer keys (see ``hash_keys``)."""
    return uniform_from_hash(hash_keys(*keys), dtype)
