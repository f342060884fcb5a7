"""rtd_scale's rows: ``training/step.py``'s ``train_step`` in a DeepSpeed engine (as
``pretrain.py --bf16`` trains), the same model without DeepSpeed (which isolates the engine's
cost), and the megatron-core layer stack alone. The model is ``model/build.py``'s
``build_model`` (``bench.common.build_rtd_model``)."""
from __future__ import annotations

import contextlib
import io
import logging
from types import SimpleNamespace

import torch

from bench import common
from bench.gpu.timing import Stepper, stack_stepper
from bench.gpu.workloads import Settings
from rtd_scale.phases import PHASE_BACKWARD, PHASE_DATA_WAIT, PHASE_FORWARD, PHASE_OPTIMIZER_STEP


def parallel_context(s: Settings):
    """megatron-core's parallel state at world 1 (``bench.common.world_one``, started once), with
    ``s.device`` as the training device."""
    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)  # keep DeepSpeed's per-engine banners out of the table
    return common.parallel_context(s.device)


def micro_batches(cfg, s: Settings):
    """``bench.common.host_batches`` as the loader yields them: ``MicroBatch``es, in pinned memory
    on CUDA (``data/loader.py``'s ``pin_memory``), so that their copy waits for nothing."""
    from rtd_scale.data.packed import MicroBatch

    out = [MicroBatch(ids, idx) for ids, idx in common.host_batches(cfg)]
    return [mb.pin_memory() for mb in out] if s.cuda else out


def _check_core(cfg, s: Settings, core: str) -> None:
    """Raises RowSkipped where attention ``core`` does not exist for the layout or cannot run
    here — before any parallel state is made, so a skipped row leaves the process as it was."""
    import importlib.util

    from bench.gpu.timing import RowSkipped
    from bench.gpu.workloads import CORES
    from rtd_scale.model import specs
    from rtd_scale.model.disentangled import IMPLEMENTATIONS

    layout = cfg.model.attention_type.value
    if not core:
        return
    if core not in CORES.get(layout, ()):
        raise RowSkipped(f"core {core!r} is not one of {layout} attention's "
                         f"{', '.join(CORES.get(layout, ()))}")
    if core == "te" and not specs._have_transformer_engine():
        raise RowSkipped("transformer-engine does not import here (or no CUDA device)")
    if core == "flash" and "flash" not in IMPLEMENTATIONS:
        raise RowSkipped("this checkout's model/disentangled.py has no flash core")
    if core == "flash" and importlib.util.find_spec("flashdeberta") is None:
        raise RowSkipped("flashdeberta does not import (pip install .[gpu])")
    if core in ("flex", "flash") and not s.cuda:
        raise RowSkipped(f"the {core} core trains on CUDA only")


def _build_with_core(cfg, s: Settings, core: str):
    """``common.build_rtd_model`` with attention ``core`` (``workloads.CORES``; "" the
    product's own choice) and a note for the row; the modern block's choice is an environment
    switch read at every forward, so it comes back as ``env`` for the step to set.

    Raises:
        RowSkipped: the core does not exist for this layout, or not on this machine."""
    import os
    from unittest import mock

    from rtd_scale.model import document_mask, specs
    from rtd_scale.model.disentangled import DisentangledCoreAttention

    layout = cfg.model.attention_type.value
    env = {}
    if not core:
        return common.build_rtd_model(cfg, s.device), env, ""
    _check_core(cfg, s, core)
    # every core but "te" on megatron-core's local linears, whatever is installed
    with mock.patch.object(specs, "_have_transformer_engine", lambda: core == "te"):
        model = common.build_rtd_model(cfg, s.device)
    if layout == "disentangled":
        for m in model.modules():
            if isinstance(m, DisentangledCoreAttention):
                m.impl = core
                if core != "sdpa":  # FlexAttention and flashdeberta have no attention dropout
                    m.dropout_p = 0.0
    if layout == "rotary":
        env[document_mask.FLEX_ENV] = "1" if core == "flex" else "0"
        os.environ.update(env)
    return model, env, f"core {core}"


def rtd_engine_step(cfg, s: Settings, zero_stage: int, core: str = "") -> tuple[Stepper, tuple]:
    """rtd_scale's step as ``pretrain.py --bf16`` runs it: ``training/step.py``'s ``train_step``
    over one micro-batch (gradient accumulation 1), called as ``training/loop.py`` calls it at
    pipeline_model_parallel_size 1 — the counts of the global batch, ``engine(...)``,
    ``engine.backward``, ``engine.step`` — without the loop's non-finite gate and norm read.
    DeepSpeed casts the model to bf16 and keeps fp32 master weights in its optimizer wrapper
    around rtd_scale's AdamW (fused on GPU). ``core``: the attention core (``_build_with_core``).
    """
    import os

    from rtd_scale import distributed
    from rtd_scale.training.engine import build_engine, resolve_ds_config
    from rtd_scale.training.step import train_step

    _check_core(cfg, s, core)  # a skipped core makes no parallel state
    ctx = parallel_context(s)
    model, env, core_note = _build_with_core(cfg, s, core)
    ds = resolve_ds_config({"zero_optimization": {"stage": zero_stage}}, cfg,
                           data_parallel_size=1, gradient_accumulation_steps=1)
    with contextlib.redirect_stdout(io.StringIO()):  # BF16_Optimizer prints memory banners
        eng = build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
    batches = micro_batches(cfg, s)

    def run(i: int, timers) -> None:
        os.environ.update(env)  # the modern block's core is read at every forward
        train_step(eng, [batches[i % len(batches)]], step=i, ctx=ctx, timers=timers)

    note = f"{type(eng.optimizer).__name__} over {type(eng.basic_optimizer).__name__}"
    note = ", ".join(filter(None, [core_note, note]))
    return Stepper(run, keep=[eng, model]), (model, note)


def rtd_autocast_step(cfg, s: Settings) -> tuple[Stepper, tuple]:
    """rtd_scale's model without DeepSpeed: ``train_step``'s forward (its batch copy and the
    global batch's counts, ``training/step.py``) on fp32 weights under bf16 autocast, backward,
    rtd_scale's AdamW (``training.optimizer.build_optimizer``: fused on GPU), no clipping — the
    HF step's recipe. On CPU autocast is entered around backward as well: megatron-core's linear
    layers restore autocast in backward only for CUDA (``custom_bwd(device_type="cuda")``)."""
    from rtd_scale.training.optimizer import build_optimizer
    from rtd_scale.training.step import masked_micro_batches, micro_batch_kwargs
    from rtd_scale.training.timers import timed_parts

    ctx = parallel_context(s)
    model = common.build_rtd_model(cfg, s.device)
    opt = build_optimizer(model, cfg.optim)
    batches = micro_batches(cfg, s)
    autocast = lambda: torch.autocast(s.device.type, dtype=torch.bfloat16)  # noqa: E731
    plain = SimpleNamespace(module=model)  # what masked_micro_batches reads of an engine

    def run(i: int, timers) -> None:
        with timers(PHASE_DATA_WAIT):
            kw = micro_batch_kwargs(batches[i % len(batches)], s.device, model.pad_id)
        with timers(PHASE_FORWARD):
            (kw,), counts = masked_micro_batches(plain, [kw], ctx, timers)
            with autocast(), timed_parts(model, timers):
                loss = model(**kw, step=i, global_counts=counts,
                             num_micro_batches=ctx.dp_size).loss
        with timers(PHASE_BACKWARD):
            with autocast() if not s.cuda else contextlib.nullcontext():
                loss.backward()
        with timers(PHASE_OPTIMIZER_STEP):
            opt.step()
            opt.zero_grad(set_to_none=True)

    return Stepper(run, keep=[model, opt]), (model, "")


def stack_mcore_step(impl: str, shape: dict, s: Settings) -> tuple[Stepper, str]:
    """rtd_scale's megatron-core layer spec alone (``model/specs.py``), forward + backward of a
    fixed input; "stack-mcore-mask" passes the all-False [b, 1, 1, s] padding mask that
    ``Encoder.forward`` gives a micro-batch with [PAD], "stack-mcore" none."""
    if impl not in ("stack-mcore", "stack-mcore-mask"):
        raise ValueError(f"impl {impl!r}: choose 'stack-mcore' or 'stack-mcore-mask'")
    from megatron.core.transformer.transformer_block import TransformerBlock

    from rtd_scale.config import EncoderConfig
    from rtd_scale.model.encoder import transformer_config
    from rtd_scale.model.specs import _have_transformer_engine, encoder_layer_spec

    L, h, heads, f = (shape[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                         "ffn_hidden_size"))
    seq, b, dev = shape["seq_length"], shape["micro_batch"], s.device
    g = torch.Generator(device=dev).manual_seed(0)
    parallel_context(s)
    enc = EncoderConfig(num_layers=L, hidden_size=h, num_attention_heads=heads,
                        ffn_hidden_size=f)
    tc = transformer_config(enc, init_std=0.02, tensor_model_parallel_size=1)
    module = TransformerBlock(config=tc, spec=encoder_layer_spec(), post_layer_norm=True,
                              pre_process=True, post_process=True).to(dev)
    note = "TransformerEngine" if _have_transformer_engine() else "local layers, no TE"
    x = torch.randn(seq, b, h, device=dev, dtype=torch.bfloat16, generator=g)
    mask = None
    if impl == "stack-mcore-mask":
        mask = torch.zeros(b, 1, 1, seq, dtype=torch.bool, device=dev)
    return stack_stepper(module, lambda inp: module(hidden_states=inp, attention_mask=mask),
                         x), note
