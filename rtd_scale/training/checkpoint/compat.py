"""Whether a checkpoint can continue this run: its process layout and precision (another one
converts through the layout-free state, ``checkpoint/convert.py``, except ZeRO-0 under fp16), its
model shape and its seed. Checked before anything is built (``rtd_scale/prepare.py``); not one of
``checks.CHECKS``, which every reader of a checkpoint runs: these compare it with a run's flags."""
from __future__ import annotations

import enum
from typing import Any, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import ModelConfig, RunConfig, SharingScope
from rtd_scale.training.checkpoint.files import META_FILE, read_meta

# Model fields that change the shape of some parameter, or what the same parameters compute: a
# checkpoint only loads into the same. ``layernorm_position``: another layout has other
# parameters (and the same ones mean other things); ``max_relative_positions`` sizes DeBERTa's
# relative table or spreads its buckets; the modern block's norm, bias and FFN fields shape its
# parameters, its window and global-layer pattern decide what each layer attends.
# ``max_position_embeddings`` is judged by :func:`check_positions` (it shapes a parameter in some
# layouts only); the RoPE bases are not compared: raising them with the length is the context
# extension (:func:`context_note`).
_SHAPE_FIELDS = ("vocab_size", "embedding_size", "sharing", "layernorm_position",
                 "attention_type", "position_buckets", "max_relative_positions",
                 "make_vocab_size_divisible_by", "normalization", "norm_bias", "add_bias_linear",
                 "mlp_activation", "window_size", "global_attn_every_n_layers")
# What a context extension may change in the rotary layout, with its flag (:func:`context_note`).
_CONTEXT_FIELDS = {"rotary_base": "--rotary-base", "local_rotary_base": "--local-rotary-base",
                   "max_position_embeddings": "model.max_position_embeddings"}
_ENCODER_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


def _sharing_scope(model: ModelConfig) -> SharingScope:
    """The sharing scope as it shapes the parameters: "tokens" wherever the scope changes
    nothing (NES, disentangled attention: ``config.SharingScope``), so those models resume
    whatever scope is recorded."""
    from rtd_scale.model.sharing import sharing_rule

    relative = not model.attention_type.absolute_positions
    if not sharing_rule(model.sharing).layer_components(SharingScope.EMBEDDINGS, relative):
        return SharingScope.TOKENS
    return model.sharing_scope


def _shown(value: Any) -> str:
    return str(value.value if isinstance(value, enum.Enum) else value)


def describe_layout(layout: dict[str, Any], precision: Optional[str] = None) -> str:
    """``TP 1 × PP 1 × DP 2, ZeRO-3`` (``…, bf16`` with ``precision``): how the log and the errors
    name a process layout."""
    return (f"TP {layout.get('tensor_model_parallel_size')} × PP "
            f"{layout.get('pipeline_model_parallel_size')} × DP {layout.get('data_parallel_size')}"
            f", ZeRO-{layout.get('zero_stage')}" + (f", {precision}" if precision else ""))


def precision_of(meta: Optional[dict[str, Any]]) -> str:
    """The precision a checkpoint was trained in (its recorded config; fp32 when unrecorded)."""
    return ((meta or {}).get("config") or {}).get("train", {}).get("precision", "fp32")


def needs_conversion(meta: Optional[dict[str, Any]], layout: dict[str, Any],
                     precision: Optional[str] = None) -> bool:
    """Whether the checkpoint of ``meta`` was saved at a process layout other than ``layout``,
    or (``precision`` given) in another precision: DeepSpeed keeps fp32 master weights in other
    files and formats per precision (its bf16 optimizer's ``bf16_zero_pp_rank_*`` at ZeRO-0/1;
    none at ZeRO-0 in fp32), so a precision change goes through the layout-free state, which
    holds the fp32 masters whatever the precision. ZeRO-Offload is no part of it: an offloaded
    optimizer keeps the same files (``layout_free.match_adam_steps`` gives its step the form
    this run's optimizer keeps)."""
    if meta is None:
        return False
    return (any((meta.get("layout") or {}).get(k) != v for k, v in layout.items())
            or (precision is not None and precision_of(meta) != precision))


RANK_KEYS = ("world_size", "data_parallel_size", "tensor_model_parallel_size",
             "pipeline_model_parallel_size")


def same_ranks(meta: Optional[dict[str, Any]], layout: dict[str, Any]) -> bool:
    """Whether the checkpoint of ``meta`` was saved by the same ranks in the same roles as
    ``layout`` (its TP × PP × DP sizes; the ZeRO stage and precision may differ): then each rank
    continues its own dropout stream from the checkpoint's ``rng_rank*.pt``, as an unchanged
    resume does (layout_free's RNG policy)."""
    saved = (meta or {}).get("layout") or {}
    return all(saved.get(k) == layout.get(k) for k in RANK_KEYS)


def check_convertible(load_dir: str, tag: str, saved: dict[str, Any],
                      layout: dict[str, Any], *, saved_precision: Optional[str] = None,
                      precision: Optional[str] = None) -> None:
    """Refuse a layout change ``--load`` cannot honour, in one line naming both layouts and the
    fix. Every change of TP, PP, DP size, ZeRO stage 0–3 and precision converts through the
    layout-free state (``checkpoint/convert.py``). Not ZeRO-0 under fp16 on either side:
    DeepSpeed keeps its AdamW state in one flat fp16 optimizer there, not per parameter.

    Raises:
        UserInputError: the change is not one of those.
    """
    if all(saved.get(k) == v for k, v in layout.items()) and saved_precision == precision:
        return
    changed = saved_precision != precision
    was = describe_layout(saved, saved_precision if changed else None)
    now = describe_layout(layout, precision if changed else None)
    head = f"--load {load_dir}: {tag} was saved at {was}, this run is {now}"
    for side, lay, prec in (("the checkpoint", saved, saved_precision),
                            ("this run", layout, precision)):
        if lay.get("zero_stage") == 0 and prec == "fp16":
            raise UserInputError(
                f"{head}: {side} is ZeRO-0 under --fp16, whose AdamW state DeepSpeed keeps in "
                "one flat fp16 optimizer that cannot be re-split; resume at the checkpoint's "
                "layout, or use a ds_configs/zero1.json-style file on both runs")


def check_compatible(load_dir: str, tag: str, config: RunConfig,
                     layout: dict[str, int]) -> Optional[dict[str, Any]]:
    """Refuse, before anything is built, a ``--load`` whose checkpoint cannot continue the run
    of ``config``: a process layout :func:`check_convertible` refuses, another model shape, or
    another seed. Returns the checkpoint's metadata (None for a checkpoint without it).

    A checkpoint at another TP, PP, DP size, ZeRO stage or precision passes: it is converted
    first (``checkpoint/convert.py``).

    Raises:
        UserInputError: in one line naming each differing field with both values, and the fix.
    """
    meta = read_meta(load_dir, tag)
    if meta is None:
        return None
    try:
        saved = RunConfig.from_dict(meta["config"])
    except UserInputError as e:
        raise UserInputError(f"--load {load_dir}: {tag}/{META_FILE}: {e}") from None
    check_convertible(load_dir, tag, meta.get("layout") or {}, layout,
                      saved_precision=saved.train.precision.value,
                      precision=config.train.precision.value)
    old, new = saved.trained_model(), config.trained_model()  # rtd.objective=mlm: one encoder
    if saved.rtd.objective is not config.rtd.objective:
        # the shapes of one encoder and of a generator + discriminator are not comparable
        raise UserInputError(
            f"--load {load_dir}: {tag} was trained with rtd.objective "
            f"{saved.rtd.objective.value}, this run has {config.rtd.objective.value}; resume "
            f"with --set rtd.objective={saved.rtd.objective.value}, or start a new run from its "
            f"export (tools/export_hf.py, then --pretrained-checkpoint)")
    diffs = [f"model.{k} {_shown(getattr(old, k))} → {_shown(getattr(new, k))}"
              for k in _SHAPE_FIELDS if getattr(old, k) != getattr(new, k)]
    if not diffs and _sharing_scope(old) is not _sharing_scope(new):
        diffs.append(f"model.sharing_scope {_sharing_scope(old).value} → "
                     f"{_sharing_scope(new).value}")
    for enc in ("generator", "discriminator"):
        a, b = getattr(old, enc), getattr(new, enc)
        diffs += [f"model.{enc}.{k} {getattr(a, k)} → {getattr(b, k)}"
                  for k in _ENCODER_FIELDS if getattr(a, k) != getattr(b, k)]
    if diffs:
        raise UserInputError(
            f"--load {load_dir}: {tag} holds another model ({', '.join(diffs)}); use the "
            f"preset and overrides it was trained with (see {load_dir}/config.json)")
    check_positions(load_dir, tag, old, new, config.data.seq_length)
    old_seed, seed = saved.train.seed, config.train.seed
    if old_seed != seed and not config.train.override_data_order:
        # the order is a function of (seed, epoch) (data/blend.py): another seed reshuffles
        # the epoch the run is in, so its remaining samples are not the ones still unread
        raise UserInputError(
            f"--load {load_dir}: {tag} was trained with train.seed {old_seed}, this run has "
            f"{seed} (from --seed or a --config file), which would reshuffle the data mid-epoch "
            f"(some samples read twice, others never); pass --seed {old_seed} (a flag overrides "
            "the file), or --override-data-order to start the new seed's order where the run "
            "resumes")
    return meta


def check_positions(load_dir: str, tag: str, old: ModelConfig, new: ModelConfig,
                    seq_length: int) -> None:
    """Refuse another ``model.max_position_embeddings`` (``old`` the checkpoint's model, ``new``
    this run's, same attention type) where it changes a parameter: it sizes BERT's learned
    position table, whose rows cannot grow, and under disentangled attention with
    ``max_relative_positions`` -1 it is the distance DeBERTa's log buckets are spread over
    (Hugging Face ``make_log_bucket_position``), so the learned relative rows would stand for
    other distances. The rotary layout has no position parameter (RoPE's angles are computed from
    the positions and bases, ``model/modern.py``): there it is only the length the model
    declares, and a longer second phase raises it (:func:`context_note`).

    Raises:
        UserInputError: one line naming both values and the fix.
    """
    was, now = old.max_position_embeddings, new.max_position_embeddings
    if was == now or new.attention_type.rotary:
        return
    if new.attention_type.absolute_positions:
        what = f"a learned position table of {was} rows, which cannot grow"
    elif old.max_relative_positions > 0:
        return  # the same on both sides (compared above): the buckets keep their distances
    else:
        what = (f"relative-position buckets spread over {was} positions "
                "(model.max_relative_positions -1: max_position_embeddings), whose learned rows "
                "would stand for other distances")
    raise UserInputError(
        f"--load {load_dir}: {tag} holds {what} (model.max_position_embeddings {was} → {now}) "
        f"for --seq-length {seq_length}; train the first phase with "
        "model.max_position_embeddings at the longest length (BERT trains its 512 rows at 128 "
        "tokens), or use --position-embedding-type rope, which has no position parameters")


def context_note(saved: ModelConfig, model: ModelConfig) -> Optional[str]:
    """The note a resumed rotary run prints when the checkpoint's model ``saved`` had other RoPE
    bases or another ``max_position_embeddings`` than ``model`` (this run's): the weights load
    as they are, and the new angles apply from the first resumed iteration — ModernBERT's
    context extension (arXiv 2412.13663, "Context Length Extension": 1,024 tokens at base
    10,000, then 8,192 at a global base of 160,000). None when nothing of it changed or the
    layout is another one."""
    if not model.attention_type.rotary:
        return None
    show = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
    changed = [f"{flag} {show(getattr(model, k))} (the checkpoint's {show(getattr(saved, k))})"
               for k, flag in _CONTEXT_FIELDS.items() if getattr(saved, k) != getattr(model, k)]
    if not changed:
        return None
    return (f"note: {', '.join(changed)}: the rotary layout has no position parameters, so the "
            "weights load as they are and the rotary angles follow the new values from the "
            "first resumed iteration (ModernBERT's context extension)")


def data_change(saved: dict[str, Any], now: dict[str, Any]) -> Optional[str]:
    """The first way the training data of ``now`` (``BlendedDataset.state``) differ from the
    checkpoint's ``saved``, in words naming the shard, or None when they are the same: what each
    shard holds (the SHA-256 of its ``.idx`` and ``.bin``; a moved or renamed copy is the same
    data), the shards of each dataset, the blend weights and ``--split``. Another
    ``--seq-length`` is the same data packed anew (``BlendedDataset.continue_after``)."""
    old_sets, new_sets = saved.get("shards") or [], now.get("shards") or []
    if len(old_sets) != len(new_sets):
        return f"--data-path blends {len(new_sets)} dataset(s), the checkpoint's {len(old_sets)}"
    for d, (old, new) in enumerate(zip(old_sets, new_sets)):
        for i, (a, b) in enumerate(zip(old, new)):
            files = [kind for kind in ("idx", "bin")
                     if a.get(f"{kind}_sha256") != b.get(f"{kind}_sha256")]
            if files:
                more = sum(1 for x, y in zip(old[i + 1:], new[i + 1:]) if x != y)
                return (f"shard {b['name']} holds other data than the checkpoint's {a['name']} "
                        f"(its {' and '.join('.' + f for f in files)} differ: sha256 "
                        f"{a.get(files[-1] + '_sha256', '')[:12]} → "
                        f"{b[files[-1] + '_sha256'][:12]})"
                        + (f", and {more} more shard(s) of that dataset" if more else ""))
        if len(old) != len(new):
            names = [x["name"] for x in (new if len(new) > len(old) else old)[min(len(old),
                                                                                  len(new)):]]
            return (f"dataset {new[0]['name'] if new else d} has {len(new)} shard(s), the "
                    f"checkpoint's {len(old)} ({'added' if len(new) > len(old) else 'removed'}: "
                    f"{', '.join(names[:3])})")
    for key, flag in (("weights", "the blend weights of --data-path"), ("split", "--split")):
        if key in saved and saved[key] != now.get(key):
            show = lambda v: " ".join(f"{x:g}" for x in v)  # noqa: E731
            return f"{flag} {show(saved[key])} → {show(now[key])}"
    return None


def check_same_data(load_dir: str, tag: str, saved: Optional[dict[str, Any]], data, *,
                    override: bool, consumed: int) -> Optional[str]:
    """Refuse, before anything is built, a ``--load`` whose training data differ from the data
    the checkpoint was trained on (:func:`data_change`: regenerated, re-ordered or removed
    shards, an edited blend), unless ``override`` (``--override-data-order``: the new data's
    order starts where the run resumes, and the resume says where, :func:`data_order_note`).
    ``saved``: the checkpoint's ``data`` record (its ``rtd_meta.json``); ``data``: this run's
    training ``BlendedDataset``; ``consumed``: the samples the checkpoint had read.

    A checkpoint without a fingerprint of its shards (saved before they were recorded) resumes:
    the returned note says its data could not be checked; its next checkpoint records one.

    Raises:
        UserInputError: naming the changed shard and ``--override-data-order``.
    """
    if not saved or "shards" not in saved:
        return (f"note: {tag} records no fingerprint of its training data (saved before "
                "checkpoints recorded one), so the shards could not be checked against it; "
                "the next checkpoint records one")
    change = data_change(saved, data.state())
    if change is None or override:
        return None
    raise UserInputError(
        f"--load {load_dir}: {tag} was trained on other data: {change}; restore the data it was "
        "trained on, or pass --override-data-order to continue on these data, their order "
        f"starting at global sample {consumed:,} where the run resumes")


def _where(consumed: int, data) -> str:
    """Where global sample ``consumed`` of ``data`` (a ``BlendedDataset``) sits: the dataset,
    its epoch and position in that epoch's order."""
    import numpy as np

    d, j = data.schedule.locate(np.array([consumed], np.int64))
    ds = data.datasets[int(d[0])]
    epoch, position = divmod(int(j[0]), len(ds))
    return (f"{ds.name} resumes in epoch {epoch} at position {position} of its {len(ds)} "
            "(counted from 0) of the new order")


def data_order_note(saved_seed: int, seed: int, consumed: int, data) -> str:
    """The note a resumed run prints when ``--override-data-order`` lets ``seed`` replace the
    checkpoint's ``saved_seed``: where the new order starts (``data``: the training split's
    ``BlendedDataset``; its global sample ``consumed`` is the first one read)."""
    return (f"note: --override-data-order: the data order follows --seed {seed} (the "
            f"checkpoint's was {saved_seed}) from sample {consumed} on: {_where(consumed, data)}, "
            "so this epoch skips some unread samples and repeats some read ones; masks "
            "and sampling noise follow the new seed too")


def data_change_note(change: str, consumed: int, data) -> str:
    """The note a resumed run prints when ``--override-data-order`` accepted other training
    data (``change``: :func:`data_change`'s words): where the new data's order starts."""
    return (f"note: --override-data-order: the training data differ from the checkpoint's "
            f"({change}); the run reads them from global sample {consumed} of their order on: "
            f"{_where(consumed, data)}")
