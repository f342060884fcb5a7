"""Worker functions for tests/multiproc/test_pipeline_eval.py (run by tests/helpers/dist.py)."""
from __future__ import annotations

import torch

from rtd_scale.config import Sharing
from tests.helpers.dist_workers import _build_stage, _pp_config, _pp_micro_batches


def pipeline_eval(ctx):
    """Validation forward over 4 micro-batches at this layout (PP = 1: the plain forward under
    no_grad with the global batch's counts; PP > 1: ``pipeline_forward``), the model in eval
    mode.
    Returns the last stage's losses and masks, and whether any gradient appeared."""
    from rtd_scale.training.pipeline import pipeline_forward

    model = _build_stage(ctx, _pp_config(Sharing.GDES))
    model.eval()
    mbs = _pp_micro_batches()
    if ctx.pp_size == 1:  # normalised over the 4 micro-batches, as loop.evaluate does
        from rtd_scale.training.normalise import global_counts

        with torch.no_grad():
            counts = global_counts(model, [(mb.input_ids, mb.sample_index) for mb in mbs], ctx)
            outs = [model(mb.input_ids, mb.sample_index, step=0, global_counts=counts,
                          num_micro_batches=len(mbs)) for mb in mbs]
    else:
        outs = pipeline_forward(model, mbs, step=0, ctx=ctx)
    return {"pp_rank": ctx.pp_rank, "tp_rank": ctx.tp_rank,
            "mlm": [o.mlm_loss.item() for o in outs], "rtd": [o.rtd_loss.item() for o in outs],
            "masked": [o.masked for o in outs], "requires_grad": any(o.loss.requires_grad for o in outs),
            "grads": sum(p.grad is not None for p in model.parameters())}
