"""What tests/unit/test_diagnostics.py and tests/multiproc/test_diagnostics_parallel.py share:
the brute-force AUC, the tiny model with TP-independent tables, and the dist-harness workers
(spawned processes import them from here)."""
from __future__ import annotations

import torch

from rtd_scale.config import Sharing
from rtd_scale.training.diagnostics import table_cosines


def brute_force_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """P(positive > negative) + ½ P(tie), over every (positive, negative) pair."""
    pos = [float(s) for s, l in zip(scores, labels) if l == 1]
    neg = [float(s) for s, l in zip(scores, labels) if l == 0]
    wins = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg)
    return wins / (len(pos) * len(neg))


def diagnostics_model(sharing: Sharing, tp_size: int):
    from tests.helpers.dist_workers import build, tiny_config

    model = build(tiny_config(sharing, vocab_size=300), tp_size)
    table = model.discriminator_table
    if hasattr(table, "delta"):  # E_Δ starts at zero: give it TP-independent nonzero rows
        rows = torch.arange(table.delta.shape[0]) + model.generator_table.vocab_start_index
        cols = torch.arange(table.delta.shape[1])
        with torch.no_grad():
            table.delta.copy_(0.02 * torch.sin(rows.view(-1, 1) * 0.37 + cols.view(1, -1)))
    return model


def cosines_worker(ctx):
    """Table cosines of each sharing mode's model at this TP size (run by the dist harness)."""
    return {s.value: table_cosines(diagnostics_model(s, ctx.tp_size), ctx.tp_group, zero3=False)
            for s in (Sharing.NES, Sharing.GDES)}


def evaluate_worker(ctx, zero_stage: int):
    """``loop.evaluate`` through a real DeepSpeed engine (ZeRO ``zero_stage``) on 2 global
    batches of 8 fixed samples, each data-parallel rank reading its share; at DP = 1 also the
    reference: every non-pad token's logit and label from plain forwards of the same model."""
    from rtd_scale import distributed
    from rtd_scale.data.packed import MicroBatch
    from rtd_scale.training import engine as engine_mod
    from rtd_scale.training.loop import evaluate
    from tests.helpers.dist_workers import build, fixed_batch, tiny_config

    cfg = tiny_config(Sharing.GDES, vocab_size=300)
    cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.eval_iters = 2, 8, 2
    gas = 8 // (2 * ctx.dp_size)
    ids, idx = fixed_batch(b=16)
    ids[9, 30:] = 0  # padding in the second global batch too
    share = 8 // ctx.dp_size
    loader = [MicroBatch(ids[k * 8 + ctx.dp_rank * share + 2 * j:][:2],
                         idx[k * 8 + ctx.dp_rank * share + 2 * j:][:2])
              for k in range(2) for j in range(gas)]
    model = build(cfg, ctx.tp_size)
    distributed.seed_after_build(ctx, 7)
    ds = engine_mod.resolve_ds_config({"zero_optimization": {"stage": zero_stage}}, cfg,
                                      data_parallel_size=ctx.dp_size,
                                      gradient_accumulation_steps=gas)
    eng = engine_mod.build_engine(model, cfg, ds, distributed.DeepSpeedMpu())
    res = {"dp_rank": ctx.dp_rank, "valid": evaluate(cfg, ctx, eng, loader),
           "cosines": table_cosines(model, ctx.tp_group, zero3=zero_stage == 3)}
    if ctx.dp_size == 1:
        model.eval()
        with torch.no_grad():
            outs = [model(ids[i:i + 2], idx[i:i + 2], step=0) for i in range(0, 16, 2)]
        logits = torch.cat([o.rtd_logits for o in outs])
        rep = torch.cat([o.corrupted_ids for o in outs]) != ids
        keep = ids != 0
        res["reference"] = (logits[keep], rep[keep].long())
    return res
