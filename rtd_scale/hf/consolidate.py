"""How ``tools/export_hf.py`` reads a run directory: the checkpoint's recorded world restarted as
local gloo processes that load it exactly as ``--load`` would and gather one canonical fp32 state
(``training/checkpoint/convert.py``, the same restart that converts a checkpoint for a resume at
another layout, which reads a ZeRO-3 checkpoint's partition files without engines;
``training/checkpoint/layout_free.py``, the same gather). Under ``--bf16`` (and
``--fp16``) the gathered weights are the optimizer's fp32 master copy, not the 16-bit compute
weights."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Optional

import torch

# How a refused export is told to take another checkpoint (tools/export_hf.py's flag).
EXPORT_EARLIER = "export an earlier checkpoint (--tag global_stepN)"
# ... and what it offers when the run has none (training's --load offers to start fresh).
EXPORT_ANOTHER = "point --load at another run's --save directory"


def read_run(run_dir: str, tag: Optional[str], note: Optional[Callable[[str], None]] = None
             ) -> tuple[Any, dict[str, Any], dict[str, Any], str]:
    """(config, layout, ds_config, tag) of the checkpoint the export takes
    (``convert.read_run``); ``note`` is told, in export words, which checkpoint is exported when
    that is not simply the newest one (``choose``'s own notes speak of resuming training)."""
    from rtd_scale.training.checkpoint import convert

    def tell(choice) -> None:
        for line in _export_notes(run_dir, choice) if note is not None else ():
            note(line)

    return convert.read_run(run_dir, tag, tell, fresh=EXPORT_ANOTHER)


def _export_notes(run_dir: str, choice) -> list[str]:
    """What ``choice`` (``checkpoint.choose.choose``) means for an export: newer checkpoints left
    out (named by --tag, or skipped as incomplete)."""
    from rtd_scale.training.checkpoint.choose import newest_complete

    notes = []
    if choice.skipped:
        notes.append("note: skipped the incomplete " + "; ".join(
            f"{t} ({why})" for t, why in choice.skipped) + f"; exporting {choice.tag}")
    newest = newest_complete(run_dir)
    if newest is not None and newest != choice.tag and not choice.skipped:
        notes.append(f"note: {run_dir} has a newer complete checkpoint, {newest}; exporting "
                     f"{choice.tag} as --tag names")
    return notes


def consolidate_checkpoint(run_dir: str, tag: Optional[str] = None,
                           tokenizer_model: Optional[str] = None, timeout_s: float = 3600.0):
    """(canonical state, RunConfig, tag) of ``run_dir``'s checkpoint ``tag`` (default: latest),
    read by restarting its recorded world as local gloo processes.

    Args:
        tokenizer_model: where the run's tokenizer is now, when it moved since training.
    Raises:
        UserInputError: a missing or foreign checkpoint, or a tokenizer that cannot be found.
    """
    from rtd_scale.training.checkpoint import convert, layout_free

    cfg, layout, ds_config, tag = convert.read_run_with_tokenizer(run_dir, tag, tokenizer_model)
    with tempfile.TemporaryDirectory() as out_dir:
        convert.run_world(run_dir, tag, cfg, layout, ds_config, out_dir, what="weights",
                          earlier=EXPORT_EARLIER, timeout_s=timeout_s)
        state = torch.load(os.path.join(out_dir, layout_free.STATE_FILE), weights_only=True)
    return state, cfg, tag
