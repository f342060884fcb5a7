"""Whether a checkpoint can continue this run: its process layout (another one converts,
``training/reshard.py``, except ZeRO-0 under fp16), its model shape and its seed. Checked before
anything is built (``rtd_scale/prepare.py``); not one of ``checks.CHECKS``, which every reader of a
checkpoint runs: these compare it with a run's flags."""
from __future__ import annotations

from typing import Any, Optional

from rtd_scale.cli_errors import UserInputError
from rtd_scale.training.checkpoint.files import read_meta

# Model fields that change the shape of some parameter: a checkpoint only loads into the same.
# ``layernorm_position``: another layout has other parameters (and the same ones mean other things).
_SHAPE_FIELDS = ("vocab_size", "embedding_size", "max_position_embeddings", "sharing",
                 "layernorm_position", "attention_type", "position_buckets",
                 "make_vocab_size_divisible_by")
# What a checkpoint written before a model field existed holds (its config lacks the field).
_FIELDS_BEFORE_THEY_EXISTED = {"layernorm_position": "pre", "attention_type": "bert",
                               "position_buckets": 256, "make_vocab_size_divisible_by": 128}
# A checkpoint from before model.sharing_scope existed shared the token table only.
_SCOPE_BEFORE_IT_EXISTED = "tokens"
_ENCODER_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")


def scope_shapes_parameters(model: dict[str, Any]) -> bool:
    """Whether ``model.sharing_scope`` changes the parameters of a recorded model config (its
    sharing mode shares something past the token table, ``model/embeddings.py``
    ``SharingRule.layer_components``; never under disentangled attention)."""
    from rtd_scale.config import AttentionType, ModelConfig, SharingScope
    from rtd_scale.model.embeddings import sharing_rule

    relative = not AttentionType(model.get("attention_type", "bert")).absolute_positions
    rule = sharing_rule(model.get("sharing", ModelConfig.sharing))  # the field's default
    return bool(rule.layer_components(SharingScope.EMBEDDINGS, relative))


def _sharing_scope(model: dict[str, Any]) -> str:
    """The sharing scope that shapes the parameters: "tokens" wherever the scope changes nothing
    (NES, disentangled attention: ``config.SharingScope``), so a checkpoint written before the
    field existed still resumes those models."""
    if not scope_shapes_parameters(model):
        return "tokens"
    return model.get("sharing_scope", _SCOPE_BEFORE_IT_EXISTED)


def describe_layout(layout: dict[str, Any]) -> str:
    """``TP 1 × PP 1 × DP 2, ZeRO-3``: how the log and the errors name a process layout."""
    return (f"TP {layout.get('tensor_model_parallel_size')} × PP "
            f"{layout.get('pipeline_model_parallel_size')} × DP {layout.get('data_parallel_size')}"
            f", ZeRO-{layout.get('zero_stage')}")


def needs_conversion(meta: Optional[dict[str, Any]], layout: dict[str, Any]) -> bool:
    """Whether the checkpoint of ``meta`` was saved at a process layout other than ``layout``."""
    return meta is not None and any((meta.get("layout") or {}).get(k) != v
                                    for k, v in layout.items())


def check_convertible(load_dir: str, tag: str, saved: dict[str, Any],
                      layout: dict[str, Any], *, saved_precision: Optional[str] = None,
                      precision: Optional[str] = None) -> None:
    """Refuse a layout change ``--load`` cannot honour, in one line naming both layouts and the
    fix. Every change of TP, PP, DP size and ZeRO stage 0–3 converts (``training/reshard.py``):
    DeepSpeed's universal checkpoint between TP 1 × PP 1 layouts at ZeRO 1–3, rtd_scale's
    layout-free state otherwise. Not ZeRO-0 under fp16 on either side: DeepSpeed keeps its
    AdamW state in one flat fp16 optimizer there, not per parameter.

    Raises:
        UserInputError: the change is not one of those.
    """
    if all(saved.get(k) == v for k, v in layout.items()):
        return
    was, now = describe_layout(saved), describe_layout(layout)
    head = f"--load {load_dir}: {tag} was saved at {was}, this run is {now}"
    for side, lay, prec in (("the checkpoint", saved, saved_precision),
                            ("this run", layout, precision)):
        if lay.get("zero_stage") == 0 and prec == "fp16":
            raise UserInputError(
                f"{head}: {side} is ZeRO-0 under --fp16, whose AdamW state DeepSpeed keeps in "
                "one flat fp16 optimizer that cannot be re-split; resume at the checkpoint's "
                "layout, or use a ds_configs/zero1.json-style file on both runs")


def check_compatible(load_dir: str, tag: str, config: dict[str, Any],
                     layout: dict[str, int]) -> Optional[dict[str, Any]]:
    """Refuse, before anything is built, a ``--load`` whose checkpoint cannot continue this run:
    a process layout :func:`check_convertible` refuses, another model shape, or another seed.
    Returns the checkpoint's metadata (None for a checkpoint without it).

    A checkpoint at another TP, PP, DP size or ZeRO stage passes: it is converted first
    (``training/reshard.py``).

    Raises:
        UserInputError: naming each difference and the fix.
    """
    meta = read_meta(load_dir, tag)
    if meta is None:
        return None
    check_convertible(load_dir, tag, meta.get("layout") or {}, layout,
                      saved_precision=(meta.get("config") or {}).get("train", {}).get("precision"),
                      precision=config.get("train", {}).get("precision"))
    old, new = meta["config"]["model"], config["model"]
    old = {**_FIELDS_BEFORE_THEY_EXISTED, **old}
    diffs = [f"model.{k} {old.get(k)} → {new.get(k)}" for k in _SHAPE_FIELDS
             if old.get(k) != new.get(k)]
    if not diffs and _sharing_scope(old) != _sharing_scope(new):
        diffs.append(f"model.sharing_scope {_sharing_scope(old)} → {_sharing_scope(new)}")
    for enc in ("generator", "discriminator"):
        diffs += [f"model.{enc}.{k} {old[enc].get(k)} → {new[enc].get(k)}"
                  for k in _ENCODER_FIELDS if old[enc].get(k) != new[enc].get(k)]
    if diffs:
        raise UserInputError(
            f"--load {load_dir}: {tag} holds another model ({', '.join(diffs)}); use the "
            f"preset and overrides it was trained with (see {load_dir}/config.json)")
    old_seed, seed = meta["config"].get("train", {}).get("seed"), config["train"]["seed"]
    if old_seed is not None and old_seed != seed and not config["train"].get("override_data_order"):
        # the order is a function of (seed, epoch) (data/blend.py): another seed reshuffles
        # the epoch the run is in, so its remaining samples are not the ones still unread
        raise UserInputError(
            f"--load {load_dir}: {tag} was trained with --seed {old_seed}, this run has --seed "
            f"{seed}, which would reshuffle the data mid-epoch (some samples read twice, others "
            f"never); pass --seed {old_seed}, or --override-data-order to start the new seed's "
            "order where the run resumes")
    return meta


def data_order_note(saved_seed: int, seed: int, consumed: int, data) -> str:
    """The note a resumed run prints when ``--override-data-order`` lets ``seed`` replace the
    checkpoint's ``saved_seed``: where the new order starts (``data``: the training split's
    ``BlendedDataset``; its global sample ``consumed`` is the first one read)."""
    import numpy as np

    d, j = data.schedule.locate(np.array([consumed], np.int64))
    ds = data.datasets[int(d[0])]
    epoch, position = divmod(int(j[0]), len(ds))
    return (f"note: --override-data-order: the data order follows --seed {seed} (the "
            f"checkpoint's was {saved_seed}) from sample {consumed} on: {ds.name} resumes in "
            f"epoch {epoch} at position {position} of its {len(ds)} (counted from 0) of the new "
            "order, so this epoch skips some unread samples and repeats some read ones; masks "
            "and sampling noise follow the new seed too")
