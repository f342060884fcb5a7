"""Functions run inside the spawned ranks of the multi-process tests (importable, module level)."""
from __future__ import annotations

import dataclasses
import os
import shutil

import torch
import torch.distributed as dist

from rtd_scale.config import Objective, Sharing
from rtd_scale.presets import preset
from tests.helpers import tiny_model
from tests.helpers.tiny_model import tiny_config

SPECIAL = (0, 1, 2, 3, 4)


def build(cfg, tp_size: int, seed: int = 7):
    return tiny_model.build(cfg, seed=seed, tp=tp_size)


def fixed_batch(b: int = 6, s: int = 40, vocab_size: int = 300):
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(5, vocab_size, (b, s), generator=g)
    ids[:, 0] = 1
    ids[:, -1] = 2
    ids[1, 20:] = 0  # some padding
    ids[1, 19] = 2
    return ids, torch.arange(1000, 1000 + b)


def parity(ctx, cases, flash: bool = False):
    """One RTD forward/backward per case (name, sharing, embedding size, layout "pre" /
    "post"[, attention "bert" / "disentangled"]); returns what TP=1 and TP=2 must agree on,
    and with ``flash`` also ``flash_core``'s comparison under "flash"."""
    from rtd_scale.model import weights

    out = {}
    for name, sharing, embedding_size, layout, *attention in cases:
        cfg = tiny_config(sharing, embedding_size=embedding_size, layout=layout,
                          attention=attention[0] if attention else "bert")
        if name.endswith("_mlm"):  # the masked-LM control: one encoder, L_MLM alone
            cfg.rtd.objective = Objective.MLM
        model = build(cfg, ctx.tp_size)
        ids, idx = fixed_batch()
        res = model(ids, idx, step=3)
        res.loss.backward()
        if name.endswith("_mlm"):
            out[name] = {"corrupted": res.corrupted_ids, "masked": res.masked,
                         "mlm": res.mlm_loss.item(), "rtd": res.rtd_loss.item(),
                         "mlm_correct": res.counts["mlm_correct"].item(),
                         "grads": weights.full_state_dict(model, tp_group=ctx.tp_group,
                                                          vocab_size=cfg.model.vocab_size,
                                                          grads=True)}
            continue
        # GDES / NES / ES gradient paths, measured on this rank's shard and summed over TP
        e_g = model.generator_table.weight
        e_d = getattr(model.discriminator_table, "delta", None)
        if e_d is None:
            e_d = model.discriminator_table.weight
        model.zero_grad(set_to_none=True)
        res2 = model(ids, idx, step=3)
        paths = []
        for loss in (res2.mlm_loss, res2.rtd_loss):
            gs = torch.autograd.grad(loss, [e_g, e_d], retain_graph=True, allow_unused=True)
            sums = torch.tensor([0.0 if g is None else g.abs().sum().item() for g in gs])
            dist.all_reduce(sums, group=ctx.tp_group)
            paths.append(sums.tolist())
        model.zero_grad(set_to_none=True)
        res3 = model(ids, idx, step=3)
        res3.loss.backward()
        out[name] = {
            "corrupted": res.corrupted_ids, "masked": res.masked,
            "mlm": res.mlm_loss.item(), "rtd": res.rtd_loss.item(),
            "mlm_correct": res.counts["mlm_correct"].item(),
            "grads": weights.full_state_dict(model, tp_group=ctx.tp_group,
                                             vocab_size=cfg.model.vocab_size, grads=True),
            "paths": paths,
            "same_object": model.discriminator_table is model.generator_table,
        }
    if flash:
        out["flash"] = flash_core(ctx)
    return out


def flash_core(ctx):
    """DeBERTa's RTD step (tiny: generator 2 heads of 16, discriminator 4 of 12) with the flash
    core of disentangled attention against the explicit core, same weights, at this TP size:
    the largest relative difference (max |a − b| / max |b|) of the loss and every local
    gradient, for a padded batch (flashdeberta's fixed-length kernel) and with three documents
    in a sample (its varlen kernel), and against an explicit model whose log buckets reach 16
    instead of 128 (a wrong bucket rule, the negative control); with each rank's heads. None
    where flashdeberta cannot run (not installed, or Triton's interpreter off on a CPU)."""
    import importlib.util

    from rtd_scale.model import disentangled_flash
    from rtd_scale.model.disentangled import DisentangledSelfAttention

    if (importlib.util.find_spec("flashdeberta") is None
            or not disentangled_flash.runs_on(torch.device("cpu"))):
        return None
    ids, idx = fixed_batch(b=2)  # sample 1 padded from position 20
    documents = torch.tensor([[0] * 12 + [1] * 18 + [2] * 10, [0] * 10 + [1] * 10 + [2] * 20],
                             dtype=torch.int32)  # the padding a run of its own

    def step(core: str, docs=None, max_relative_positions: int = -1):
        cfg = tiny_config(Sharing.GDES, layout="post", attention="disentangled")
        cfg.model.disentangled_core = core
        cfg.model.max_relative_positions = max_relative_positions
        model = build(cfg, ctx.tp_size)
        res = model(ids, idx, step=3, document_ids=docs)
        res.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        heads = [m.num_attention_heads_per_partition for m in model.modules()
                 if isinstance(m, DisentangledSelfAttention)]  # generator's layers first
        return res.loss.detach(), grads, heads

    def worst(a, b) -> float:
        (la, ga, _), (lb, gb, _) = a, b
        assert ga.keys() == gb.keys()
        return max([((la - lb).abs() / lb.abs()).item()]
                   + [((ga[n] - gb[n]).abs().max() / gb[n].abs().max()).item() for n in gb])

    padded = step("flash")
    return {"padded": worst(padded, step("explicit")),
            "documents": worst(step("flash", documents), step("explicit", documents)),
            "wrong rule": worst(padded, step("explicit", max_relative_positions=16)),
            "heads": padded[2]}


def sampler(ctx, n: int, temperatures):
    """Vocab-parallel Gumbel-max at this TP size on fixed logits over 24 padded ids
    (20 real, ids 0–4 special)."""
    from rtd_scale.objectives.sampling import sample_from_logits

    v_padded, v_real = 24, 20
    v_local = v_padded // ctx.tp_size
    start = ctx.tp_rank * v_local
    full = torch.linspace(-2.0, 2.0, v_padded)
    ids_global = torch.arange(start, start + v_local)
    sampleable = (ids_global < v_real) & (ids_global >= 5)
    logits = full[start:start + v_local].expand(n, -1)
    keys = dict(seed=5, step=2, sample_index=torch.arange(n) // 64,
                position=torch.arange(n) % 64, vocab_start=start, sampleable=sampleable,
                tp_group=ctx.tp_group)
    out = {T: sample_from_logits(logits, temperature=T, **keys) for T in temperatures}
    original = torch.arange(n) % 15 + 5
    out["disallow"] = sample_from_logits(logits, disallow_ids=original, **keys)
    out["original"] = original
    return out


def rng_policy(ctx, shard_prefix: str):
    """What each rank of TP × DP sees: data, masks, and its generators' next draws."""
    from megatron.core import tensor_parallel

    from rtd_scale import distributed
    from rtd_scale.data.loader import micro_batches
    from rtd_scale.data.packed import PackedDataset
    from rtd_scale.objectives.masking import mask_tokens

    ds = PackedDataset([shard_prefix], seq_length=32)
    mb = micro_batches(ds, consumed_samples=8, seed=3, global_batch_size=8, micro_batch_size=4,
                       dp_rank=ctx.dp_rank, dp_size=ctx.dp_size)[0]
    m = mask_tokens(mb.input_ids, mb.sample_index, seed=3, mask_prob=0.15, mask_token_prob=0.8,
                    random_token_prob=0.1, mask_id=4, vocab_size=1000, special_ids=SPECIAL)
    cfg = tiny_config(Sharing.GDES, dropout=0.3)
    model = build(cfg, ctx.tp_size)
    distributed.seed_after_build(ctx, 3)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracker_draw = torch.rand(4)
    default_draw = torch.rand(4)
    model.train()
    ids, idx = fixed_batch()
    res = model(ids, idx, step=0)  # dropout on: TP peers must still agree
    return {"tp_rank": ctx.tp_rank, "dp_rank": ctx.dp_rank, "ids": mb.input_ids,
            "sample_index": mb.sample_index, "masked": m.masked, "tracker": tracker_draw,
            "default": default_draw, "mlm": res.mlm_loss.item(), "rtd": res.rtd_loss.item()}


def _train_a_little(model, steps: int = 3):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, idx = fixed_batch()
    for step in range(steps):
        opt.zero_grad()
        model(ids, idx, step=step).loss.backward()
        opt.step()


def _gathered_logits(ctx, model, vocab_size: int):
    """Generator MLM logits at every position of a fixed batch, [n, vocab_size] over real ids,
    plus the (global) padded columns' values."""
    ids, _ = fixed_batch()
    with torch.no_grad():
        hidden = model.generator(ids, ids == 0)  # [s, b, h]
        local = model.mlm_head(hidden.reshape(-1, hidden.shape[-1]))  # [n, V_local]
        parts = [torch.empty_like(local) for _ in range(ctx.tp_size)]
        dist.all_gather(parts, local.contiguous(), group=ctx.tp_group)
        full = torch.cat(parts, dim=-1)
    return full[:, :vocab_size], full[:, vocab_size:]


def tp_agnostic_save(ctx, path: str, vocab_size: int):
    """Vocabulary padding across TP sizes, first half: train a little at this TP size, save
    TP-agnostically."""
    from rtd_scale.model import weights

    cfg = tiny_config(Sharing.GDES, vocab_size=vocab_size)
    model = build(cfg, ctx.tp_size)
    _train_a_little(model)
    state = weights.full_state_dict(model, tp_group=ctx.tp_group, vocab_size=vocab_size)
    if ctx.rank == 0:
        torch.save(state, path)
    real, padded = _gathered_logits(ctx, model, vocab_size)
    return {"padded_vocab": model.padded_vocab_size, "logits": real, "padded_logits": padded,
            "table_rows": model.generator_table.weight.shape[0]}


def tp_agnostic_load(ctx, path: str, vocab_size: int):
    """Vocabulary padding across TP sizes, second half: load the TP-agnostic state at this TP
    size."""
    from rtd_scale.model import weights

    cfg = tiny_config(Sharing.GDES, vocab_size=vocab_size)
    model = build(cfg, ctx.tp_size, seed=99)  # different init: everything must come from the file
    weights.load_full_state_dict(model, torch.load(path), tp_rank=ctx.tp_rank)
    real, padded = _gathered_logits(ctx, model, vocab_size)
    ids, idx = fixed_batch()
    res = model(ids, idx, step=0)
    return {"padded_vocab": model.padded_vocab_size, "logits": real, "padded_logits": padded,
            "sampled": res.corrupted_ids[res.masked]}


def load_export(ctx, path: str):
    """Strictly load a consolidated export (``pretrain.py --export``) at this TP size."""
    from rtd_scale.model import weights

    blob = torch.load(path)
    cfg = preset(blob["config"]["preset"])
    cfg.model.vocab_size = blob["config"]["model"]["vocab_size"]
    for enc in ("generator", "discriminator"):
        for key in ("hidden_dropout", "attention_dropout"):
            setattr(getattr(cfg.model, enc), key, blob["config"]["model"][enc][key])
    model = tiny_model.build(cfg, seed=0, tp=ctx.tp_size)
    weights.load_full_state_dict(model, blob["model"], tp_rank=ctx.tp_rank)
    ids, idx = fixed_batch(vocab_size=cfg.model.vocab_size)
    return float(model(ids, idx, step=0).loss)


def _pp_config(sharing: Sharing, layout: str = "pre", attention: str = "bert"):
    cfg = tiny_config(sharing, layout=layout, attention=attention)
    cfg.model.generator = dataclasses.replace(cfg.model.generator, num_layers=2)
    cfg.model.discriminator = dataclasses.replace(cfg.model.discriminator, num_layers=4)
    return cfg


def _pp_micro_batches(n: int = 4, documents: bool = False):
    """``n`` micro-batches of 2 samples; with ``documents``, each sample packs three documents
    (document-masked packing: a [SEP] closes each, as ``PackedDataset.sample`` marks them)."""
    from rtd_scale.data.packed import MicroBatch

    ids, _ = fixed_batch(b=8)
    docs = None
    if documents:
        ends = torch.tensor([[7, 25], [12, 16], [3, 30], [18, 33]]).repeat(2, 1)  # closing [SEP]s
        ids[torch.arange(8).unsqueeze(1), ends] = 2
        docs = (torch.arange(ids.shape[1]) > ends.unsqueeze(-1)).sum(1).to(torch.int32)
    return [MicroBatch(ids[2 * j:2 * j + 2], torch.arange(500 + 2 * j, 502 + 2 * j),
                       None if docs is None else docs[2 * j:2 * j + 2])
            for j in range(n)]


def _build_stage(ctx, cfg, seed: int = 7):
    return tiny_model.build(cfg, ctx, seed=seed, tp=ctx.tp_size)


def pipeline_parity(ctx, cases):
    """One step's losses and gradients over 4 micro-batches, at this TP × PP layout (PP = 1:
    the plain forward, accumulated; PP > 1: the two-pass 1F1B step), per case (name, sharing,
    layernorm layout "pre" / "post"[, attention "bert" / "disentangled"])."""
    from rtd_scale.model import weights
    from rtd_scale.training.pipeline import all_reduce_tied_gradients, pipeline_forward_backward

    out = {}
    for name, sharing, layout, *attention in cases:
        cfg = _pp_config(sharing, layout, *attention)
        if name.endswith("_mlm"):  # the masked-LM control: one encoder, one pass
            cfg.rtd.objective = Objective.MLM
        model = _build_stage(ctx, cfg)
        mbs = _pp_micro_batches(documents=name.endswith("_docs"))
        if ctx.pp_size == 1:  # the global batch's normaliser, as step.train_step
            from rtd_scale.training.normalise import global_counts

            counts = global_counts(model, [(mb.input_ids, mb.sample_index) for mb in mbs], ctx)
            outs = []
            for mb in mbs:
                res = model(mb.input_ids, mb.sample_index, step=2, global_counts=counts,
                            num_micro_batches=len(mbs) * ctx.dp_size,
                            document_ids=mb.document_ids)
                (res.loss / len(mbs)).backward()
                outs.append(res)
        else:
            outs = pipeline_forward_backward(model, mbs, step=2, ctx=ctx)
            all_reduce_tied_gradients(model, ctx)
        out[name] = {
            "pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank,
            "mlm": [o.mlm_loss.item() for o in outs], "rtd": [o.rtd_loss.item() for o in outs],
            "corrupted": [o.corrupted_ids for o in outs],
            "grads": weights.full_state_dict(model, tp_group=ctx.tp_group,
                                             vocab_size=cfg.model.vocab_size, grads=True),
        }
    return out


def pipeline_tied_after_training(ctx, steps: int, attention: str = "bert"):
    """``steps`` optimizer steps through DeepSpeed ZeRO-1 at PP = 2; then the first stage's
    generator table and the last stage's MLM output weight, and (disentangled attention, the
    post-LayerNorm layout) this stage's copies of the relative tables, for bitwise comparisons."""
    from rtd_scale import distributed
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.pipeline import pipeline_train_step

    cfg = _pp_config(Sharing.GDES, "pre" if attention == "bert" else "post", attention)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 8
    cfg.optim.lr, cfg.optim.lr_warmup_iters = 1e-2, 0
    cfg.parallel.pipeline_model_parallel_size = ctx.pp_size
    model = _build_stage(ctx, cfg)
    distributed.seed_after_build(ctx, 7)
    ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": 1}}, cfg,
                                      data_parallel_size=ctx.dp_size,
                                      gradient_accumulation_steps=1)
    eng = engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
    losses = []
    for step in range(steps):
        outs = pipeline_train_step(eng, _pp_micro_batches(), step=step, ctx=ctx)
        losses += [o.loss.item() for o in outs]
    w = (model.generator_table.weight if ctx.is_first_stage else model.mlm_head.table.weight)
    relative = {f"{i}": p.detach().clone()
                for i, p in enumerate(model.pipeline_replicated_parameters())}
    return {"pp_rank": ctx.pp_rank, "weight": w.detach().clone(), "losses": losses,
            "relative": relative}


def post_ln_zero_steps(ctx, stages, steps: int, attention: str = "bert", bf16: bool = False):
    """Per ZeRO stage in ``stages``: ``steps`` DeepSpeed optimizer steps of a fresh
    post-LayerNorm model (GDES, projected E != H; ``attention`` "bert" or "disentangled"), each
    data-parallel rank on its own 2 samples; this rank's losses by stage. Stage "3-init": ZeRO-3
    with the model built as pretrain.py builds it, under DeepSpeed's zero.Init
    (``engine.zero3_construction``); its entry "3-init-held" is (elements this rank held once
    built, the model's elements). Entry ``("weights", stage)``: every parameter's whole value after
    the steps, by name (gathered under ZeRO-3); ``("no_decay", stage)``: the names
    ``optimizer.param_groups`` puts in the group without weight decay, judged as built.
    ``bf16``: in bf16 (DeepSpeed's fp32 masters)."""
    if attention == "both":
        return {a: post_ln_zero_steps(ctx, stages, steps, a, bf16) for a in ("bert", "disentangled")}
    import deepspeed

    from rtd_scale import distributed
    from rtd_scale.config import Precision
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.optimizer import param_groups

    cfg = tiny_config(Sharing.GDES, embedding_size=16, layout="post", attention=attention)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 2 * ctx.dp_size
    cfg.optim.lr, cfg.optim.lr_warmup_iters = 1e-3, 0
    if bf16:
        cfg.train.precision = Precision.BF16
    ids, idx = fixed_batch(b=2 * ctx.dp_size)
    mine = slice(2 * ctx.dp_rank, 2 * ctx.dp_rank + 2)
    out = {}
    for stage in stages:
        ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": int(str(stage)[0])}},
                                          cfg, data_parallel_size=ctx.dp_size,
                                          gradient_accumulation_steps=1)
        if stage == "3-init":
            with engine_mod.zero3_construction(ds, cfg, ctx.dp_group):
                model = build(cfg, ctx.tp_size)
            params = {id(p): p for p in model.parameters()}.values()
            out["3-init-held"] = (sum(p.numel() + p.ds_tensor.numel() for p in params),
                                  sum(p.ds_numel for p in params))
        else:
            model = build(cfg, ctx.tp_size)
        no_decay = {id(p) for g in param_groups(model, cfg.optim) if g["weight_decay"] == 0.0
                    for p in g["params"]}
        out[("no_decay", stage)] = {n for n, p in model.named_parameters() if id(p) in no_decay}
        distributed.seed_after_build(ctx, 7)
        eng = engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
        losses = []
        for step in range(steps):
            res = eng(ids[mine], idx[mine], step)
            eng.backward(res.loss)
            eng.step()
            losses.append(res.loss.item())
        out[stage] = losses
        named = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(named.values()),
                                               enabled=str(stage).startswith("3")):
            out[("weights", stage)] = {n: p.detach().clone().float() for n, p in named.items()}
    return out


def split_batches(b: int = 8, s: int = 40, vocab_size: int = 300):
    """Two global batches of 4 samples (``b`` = 8) with padding of different lengths, for the
    split-invariance test: [b, s] ids, [b] sample indices, and a word-start table over the
    vocabulary (every even id starts a word) for the whole_word and span strategies."""
    ids, _ = fixed_batch(b=b, s=s, vocab_size=vocab_size)
    for row, length in ((1, 20), (2, 31), (5, 12), (6, 27)):
        ids[row, length:] = 0
        ids[row, length - 1] = 2
    return ids, torch.arange(2000, 2000 + b), torch.arange(vocab_size) % 2 == 0


def _split_model(ctx, strategy: str, table):
    cfg = _pp_config(Sharing.GDES)  # layer counts that PP = 2 divides
    cfg.rtd.mask_strategy = strategy
    model = tiny_model.build(cfg, ctx, seed=7, tp=ctx.tp_size, word_start_table=table)
    return cfg, model


def split_invariance(ctx, layouts, strategies, steps: int = 2):
    """For each mask strategy and each (micro_batch_size, ZeRO stage) in ``layouts``: ``steps``
    AdamW steps (lr 1e-3, no warm-up, dropout 0) through the product's step
    (``step.train_step``, or ``pipeline.pipeline_train_step`` at PP > 1) on the global batches
    of ``split_batches`` (4 samples each), each data-parallel rank on its share. Returns per
    (strategy, micro_batch_size, stage): the gathered weights, the logged (L_MLM, L_RTD) of
    every step (``MetricAccumulator`` over micro-batches and DP ranks; last stage) and the
    masked count of every micro-batch of this rank; and at world size 1, per strategy under
    "reference", the losses of one plain forward of the first global batch as one micro-batch
    without a normaliser (its own mean: what step 1 must log)."""
    from rtd_scale import distributed
    from rtd_scale.data.packed import MicroBatch
    from rtd_scale.training.checkpoint.layout_free import gather_full_state
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.step import train_step
    from rtd_scale.training.metrics import MetricAccumulator
    from rtd_scale.training.pipeline import pipeline_train_step

    ids, index, table = split_batches()
    global_batch = 4
    out = {}
    if ctx.world_size == 1:
        out["reference"] = {}
        for strategy in strategies:
            _, model = _split_model(ctx, strategy, table)
            with torch.no_grad():
                res = model(ids[:global_batch], index[:global_batch], step=0)
            out["reference"][strategy] = (res.mlm_loss.item(), res.rtd_loss.item())
    for strategy in strategies:
        for mbs, stage in layouts:
            cfg, model = _split_model(ctx, strategy, table)
            cfg.train.micro_batch_size, cfg.train.global_batch_size = mbs, global_batch
            cfg.optim.lr, cfg.optim.lr_warmup_iters = 1e-3, 0
            cfg.parallel.pipeline_model_parallel_size = ctx.pp_size
            gas = global_batch // (mbs * ctx.dp_size)
            distributed.seed_after_build(ctx, 7)
            ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": stage}}, cfg,
                                              data_parallel_size=ctx.dp_size,
                                              gradient_accumulation_steps=gas)
            eng = engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
            logged, masked = [], []
            for step in range(steps):
                share = global_batch // ctx.dp_size
                first = step * global_batch + ctx.dp_rank * share
                batches = [MicroBatch(ids[j:j + mbs], index[j:j + mbs])
                           for j in range(first, first + share, mbs)]
                masked += [int(model.mask(mb.input_ids, mb.sample_index).masked.sum())
                           for mb in batches]
                if ctx.pp_size > 1:
                    outs = pipeline_train_step(eng, batches, step=step, ctx=ctx)
                else:
                    outs = train_step(eng, batches, step=step, ctx=ctx)
                if ctx.is_last_stage:
                    acc = MetricAccumulator(ctx.device)
                    for o in outs:
                        acc.add(o)
                    scalars = acc.reduce(ctx.dp_group)
                    logged.append((scalars["loss/mlm"], scalars["loss/rtd"]))
            state = gather_full_state(eng, model, ctx, cfg.model.vocab_size)
            out[(strategy, mbs, stage)] = {"weights": state, "logged": logged, "masked": masked}
    return out


def _matrix_engine(ctx, ds_user: dict, precision: str):
    """A tiny GDES model (dropout 0) and its DeepSpeed engine at DP ``ctx.dp_size`` for the
    ds_config ``ds_user`` (a file of ds_configs/) in ``precision``: lr 1e-3 without warm-up,
    weight decay 0.1, one micro-batch of 2 per rank and step."""
    from rtd_scale import distributed
    from rtd_scale.config import Precision
    from rtd_scale.training import engine as engine_mod

    cfg = tiny_config(Sharing.GDES)
    cfg.train.precision = Precision(precision)
    cfg.train.micro_batch_size, cfg.train.global_batch_size = 2, 2 * ctx.dp_size
    cfg.optim.lr, cfg.optim.min_lr, cfg.optim.lr_warmup_iters = 1e-3, 1e-3, 0
    cfg.optim.weight_decay = 0.1
    cfg.validate()
    model = tiny_model.build(cfg, ctx, seed=7, tp=ctx.tp_size)
    distributed.seed_after_build(ctx, 7)
    ds = engine_mod.resolve_ds_config(ds_user, cfg, data_parallel_size=ctx.dp_size,
                                      gradient_accumulation_steps=1, fp16_ok=False)
    return cfg, model, engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())


def _matrix_step(ctx, eng, cfg, step: int) -> float:
    """Optimizer step ``step`` (0-based) on this rank's 2 samples of ``fixed_batch``; returns
    L_MLM + λ·L_RTD over the global batch."""
    from rtd_scale.data.packed import MicroBatch
    from rtd_scale.training.metrics import MetricAccumulator
    from rtd_scale.training.step import train_step

    ids, index = fixed_batch(b=12)
    first = (step * ctx.dp_size + ctx.dp_rank) * 2
    outs = train_step(eng, [MicroBatch(ids[first:first + 2], index[first:first + 2])],
                      step=step, ctx=ctx)
    acc = MetricAccumulator(ctx.device)
    for o in outs:
        acc.add(o)
    return acc.reduce(ctx.dp_group)["loss/total"]


def _matrix_state(ctx, eng, model, cfg) -> dict:
    from rtd_scale.training.checkpoint import layout_free

    state = {"fp32": layout_free.gather_full_state(eng, model, ctx, cfg.model.vocab_size)}
    for key in layout_free.ADAM_STATE_KEYS:
        state[key] = layout_free.gather_full_state(eng, model, ctx, cfg.model.vocab_size, key)
    return state


def _max_rel(got: dict, ref: dict) -> float:
    """The largest |got − ref| / max |ref| over every tensor of every kind."""
    return max(float((got[k][n] - ref[k][n]).abs().max() / ref[k][n].abs().max().clamp_min(1e-30))
               for k in ref for n in ref[k])


def layout_free_matrix(ctx, configs: dict, pairs: list, out_dir: str) -> dict:
    """The layout-free state as the hub of every (ds_config, precision) pair: ``configs`` maps
    a name to (ds_config dict, precision). A reference (the first config) trains steps 1–2 and
    writes its layout-free state (``layout_free.write``), then trains step 3. Every config then
    (a) as a source trains steps 1–2 itself and gathers its state; (b) as a target loads the
    reference's state (``layout_free.load_into``), gathers it back, and trains step 3. ``pairs``
    (source, target) of one ZeRO stage go through DeepSpeed's own save and load instead
    (``checkpoint.save.save`` of the source after its steps 1–2, ``checkpoint.load.load``), then
    step 3. A control loads the reference's state with its moments zeroed. Returns, per name, the
    gathered differences, AdamW step counts and step-3 losses against the reference's."""
    from rtd_scale.training.checkpoint import layout_free, load, save

    names = list(configs)
    out = {"source": {}, "target": {}, "pair": {}}
    cfg, model, eng = _matrix_engine(ctx, *configs[names[0]])
    for step in range(2):
        _matrix_step(ctx, eng, cfg, step)
    ref_dir = os.path.join(out_dir, "reference")
    os.makedirs(ref_dir, exist_ok=True)
    layout_free.write(eng, model, ctx, cfg.model.vocab_size, ref_dir, ctx.rank)
    dist.barrier()
    ref_state = torch.load(os.path.join(ref_dir, layout_free.STATE_FILE), weights_only=True)
    out["loss3"] = _matrix_step(ctx, eng, cfg, 2)
    ref_after = _matrix_state(ctx, eng, model, cfg)
    for name in names:
        cfg, model, eng = _matrix_engine(ctx, *configs[name])
        for step in range(2):
            _matrix_step(ctx, eng, cfg, step)
        state = _matrix_state(ctx, eng, model, cfg)
        if name in {source for source, _ in pairs}:  # DeepSpeed's own files of steps 1–2
            save.save(eng, os.path.join(out_dir, name), step=2, client_state={"step": 2},
                      rank=ctx.rank)
        out["source"][name] = {
            "rel": _max_rel(state, ref_state), "adam_step": layout_free._adam_step(eng),
            # the optimizer's fp32 masters, not the 16-bit compute weights
            "fp32_masters": any(bool((w.bfloat16().float() != w).any())
                                for w in state["fp32"].values()),
            "moments": all(bool(t.abs().max() > 0) for k in layout_free.ADAM_STATE_KEYS
                           for t in state[k].values())}
        cfg, model, eng = _matrix_engine(ctx, *configs[name])
        layout_free.load_into(eng, model, ctx, ref_dir, flag="--load test")
        loaded = _matrix_state(ctx, eng, model, cfg)
        steps = layout_free._adam_step(eng)
        loss = _matrix_step(ctx, eng, cfg, 2)
        out["target"][name] = {"loaded_rel": _max_rel(loaded, ref_state), "adam_step": steps,
                               "loss3": loss,
                               "after_rel": _max_rel(_matrix_state(ctx, eng, model, cfg),
                                                     ref_after)}
    ctrl_dir = os.path.join(out_dir, "control")
    if ctx.rank == 0:  # the reference's state without its moments
        os.makedirs(ctrl_dir)
        for name in (layout_free.STATE_FILE, layout_free.INFO_FILE):
            shutil.copy(os.path.join(ref_dir, name), ctrl_dir)
        zeroed = {k: {n: torch.zeros_like(t) if k != "fp32" else t for n, t in v.items()}
                  for k, v in ref_state.items()}
        torch.save(zeroed, os.path.join(ctrl_dir, layout_free.STATE_FILE))
    dist.barrier()
    cfg, model, eng = _matrix_engine(ctx, *configs[names[0]])
    layout_free.load_into(eng, model, ctx, ctrl_dir, flag="--load test")
    out["control"] = {"loss3": _matrix_step(ctx, eng, cfg, 2),
                      "after_rel": _max_rel(_matrix_state(ctx, eng, model, cfg), ref_after)}
    for source, target in pairs:
        cfg, model, eng = _matrix_engine(ctx, *configs[target])
        load.load(eng, os.path.join(out_dir, source), rank=ctx.rank)
        steps = layout_free._adam_step(eng)
        loss = _matrix_step(ctx, eng, cfg, 2)
        out["pair"][(source, target)] = {
            "adam_step": steps, "loss3": loss,
            "after_rel": _max_rel(_matrix_state(ctx, eng, model, cfg), ref_after)}
    return out
