"""The RTD step does each piece of work once: every micro-batch is masked once per step — the
masks that count the global batch's positions (training/normalise.py) are the ones the forward
reads — in the one-stage step, in validation and in the pipeline-parallel step; and
L_MLM + rtd_lambda · L_RTD is formed in the model only (the metrics and the pipeline's
discriminator pass read it)."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.config import Sharing
from rtd_scale.data.packed import MicroBatch
from rtd_scale.model import rtd as rtd_mod
from rtd_scale.model.rtd import COUNT_KEYS, RTDOutput
from rtd_scale.training.metrics import MetricAccumulator
from rtd_scale.training.normalise import global_counts
from rtd_scale.training.pipeline import pipeline_forward_backward
from rtd_scale.training.step import eval_step, train_step
from tests.helpers.tiny_model import sample_ids, tiny_config, tiny_rtd_model


class PlainEngine:
    """What ``train_step`` asks of a DeepSpeed engine, for one process without DeepSpeed: the
    forward, ``backward`` and an update that changes nothing (so a later forward sees the same
    weights)."""

    def __init__(self, module, accumulation: int):
        self.module, self.accumulation = module, accumulation

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def backward(self, loss):
        (loss / self.accumulation).backward()  # DeepSpeed's scaling by accumulation steps

    def step(self):
        pass


@pytest.fixture
def mask_calls(monkeypatch):
    """The calls of the masking function ``RTDModel.mask`` runs, as a list of batch sizes."""
    calls, real = [], rtd_mod.mask_tokens

    def counted(input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return real(input_ids, *args, **kwargs)

    monkeypatch.setattr(rtd_mod, "mask_tokens", counted)
    return calls


def _micro_batches(n=3, b=2):
    ids = sample_ids(b=n * b, s=32, seed=4)
    ids[1, 20:] = 0  # one padded sample: the counts differ per micro-batch
    return [MicroBatch(ids[j * b:(j + 1) * b], torch.arange(100 + j * b, 100 + (j + 1) * b))
            for j in range(n)]


@pytest.mark.parametrize("step_fn", ["train", "eval"])
def test_one_stage_step_masks_each_micro_batch_once(single_process_group, mask_calls, step_fn):
    """3 micro-batches: 3 maskings (the step's counts and forwards share them; computing the
    counts apart would be 6), and the same outputs as forwards that mask for themselves."""
    model = tiny_rtd_model(tiny_config(Sharing.GDES))
    mbs = _micro_batches()
    engine = PlainEngine(model, accumulation=len(mbs))
    if step_fn == "train":
        outs = train_step(engine, mbs, step=3, ctx=single_process_group)
    else:
        with torch.no_grad():
            outs = eval_step(engine, mbs, step=3, ctx=single_process_group)
    assert mask_calls == [2, 2, 2]
    mask_calls.clear()
    pairs = [(mb.input_ids, mb.sample_index) for mb in mbs]
    counts = global_counts(model, pairs, single_process_group)  # masks for itself
    with torch.no_grad():
        own = [model(ids, idx, step=3, global_counts=counts, num_micro_batches=3)
               for ids, idx in pairs]
    assert mask_calls == [2] * 6  # the control: 3 for the counts, 3 in the forwards
    for a, b in zip(outs, own):
        assert torch.equal(a.loss.detach(), b.loss) and torch.equal(a.masked, b.masked)
        assert torch.equal(a.corrupted_ids, b.corrupted_ids)


def test_pipeline_step_masks_once_and_weights_rtd_once(single_process_group, mask_calls):
    """The pipeline-parallel step's code at one stage (megatron-core's schedule, both passes),
    at rtd_lambda 50: one masking per micro-batch for the counts, the generator's input and its
    masked positions; the one-stage step's losses, and its gradients within float32 summation
    order (the two passes accumulate L_MLM's and L_RTD's parts apart) — rtd_lambda applied
    twice, or not at all, would be off by a factor of 50 in the discriminator's."""
    cfg = tiny_config(Sharing.GDES)
    cfg.rtd.rtd_lambda = 50.0
    model = tiny_rtd_model(cfg)
    mbs = _micro_batches()
    outs = pipeline_forward_backward(model, mbs, step=3, ctx=single_process_group)
    assert mask_calls == [2, 2, 2]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    one_stage = train_step(PlainEngine(model, len(mbs)), mbs, step=3, ctx=single_process_group)
    for a, b in zip(outs, one_stage):
        for key in ("loss", "mlm_loss", "rtd_loss"):
            assert torch.equal(getattr(a, key), getattr(b, key).detach()), key
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_metrics_read_the_models_total():
    """The logged total is the mean of the model's ``loss``, not a sum the metrics form again:
    an output whose loss is no L_MLM + λ · L_RTD for the run's λ is logged as it is."""
    acc = MetricAccumulator(torch.device("cpu"))
    zero = torch.zeros(())
    for loss in (3.0, 5.0):
        acc.add(RTDOutput(loss=torch.tensor(loss), mlm_loss=torch.tensor(1.0),
                          rtd_loss=torch.tensor(0.5), counts={k: zero for k in COUNT_KEYS},
                          corrupted_ids=zero, masked=zero))
    got = acc.reduce(None)
    assert (got["loss/total"], got["loss/mlm"], got["loss/rtd"]) == (4.0, 1.0, 0.5)
