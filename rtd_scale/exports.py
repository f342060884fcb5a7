"""The end-of-run exports: ``--export`` (a consolidated, TP-agnostic fp32 state dict),
``--export-hf`` (a Hugging Face transformers directory) and the summary's line that exports the
run later (``tools/export_hf.py``). Each gathers the canonical state as a resume at another
layout does (``training/checkpoint/layout_free.py``) and writes it through ``hf/``, so this
module stays outside ``training/`` (which never imports ``hf/``)."""
from __future__ import annotations

import os
from typing import Optional

from rtd_scale.config import Objective, RunConfig


def export_consolidated(engine, model, cfg: RunConfig, ctx, path: str) -> None:
    """Gather ZeRO-3 partitions and TP shards; the logging rank writes {"config", "model"}
    atomically. Collective: every rank must call it."""
    import torch

    from rtd_scale.training.checkpoint.layout_free import gather_full_state

    state = gather_full_state(engine, model, ctx, cfg.model.vocab_size)
    if ctx.is_logging_rank:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        torch.save({"config": cfg.to_dict(), "model": state}, tmp)
        os.replace(tmp, path)
    torch.distributed.barrier()


def export_hf(engine, model, cfg: RunConfig, ctx, tokenizer, print_fn) -> None:
    """``--export-hf``: the Hugging Face transformers export of ``hf/export.py``
    (``write_export``), the discriminator at the directory and the generator in its
    ``generator/``, the tokenizer in both. Collective: every rank must call it."""
    import torch

    from rtd_scale.training.checkpoint.layout_free import gather_full_state
    from rtd_scale.hf.export import write_export

    out = cfg.train.export_hf
    state = gather_full_state(engine, model, ctx, cfg.model.vocab_size)
    if ctx.rank == 0:  # every rank holds the state; transformers saves on rank 0 only
        write_export(state, cfg.trained_model(), out, pad_id=tokenizer.pad_id,
                     cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id,
                     tokenizer_model=cfg.data.tokenizer_model, flag="--export-hf",
                     note=print_fn, masked_lm=model.masked_lm_only)
        print_fn(f"exported to Hugging Face: {out} (the masked LM)" if model.masked_lm_only
                 else f"exported to Hugging Face: {out} (discriminator), {out}/generator")
    del state
    torch.distributed.barrier()


def export_hint(cfg: RunConfig, exported: bool = False) -> Optional[str]:
    """The summary's line that exports this run to Hugging Face, and what the export loads as;
    with ``exported`` (``--export-hf`` wrote it at the end of this run), where it is
    (``rtd_scale.hf.adapters.adapter_for``); None without ``--save``, for a layout no Hugging
    Face class holds (no entry in ``hf/adapters.py``'s ``ADAPTERS``, e.g. disentangled attention
    with ``--layernorm-position pre``); "none: " and the reason for a model its adapter refuses
    (the adapter's ``check_exportable``: e.g. the modern block with ``--normalization
    RMSNorm``)."""
    from rtd_scale.hf.adapters import ADAPTERS, adapter_for, key_of
    from rtd_scale.hf.common import RTD_HEAD_FILE, ExportError

    if not (cfg.train.save or exported) or key_of(cfg.model) not in ADAPTERS:
        return None
    out = (cfg.train.export_hf if exported
           else os.path.join("hf", os.path.basename(os.path.normpath(cfg.train.save))))
    adapter = adapter_for(cfg.model)
    try:
        adapter.check_exportable(cfg.trained_model())
    except ExportError as e:  # say why, rather than offer a command that refuses
        return f"none: {e}"
    if cfg.rtd.objective is Objective.MLM:  # one model, the masked LM
        what = f"(loads as {adapter.generator_class}, the masked LM with its head)"
        if exported:
            return f"written to {out} by --export-hf {what}"
        return f"python tools/export_hf.py --load {cfg.train.save} --output {out}   {what}"
    disc = adapter.discriminator_class
    head = ("RTD head included" if adapter.rtd_head_in_model
            else f"its RTD head in {out}/{RTD_HEAD_FILE}")
    if exported:
        return (f"written to {out} by --export-hf (loads as {disc}, {head}; the generator in "
                f"{out}/generator)")
    return (f"python tools/export_hf.py --load {cfg.train.save} --output {out}   "
            f"(loads as {disc}, {head}; the generator in {out}/generator)")
