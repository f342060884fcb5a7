"""Weights that do not depend on how the model is split.

- ``initialize``: every parameter is drawn whole — at its unpartitioned shape, real vocabulary rows
  only — from a generator seeded by (seed, parameter name), and this rank keeps its slice. The
  initial model is therefore the same at every tensor-parallel size (and, with stage-independent
  names, every pipeline split), which is what lets a TP=2 run reproduce a TP=1 run.
- ``full_state_dict`` / ``load_full_state_dict``: a TP-agnostic state dict (tensor-parallel shards
  gathered along their partition dimension, vocabulary padding removed) and its inverse, so a model
  trained at one TP size loads at another
  (tests/multiproc/test_vocab_padding.py::test_padded_vocab_saved_at_tp2_loads_at_tp1). A gated
  FFN's fc1 (``mark_gated``) is [a; g] unpartitioned, each half split over the ranks
  (tests/multiproc/test_tensor_parallel.py, case modern_gdes).

Initialisation rules (BERT / megatron-core): weights N(0, std²), including the token-type row of
the post-LayerNorm layout (Hugging Face ``ElectraPreTrainedModel._init_weights`` draws every
embedding N(0, initializer_range²)); in the pre-LayerNorm layout the output projections of each
residual branch (attention ``linear_proj``, MLP ``linear_fc2``) N(0, (std / sqrt(2·num_layers))²)
(megatron-core's ``output_layer_init_method``, GPT-2's rule for pre-LN stacks), in the
post-LayerNorm layout N(0, std²) like every other weight (BERT / ELECTRA, whose LayerNorm after
each add rescales the residual stream); biases 0; LayerNorm weight 1, bias 0 (also the norms that
TransformerEngine fuses into a linear, ``layer_norm_weight`` / ``layer_norm_bias``); a parameter
marked ``mark_zero_init`` exactly 0 (the sharing rules of ``model/sharing.py`` mark theirs:
GDES's E_Δ and P_Δ, arXiv 2111.09543 §3.3); vocabulary padding rows 0. Disentangled attention's
relative table ``<encoder>.rel_embeddings.weight`` [2k, H] is N(0, std²) and its norm
``rel_embeddings_norm`` 1 / 0 (Hugging Face ``DebertaV2PreTrainedModel`` draws every embedding
N(0, initializer_range²)); its name carries no stage, so every pipeline stage's copy starts equal.
"""
from __future__ import annotations

import hashlib
import math
import re
from typing import Iterator

import torch
import torch.distributed as dist

# Attribute set on parameters whose ``vocab_dim`` indexes the (padded) vocabulary.
VOCAB_DIM_ATTR = "rtd_vocab_dim"
# Attribute set on parameters that ``initialize`` sets to exactly 0.
ZERO_INIT_ATTR = "rtd_zero_init"
# Attribute set on a gated linear unit's fc1 weight: its partition dimension holds two halves
# [a; g], each split over the tensor-parallel ranks (rank r holds [a_r; g_r], megatron-core's
# layout); the unpartitioned tensor is [a; g] at any TP size (``model/modern.py``).
GATED_ATTR = "rtd_gated_halves"


def mark_vocab_parallel(param: torch.nn.Parameter, dim: int = 0) -> None:
    """Record that ``param``'s dimension ``dim`` is the padded, vocab-parallel vocabulary."""
    setattr(param, VOCAB_DIM_ATTR, dim)


def mark_zero_init(param: torch.nn.Parameter) -> None:
    """Record that ``initialize`` sets ``param`` to exactly 0 (a residual that starts at 0, as a
    sharing rule of ``model/sharing.py`` says)."""
    setattr(param, ZERO_INIT_ATTR, True)


def mark_gated(param: torch.nn.Parameter) -> None:
    """Record that ``param`` (a column-parallel gated fc1 weight) holds two halves split over
    the tensor-parallel ranks (``GATED_ATTR``)."""
    setattr(param, GATED_ATTR, True)


def _is_tp(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


_LAYER_RE = re.compile(r"^(.*?\.layers)\.(\d+)\.")


def _named_unique_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter), each parameter once. The canonical name does not depend on
    the pipeline split: a transformer layer's index is its global ``layer_number`` − 1, and a
    tied copy (``rtd_tied_name``) carries the name of the parameter it copies."""
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        tied = getattr(p, "rtd_tied_name", None)
        if tied is not None:
            yield tied, p
            continue
        m = _LAYER_RE.match(name)
        if m:
            layer = model.get_submodule(f"{m.group(1)}.{m.group(2)}")
            number = getattr(layer, "layer_number", int(m.group(2)) + 1)
            name = f"{m.group(1)}.{number - 1}.{name[m.end():]}"
        yield name, p


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _norm_param_ids(model: torch.nn.Module) -> set[int]:
    ids = set()
    for m in model.modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
            ids.update(id(p) for p in m.parameters(recurse=False))
    return ids


def _shape(p: torch.Tensor) -> torch.Size:
    """``p``'s shape on this tensor-parallel rank, also when DeepSpeed's ``zero.Init`` has
    partitioned it over the data-parallel ranks (its whole shape is then ``ds_shape``)."""
    return getattr(p, "ds_shape", p.shape)


def _write(p: torch.Tensor, local: torch.Tensor) -> None:
    """Set ``p`` to ``local`` (its value on this tensor-parallel rank). A parameter partitioned
    by DeepSpeed's ``zero.Init`` keeps only its data-parallel partition, ``ds_tensor``: the
    flattened value's slice [rank·n, (rank + 1)·n) of n = the partition's size (DeepSpeed 0.19.8
    ``partition_parameters.py``; the last rank's tail past the value is padding, left 0)."""
    part = getattr(p, "ds_tensor", None)
    if part is None:
        p.copy_(local.to(p.dtype))
        return
    n = part.ds_numel if hasattr(part, "ds_numel") else part.numel()
    flat = local.reshape(-1)
    start = n * p.ds_zero_partition_rank if hasattr(p, "ds_zero_partition_rank") else \
        n * dist.get_rank(group=p.ds_process_group)
    take = max(0, min(n, flat.numel() - start))
    part.data.zero_()
    part.data[:take].copy_(flat[start:start + take].to(part.dtype))


def _full_shape(p: torch.Tensor, tp_size: int, vocab_size: int) -> list[int]:
    shape = list(_shape(p))
    vocab_dim = getattr(p, VOCAB_DIM_ATTR, None)
    if vocab_dim is not None:
        shape[vocab_dim] = vocab_size
    elif _is_tp(p):
        shape[p.partition_dim] *= tp_size
    return shape


def _local_slice(full: torch.Tensor, p: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This rank's part of ``full`` (vocabulary padded with zero rows first)."""
    vocab_dim = getattr(p, VOCAB_DIM_ATTR, None)
    dim = vocab_dim if vocab_dim is not None else (p.partition_dim if _is_tp(p) else None)
    if dim is None:
        return full
    n = _shape(p)[dim]
    if vocab_dim is not None:
        pad = n * (tp_rank + 1) - full.shape[dim]
        if pad > 0:  # the rows of this rank past the real vocabulary are padding (zeros)
            widths = [0, 0] * (full.dim() - 1 - dim) + [0, pad]
            full = torch.nn.functional.pad(full, widths)
    if getattr(p, GATED_ATTR, False):  # this rank's slice of each half
        return torch.cat([h.narrow(dim, n // 2 * tp_rank, n // 2) for h in full.chunk(2, dim)],
                         dim)
    return full.narrow(dim, n * tp_rank, n)


@torch.no_grad()
def initialize(model: torch.nn.Module, *, seed: int, std: float, num_layers: dict[str, int],
               tp_rank: int, tp_size: int, vocab_size: int,
               scaled_output: dict[str, bool] | None = None) -> None:
    """Initialise every parameter of ``model`` in place, independently of the TP size (and
    of the data-parallel size: a model built under DeepSpeed's ``zero.Init`` gets, in each
    rank's partition, the values the whole parameter would have).

    Args:
        seed: run seed; each parameter's generator is seeded by sha256(seed, name).
        std: the weights' standard deviation (``model.init_method_std``).
        num_layers: layers per top-level submodule name, e.g. {"generator": 6,
            "discriminator": 12}, for the scaled residual-output initialisation.
        tp_rank, tp_size: this rank's place in the tensor-parallel group.
        vocab_size: real (unpadded) vocabulary size.
        scaled_output: per top-level submodule name, whether its residual output projections get
            the scaled std / sqrt(2·num_layers) (pre-LayerNorm: True, the default for a name
            not listed) or plain std (post-LayerNorm: False).
    """
    norms = _norm_param_ids(model)
    scaled_output = scaled_output or {}
    for name, p in _named_unique_parameters(model):
        leaf = name.rsplit(".", 1)[-1]
        shape = _full_shape(p, tp_size, vocab_size)
        if getattr(p, ZERO_INIT_ATTR, False):
            full = torch.zeros(shape)
        elif id(p) in norms or leaf in ("layer_norm_weight", "layer_norm_bias"):
            full = torch.ones(shape) if leaf.endswith("weight") else torch.zeros(shape)
        elif len(shape) < 2:
            full = torch.zeros(shape)
        else:
            s = std
            top = name.split(".", 1)[0]
            if (name.endswith(("linear_proj.weight", "linear_fc2.weight"))
                    and scaled_output.get(top, True)):
                s = std / math.sqrt(2.0 * num_layers[top])
            g = torch.Generator().manual_seed(_seed_for(seed, name))
            # torch.normal, not torch.randn (the same draw): DeepSpeed's zero.Init makes every
            # randn in its context in the model's dtype on its device (0.19.8
            # partition_parameters.py), so a bf16 model would get the draw rounded before the
            # scaling, one bf16 step off the whole build's (test_post_ln_zero.py's bf16 case)
            full = torch.normal(0.0, 1.0, size=shape, generator=g) * s
        _write(p, _local_slice(full, p, tp_rank))


def _gather_tp(t: torch.Tensor, dim: int, tp_group) -> torch.Tensor:
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts, dim=dim)


@torch.no_grad()
def full_state_dict(model: torch.nn.Module, *, tp_group, vocab_size: int,
                    grads: bool = False, source=None, keep: bool = True
                    ) -> dict[str, torch.Tensor]:
    """TP-agnostic fp32 CPU copies of the parameters (or their gradients, ``grads=True``):
    tensor-parallel shards gathered, vocabulary padding removed. Collective over ``tp_group``;
    every rank gets the result. Shared parameters appear once, under their first name.

    ``source``: instead of the parameter, ``source(p)`` (this TP rank's whole tensor for it; may
    itself be collective, called for every parameter in the same order on every rank), made one
    parameter at a time. ``keep=False``: take part in the collectives, return nothing."""
    out = {}
    for name, p in _named_unique_parameters(model):
        t = source(p) if source is not None else (p.grad if grads else p)
        if t is None:
            t = torch.zeros_like(p)
        vocab_dim = getattr(p, VOCAB_DIM_ATTR, None)
        if vocab_dim is not None:
            t = _gather_tp(t, vocab_dim, tp_group).narrow(vocab_dim, 0, vocab_size)
        elif getattr(p, GATED_ATTR, False):  # each half gathered on its own: [a; g]
            t = torch.cat([_gather_tp(h, p.partition_dim, tp_group)
                           for h in t.chunk(2, p.partition_dim)], p.partition_dim)
        elif _is_tp(p):
            t = _gather_tp(t, p.partition_dim, tp_group)
        if keep:
            out[name] = t.detach().float().cpu().clone()
        del t
    return out


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], *,
                         tp_rank: int) -> None:
    """Inverse of ``full_state_dict``: copy this rank's slice of each full tensor in place.

    Raises:
        KeyError: a parameter of ``model`` is missing from ``state`` (or the reverse);
        ValueError: a shape does not fit.
    """
    names = dict(_named_unique_parameters(model))
    missing, unexpected = set(names) - set(state), set(state) - set(names)
    if missing or unexpected:
        raise KeyError(f"state dict does not fit the model: missing {sorted(missing)}, "
                       f"unexpected {sorted(unexpected)}")
    for name, p in names.items():
        local = _local_slice(state[name], p, tp_rank)
        if tuple(local.shape) != tuple(p.shape):
            raise ValueError(f"{name}: shape {tuple(state[name].shape)} does not fit "
                             f"{tuple(p.shape)} on tensor-parallel rank {tp_rank}")
        p.copy_(local.to(p.dtype))
