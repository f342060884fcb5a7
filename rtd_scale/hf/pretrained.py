"""``--pretrained-checkpoint PATH``: start a run from weights only, at any TP / PP / DP layout.

PATH may be
- an export directory (``tools/export_hf.py`` or ``--export-hf``): the discriminator at PATH, the
  generator at PATH/generator, for the pre layout the RTD head in PATH/rtd_head.safetensors;
- a Hugging Face directory of a ``model_type`` a registered target reads (``adapters``:
  ELECTRA, RoBERTa-PreLayerNorm, DeBERTaV3): the target's discriminator class at PATH
  (``ElectraForPreTraining``, ``RobertaPreLayerNormModel``, ``DebertaV2Model``; heads of other
  classes, ``Adapter.ignored_heads``, left aside; the RTD head from the class or
  PATH/rtd_head.safetensors, else fresh), with or without its generator class in PATH/generator
  (DeBERTa: either MLM head layout) — without it the generator starts fresh, and under ES and
  GDES its table starts as the discriminator's;
- an ``--export`` .pt file (``{"config", "model"}``, our canonical state).

Under ``rtd.objective=mlm`` (the masked-LM control, one encoder in the generator's place) PATH is
a directory of the layout's masked-LM class (``ElectraForMaskedLM``,
``RobertaPreLayerNormForMaskedLM``, ``DebertaV2ForMaskedLM``, ``ModernBertForMaskedLM``: an
``rtd.objective=mlm`` export, a released checkpoint, or an RTD export's ``generator/``), its MLM
head kept; or an ``--export`` .pt file of such a run. An RTD run started from a masked-LM
directory takes its encoder as the discriminator and says that the MLM head is set aside.

The weights go into the model before ``deepspeed.initialize`` (every rank reads PATH and keeps its
own tensor-parallel slice, ``rtd_scale.model.weights.load_full_state_dict``); the optimizer and
the learning-rate schedule start fresh. Everything is checked on every rank alike before a tensor
is copied, so a mismatch is one line naming the tensor and the flag that fixes it.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import ModelConfig, RunConfig
from rtd_scale.hf import adapters, convert
from rtd_scale.hf.common import (GENERATOR_DIR, RTD_HEAD_FILE, RTD_HEAD_PREFIX, TE_NAMES, Adapter,
                                 HFSource, unfused_names)

FLAG = "--pretrained-checkpoint"

def _hf_adapter(model_type: str, path: str, model: ModelConfig) -> Adapter:
    """The adapter that reads a checkpoint of ``model_type`` into ``model``.

    Raises:
        UserInputError: a model type no target reads, or one of another layout than ``model``'s
            (one line naming the flag that fixes it).
    """
    theirs = adapters.key_for_model_type(model_type)
    if theirs is None:
        raise UserInputError(f"{FLAG} {path}: model_type {model_type!r}; pass "
                             f"{adapters.import_sources()}")
    (layout, attention), (want_layout, want_attention) = theirs, adapters.key_of(model)
    adapter = adapters.ADAPTERS[theirs]
    if attention is not want_attention:
        raise UserInputError(f"{FLAG} {path}: a {model_type} checkpoint has "
                             f"{adapter.attention_words} attention; pass --attention-type "
                             f"{attention.value}")
    if layout is not want_layout:
        raise UserInputError(
            f"{FLAG} {path}: a {model_type} checkpoint has the {layout.value}-LayerNorm layout; "
            f"pass --layernorm-position {layout.value}")
    return adapter


def _load_hf(cls_name: str, path: str, fresh_ok: tuple[str, ...] = (),
             ignored: tuple[str, ...] = (), **kwargs) -> HFSource:
    """A transformers model's state dict through ``from_pretrained`` (any file format it reads),
    refusing missing tensors other than ``fresh_ok`` prefixes and unexpected ones other than
    the ``ignored`` prefixes (``Adapter.ignored_heads``: heads of another class)."""
    import transformers

    try:
        hf, info = getattr(transformers, cls_name).from_pretrained(
            path, output_loading_info=True, dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as e:
        raise UserInputError(f"{FLAG} {path}: transformers cannot load it as {cls_name} "
                             f"({str(e).splitlines()[0]})") from None
    missing = [k for k in info["missing_keys"] if not k.startswith(fresh_ok)]
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith(ignored)]
    bad = info.get("mismatched_keys") or []
    if missing or unexpected or bad:
        what = (f"missing {missing[0]}" if missing else
                f"unexpected {unexpected[0]}" if unexpected else f"mismatched {bad[0]}")
        raise UserInputError(f"{FLAG} {path}: not a complete {cls_name} ({what}, "
                             f"{len(missing) + len(unexpected) + len(bad)} in all); pass a "
                             "directory written by save_pretrained of that class")
    absent = set(info["missing_keys"])  # freshly drawn by transformers: ours start fresh instead
    state = {k: v.detach() for k, v in hf.state_dict().items() if k not in absent}
    return HFSource(config=hf.config, state=state, where=path)


def _architecture(path: str) -> str:
    """The first class named by PATH/config.json's "architectures" ("" if none)."""
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return (json.load(f).get("architectures") or [""])[0]


def _read_masked_lm(path: str, adapter: Adapter, model: ModelConfig, pad_id: int
                    ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``rtd.objective=mlm`` from a masked-LM class's directory, its MLM head kept."""
    cls_name = adapter.generator_class  # the class itself: check_directory
    src = _load_hf(cls_name, path)
    try:
        return convert.masked_lm_from_hf(model, src, pad_id=pad_id, flag=FLAG)
    except KeyError as e:
        raise UserInputError(f"{FLAG} {path}: tensor {e.args[0]} is missing; pass a complete "
                             f"{cls_name} directory") from None


def check_directory(path: str, model: ModelConfig, *, masked_lm: bool = False
                    ) -> Optional[Adapter]:
    """What can be checked of a Hugging Face directory PATH without reading its weights: its
    config.json, a model type and layout this run reads, and under ``masked_lm`` the masked-LM
    class. ``prepare.prepare`` calls it before anything is written, so a mismatch leaves no
    empty ``--save`` behind; returns the adapter (None when PATH is not a directory: a file
    is read whole by :func:`read_pretrained`).

    Raises:
        UserInputError: no config.json, another model type or layout, or not the masked LM.
    """
    if not os.path.isdir(path):
        return None
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        hint = (f" (a run directory: to continue it, at any TP, PP or DP size, pass --load {path}; "
                f"for its weights alone, export it first with tools/export_hf.py --load {path} "
                "--output DIR)" if os.path.isfile(os.path.join(path, "latest")) else "")
        raise UserInputError(f"{FLAG} {path}: no config.json{hint}; pass "
                             f"{adapters.import_sources()}")
    import json

    with open(config_path, encoding="utf-8") as f:
        model_type = json.load(f).get("model_type", "")
    adapter = _hf_adapter(model_type, path, model)
    if masked_lm and _architecture(path) != adapter.generator_class:
        cls_name = adapter.generator_class
        gen = os.path.join(path, GENERATOR_DIR)
        hint = (f"; its generator is {gen}" if os.path.isfile(os.path.join(gen, "config.json"))
                else "")
        raise UserInputError(f"{FLAG} {path}: rtd.objective=mlm starts from a {cls_name} "
                             f"directory (the masked LM and its head), not a "
                             f"{_architecture(path) or 'model without architectures'}{hint}; "
                             f"pass a {cls_name} directory or use rtd.objective=rtd")
    return adapter


def read_pretrained(path: str, model: ModelConfig, *, pad_id: int, masked_lm: bool = False
                    ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The canonical state PATH holds (possibly without the generator or the RTD head: those
    start fresh) and notes for the user. ``masked_lm``: the run is ``rtd.objective=mlm``
    (``model``: ``RunConfig.trained_model()``).

    Raises:
        UserInputError: PATH is none of the accepted forms, or holds another model.
    """
    if os.path.isfile(path):
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 — any unreadable file is the user's
            raise UserInputError(f"{FLAG} {path}: not a torch file written by --export "
                                 f"({type(e).__name__})") from None
        if not isinstance(blob, dict) or "model" not in blob:
            raise UserInputError(f"{FLAG} {path}: no 'model' entry; pass a file written by "
                                 "--export, an export directory or a Hugging Face directory")
        try:  # the file's config, typed as this run's (--export writes it whole)
            old = RunConfig.from_dict(blob["config"]).model if blob.get("config") else model
        except UserInputError as e:
            raise UserInputError(f"{FLAG} {path}: its config: {e}") from None
        if old.layernorm_position is not model.layernorm_position:
            have = old.layernorm_position.value
            raise UserInputError(f"{FLAG} {path}: saved with the {have}-LayerNorm layout; "
                                 f"pass --layernorm-position {have}")
        if old.attention_type is not model.attention_type:
            att = old.attention_type.value
            raise UserInputError(f"{FLAG} {path}: saved with --attention-type {att}; pass "
                                 f"--attention-type {att}")
        if masked_lm:  # one encoder: no sharing to agree on
            return unfused_names(blob["model"]), []
        if old.sharing is not model.sharing:
            raise UserInputError(f"{FLAG} {path}: saved with --sharing {old.sharing.value}; pass "
                                 f"--sharing {old.sharing.value} (or load its Hugging Face "
                                 "export, which converts between sharing modes)")
        theirs = bool(convert.shared_components(model, old.sharing_scope))  # layout: as ours
        if theirs != bool(convert.shared_components(model)):
            scope = "embeddings" if theirs else "tokens"
            raise UserInputError(f"{FLAG} {path}: saved with --sharing-scope {scope}; pass "
                                 f"--sharing-scope {scope} (or load its Hugging Face export, "
                                 "which converts between sharing scopes)")
        return unfused_names(blob["model"]), []
    adapter = check_directory(path, model, masked_lm=masked_lm)
    if adapter is None:
        raise UserInputError(f"{FLAG} {path}: no such file or directory")
    if masked_lm:
        return _read_masked_lm(path, adapter, model, pad_id)
    disc_cls = adapter.discriminator_class
    disc = _load_hf(disc_cls, path, fresh_ok=(RTD_HEAD_PREFIX,), ignored=adapter.ignored_heads,
                    **adapter.model_kwargs)
    head_file = os.path.join(path, RTD_HEAD_FILE)
    if os.path.isfile(head_file):
        from safetensors.torch import load_file

        disc.extra = load_file(head_file)
    gen_dir = os.path.join(path, GENERATOR_DIR)
    gen = (_load_hf(adapter.generator_class, gen_dir)
           if os.path.isfile(os.path.join(gen_dir, "config.json")) else None)
    try:
        state, notes = convert.from_hf(model, discriminator=disc, generator=gen, pad_id=pad_id,
                                       flag=FLAG)
    except KeyError as e:
        raise UserInputError(f"{FLAG} {path}: tensor {e.args[0]} is missing; pass a complete "
                             f"{disc_cls} directory") from None
    if gen is None:
        notes.append("no generator/ beside the discriminator: the generator starts fresh")
    if _architecture(path) == adapter.generator_class != disc_cls:
        notes.append(f"{path} holds a {adapter.generator_class}: its encoder starts the "
                     "discriminator and its MLM head is set aside (--set rtd.objective=mlm "
                     "continues it as a masked LM, head included)")
    return state, notes


_LAYER = re.compile(r"^(generator|discriminator)\.block\.layers\.(\d+)\.")


def _fix_for(name: str, shape: tuple[int, ...], masked_lm: bool = False) -> str:
    """The flag or config field that sets this tensor's shape (``masked_lm``: under
    ``rtd.objective=mlm`` the discriminator's fields shape the one encoder)."""
    enc = "discriminator" if masked_lm else name.split(".", 1)[0]
    if ".embeddings.table." in name or name == "mlm_head.bias":
        return "--tokenizer-model (the vocabulary is the tokenizer's)"
    if ".embeddings.position." in name:
        return f"--set model.max_position_embeddings={shape[0]}"
    if ".embeddings." in name or name.startswith("mlm_head.norm"):
        return f"--set model.embedding_size={shape[-1]}"
    if ".mlp.linear_fc1." in name:
        return f"--set model.{enc}.ffn_hidden_size={shape[0]}"
    if ".mlp.linear_fc2." in name:
        return f"--set model.{enc}.ffn_hidden_size={shape[-1]}"
    if name.startswith("mlm_head."):
        return f"--set model.{enc}.hidden_size / model.embedding_size"
    if name.startswith("rtd_head."):
        return f"--set model.discriminator.hidden_size={shape[-1]}"
    return f"--set model.{enc}.hidden_size (the preset it was trained with)"


def _num_layers(names, enc: str) -> int:
    found = [int(m.group(2)) for n in names if (m := _LAYER.match(n)) and m.group(1) == enc]
    return max(found) + 1 if found else 0


def check_against(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  model: ModelConfig, path: str, may_start_fresh: Callable[[str], bool],
                  masked_lm: bool = False) -> None:
    """Refuse a state that does not fit the whole model (``expected``: name → full shape;
    ``masked_lm``: the model is ``rtd.objective=mlm``'s, whose fields are the discriminator's).

    Raises:
        UserInputError: one line naming the tensor (or layer count) and the flag to fix.
    """
    for enc in ("discriminator", "generator"):
        theirs, ours = _num_layers(state, enc), getattr(model, enc).num_layers
        if theirs and theirs != ours:
            raise UserInputError(f"{FLAG} {path}: the {'masked LM' if masked_lm else enc} has {theirs} layers there, {ours} "
                                 f"here; pass --set model."
                                 f"{'discriminator' if masked_lm else enc}.num_layers={theirs}")
    for name, shape in expected.items():
        if name not in state:
            if may_start_fresh(name):
                continue
            raise UserInputError(f"{FLAG} {path}: tensor {name} is missing there; pass a "
                                 "checkpoint of this model's layout and sharing (--sharing, "
                                 "--sharing-scope, --layernorm-position)")
        have = tuple(state[name].shape)
        if have != tuple(shape):
            raise UserInputError(f"{FLAG} {path}: {name} has shape {have} there but "
                                 f"{tuple(shape)} in this model; pass {_fix_for(name, have, masked_lm)}")
    extra = sorted(set(state) - set(expected))
    if extra:
        raise UserInputError(f"{FLAG} {path}: tensor {extra[0]} has no place in this model "
                             f"({len(extra)} such); pass a checkpoint of this model's layout "
                             "and sharing (--sharing, --sharing-scope, --layernorm-position)")


def load_pretrained(model: torch.nn.Module, path: str, model_cfg: ModelConfig, *, pad_id: int,
                    tp_group, tp_rank: int, pp_group=None,
                    print_fn: Optional[Callable[[str], None]] = None) -> None:
    """Copy PATH's weights into this rank's ``model`` (one pipeline stage, one TP slice), before
    ``deepspeed.initialize``. Collective over ``tp_group`` and ``pp_group``: every rank calls it.

    Tensors PATH lacks by design (the generator or the RTD head, see the module docstring) keep
    the values ``model`` was initialised with.

    Raises:
        UserInputError: PATH unreadable or of another model (one line, the tensor and the flag).
    """
    import torch.distributed as dist

    from rtd_scale.model import weights

    fresh = weights.full_state_dict(model, tp_group=tp_group, vocab_size=model_cfg.vocab_size)
    uses_te = any(k.endswith(tuple(TE_NAMES)) for k in fresh)
    fresh = unfused_names(fresh)
    shapes = {k: tuple(v.shape) for k, v in fresh.items()}
    if pp_group is not None and dist.get_world_size(pp_group) > 1:  # the whole model's names
        shares = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(shares, shapes, group=pp_group)
        shapes = {k: v for share in shares for k, v in share.items()}
    masked_lm = getattr(model, "masked_lm_only", False)  # rtd.objective=mlm
    state, notes = read_pretrained(path, model_cfg, pad_id=pad_id, masked_lm=masked_lm)
    has_generator = any(k.startswith("generator.block.") for k in state)
    has_head = any(k.startswith("rtd_head.") for k in state)

    def may_start_fresh(name: str) -> bool:
        if name.startswith("rtd_head."):
            return not has_head
        return not has_generator and (name.startswith(("generator.", "mlm_head.")))

    check_against(state, shapes, model_cfg, path, may_start_fresh, masked_lm)
    mine = {k: (state[k] if k in state else fresh[k]) for k in fresh}
    if uses_te:
        back = {v: k for k, v in TE_NAMES.items()}
        mine = {next((k[: -len(p)] + back[p] for p in back if k.endswith("." + p)), k): v
                for k, v in mine.items()}
    weights.load_full_state_dict(model, mine, tp_rank=tp_rank)
    if print_fn is not None:
        print_fn(f"loaded weights from {FLAG} {path} (optimizer and schedule start fresh)")
        for n in notes:
            print_fn(f"note: {n}")
