"""Write an export directory: the discriminator at ``DIR``, the generator at ``DIR/generator``.

Each is what ``save_pretrained`` of its transformers class writes (``config.json`` +
``model.safetensors``, fp32) plus the tokenizer files (``Tokenizer.save_pretrained``:
``tokenizer.json`` / ``tokenizer_config.json``…), so ``AutoTokenizer.from_pretrained(DIR)`` and
``AutoModel….from_pretrained(DIR)`` work offline, under transformers 4.x and 5.x alike
(``pyproject.toml``: ``transformers>=4.46,<6``; tests/e2e/test_hf_export_transformers4.py loads
every layout under 4.57.3). ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` for
every layout, the one class both majors build from ``tokenizer.json`` as written: transformers 5
saves ``TokenizersBackend``, a name 4.x does not have, and its model classes rebuild the
pipeline from the vocabulary instead (``BertTokenizer``/``ElectraTokenizerFast`` a WordPiece,
``RobertaTokenizer`` a byte BPE, ``DebertaV2Tokenizer`` its own normaliser and token type 1 for
a pair's second text), which no longer encodes like the pipeline. A SentencePiece tokenizer of
the disentangled-attention layout is also written as ``spm.model``, the file transformers 4.x's
slow ``DebertaV2Tokenizer`` reads, with ``normalize_text`` as its own normaliser (a character
map, ``Tokenizer.sentencepiece_for_transformers``), and tokenizer.json's normaliser starts with
the same map, the part of it 5.x's ``DebertaV2Tokenizer`` keeps: that class, too, encodes as the
pipeline on both majors. Every file gets the mode a plain write gives under the
umask (safetensors writes 0600), so other users of a shared file system can read the export.
A target whose discriminator class has no RTD head (``Adapter.rtd_head_in_model`` false:
``RobertaPreLayerNormModel``, ``DebertaV2Model``) gets ``DIR/rtd_head.safetensors``, the head
under ELECTRA's names (``discriminator_predictions.{dense,dense_prediction}.{weight,bias}``).
``DIR/rtd_scale.json`` records the rtd_scale model config the export came from.

A run of the masked-LM control (``rtd.objective=mlm``, ``masked_lm=True``) exports its one model
at ``DIR`` as its layout's masked-LM class (``ElectraForMaskedLM``, ``RobertaPreLayerNormForMaskedLM``,
``DebertaV2ForMaskedLM``, ``ModernBertForMaskedLM``; ``convert.masked_lm_to_hf``), with no
``generator/`` and no RTD head; ``rtd_scale.json`` names it under "masked_lm".

The directory is written under a temporary name beside ``DIR`` and renamed into place; an existing
``DIR`` is replaced only when it is itself an export (it has ``config.json``), and only after the
new one is complete: a failure on the way leaves the old export as it was.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Optional

import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import ModelConfig
from rtd_scale.hf import convert
from rtd_scale.hf.adapters import adapter_for
from rtd_scale.hf.common import GENERATOR_DIR, RTD_HEAD_FILE, Adapter, HFModel

MANIFEST = "rtd_scale.json"


def check_output_dir(path: str, flag: str, *, overwrite_flag: Optional[str] = None) -> None:
    """Refuse, before any work, an output that exists and is not an earlier export.

    ``overwrite_flag``: refuse an earlier export too, naming this flag as the way to replace it
    (``tools/export_hf.py`` without ``--overwrite``); None replaces an earlier export
    (``--export-hf`` at the end of training).

    Raises:
        UserInputError: naming ``flag`` and the fix.
    """
    from rtd_scale.training.checkpoint.files import holds_run

    if os.path.exists(path) and not os.path.isdir(path):
        raise UserInputError(f"{flag} {path}: exists and is not a directory; pass a new "
                             "directory for the Hugging Face export")
    if os.path.isdir(path) and _holds_training_run(path):
        # a run directory has a config.json too: replacing it would delete its checkpoints
        run = holds_run(path)
        raise UserInputError(f"{flag} {path}: holds a training run"
                             + (f" ({run})" if run else "")
                             + "; an export there would replace it: pass a new directory, "
                             "e.g. hf/" + os.path.basename(os.path.normpath(path)))
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(
            os.path.join(path, MANIFEST)):
        raise UserInputError(f"{flag} {path}: a non-empty directory that is not an export; "
                             "pass a new directory")
    if overwrite_flag and os.path.isfile(os.path.join(path, MANIFEST)):
        raise UserInputError(f"{flag} {path}: already holds an export; pass {overwrite_flag} to "
                             "replace it, or a new directory")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(parent) and not os.access(parent, os.W_OK):
        raise UserInputError(f"{flag} {path}: {parent} is not writable; pass a writable place")


def _holds_training_run(path: str) -> bool:
    """Whether ``path`` is (or was started as) a pretraining run's ``--save``: a checkpoint or
    ``latest`` (``files.holds_run``), or what pretrain.py writes before its first save."""
    from rtd_scale.training.checkpoint.files import holds_run

    return holds_run(path) is not None or any(
        os.path.exists(os.path.join(path, name)) for name in ("ds_config.json", "progress"))


def build_hf_model(m: HFModel) -> torch.nn.Module:
    """The transformers model of ``m`` with its weights (every parameter set: the state covers
    all but the class's tied copies)."""
    import transformers

    cls = getattr(transformers, m.class_name)
    model = cls(m.config, **m.model_kwargs)
    missing, unexpected = model.load_state_dict(m.state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    assert not unexpected and set(missing) <= tied, (m.class_name, missing, unexpected)
    return model.eval()


def _save_tokenizer(tokenizer_model: Optional[str], directory: str, max_length: int,
                    adapter: Adapter, note: Callable) -> None:
    """The tokenizer files in ``directory``, as the target's classes read them: a SentencePiece
    model for its slow tokenizer (``Adapter.slow_tokenizer_file``), its input names
    (``Adapter.tokenizer_inputs``)."""
    if not tokenizer_model:
        return
    from rtd_scale.data.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_model)
    if not hasattr(tok, "save_pretrained"):  # older tokenizer module: keep the model itself
        shutil.copyfile(tokenizer_model, os.path.join(directory, os.path.basename(tokenizer_model)))
        note("tokenizer: copied the SentencePiece model only (no Tokenizer.save_pretrained)")
        return
    tok.save_pretrained(directory, model_max_length=max_length,
                        sentencepiece_file=adapter.slow_tokenizer_file,
                        model_input_names=adapter.tokenizer_inputs)


def _plain_file_modes(root: str) -> None:
    """Give every file under ``root`` the mode ``open(path, "w")`` gives (0666 less the umask),
    every directory 0777 less the umask: safetensors' ``save_file`` writes 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for where, _, files in os.walk(root):
        os.chmod(where, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(where, name), 0o666 & ~umask)


def write_export(state: dict[str, torch.Tensor], model: ModelConfig, output_dir: str, *,
                 pad_id: int, cls_id: Optional[int] = None, sep_id: Optional[int] = None,
                 tokenizer_model: Optional[str] = None, flag: str = "--output",
                 overwrite_flag: Optional[str] = None,
                 note: Callable[[str], None] = print, masked_lm: bool = False) -> None:
    """Write the export of canonical ``state`` (a whole model) to ``output_dir``. Under
    torch.distributed, call it on global rank 0: transformers' ``save_pretrained`` writes there
    only. ``overwrite_flag``: as :func:`check_output_dir`. ``masked_lm``: the state is an
    ``rtd.objective=mlm`` run's (``model``: ``RunConfig.trained_model()``), written as one
    masked-LM model.

    Raises:
        ExportError: a shape the target class cannot hold (nothing is written).
        UserInputError: ``output_dir`` exists and is not an export (or is one, under
            ``overwrite_flag``).
    """
    from safetensors.torch import save_file

    import torch.distributed as dist

    assert not dist.is_initialized() or dist.get_rank() == 0, "write_export runs on rank 0"
    ids = dict(pad_id=pad_id, cls_id=cls_id, sep_id=sep_id)
    if masked_lm:
        disc, gen = None, convert.masked_lm_to_hf(state, model, **ids)
    else:
        disc, gen = convert.to_hf(state, model, **ids)
    check_output_dir(output_dir, flag, overwrite_flag=overwrite_flag)
    out = os.path.abspath(output_dir)
    tmp = f"{out}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        adapter = adapter_for(model)
        models = ([(gen, tmp)] if masked_lm else
                  [(disc, tmp), (gen, os.path.join(tmp, GENERATOR_DIR))])
        for m, where in models:
            hf_model = build_hf_model(m)
            hf_model.save_pretrained(where)
            for name, tensors in m.extra_files.items():
                save_file({k: v.contiguous() for k, v in tensors.items()},
                          os.path.join(where, name), metadata={"format": "pt"})
            _save_tokenizer(tokenizer_model, where, model.max_position_embeddings, adapter, note)
            del hf_model
        manifest = ({"format": "rtd_scale hf export 1", "objective": "mlm",
                     "masked_lm": gen.class_name, "pad_id": pad_id, "model": _model_dict(model)}
                    if masked_lm else
                    {"format": "rtd_scale hf export 1", "discriminator": disc.class_name,
                     "generator": gen.class_name, "generator_dir": GENERATOR_DIR,
                     "rtd_head_file": RTD_HEAD_FILE if disc.extra_files else None,
                     "pad_id": pad_id, "model": _model_dict(model)})
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
            f.write("\n")
        _plain_file_modes(tmp)
        old = None
        if os.path.isdir(out):
            old = f"{out}.old{os.getpid()}"
            os.replace(out, old)
        try:
            os.replace(tmp, out)
        except BaseException:
            if old:
                os.replace(old, out)
            raise
        if old:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _model_dict(model: ModelConfig) -> dict:
    import dataclasses
    import enum

    def conv(o):
        if isinstance(o, enum.Enum):
            return o.value
        if dataclasses.is_dataclass(o):
            return {f.name: conv(getattr(o, f.name)) for f in dataclasses.fields(o)}
        return o

    return conv(model)
