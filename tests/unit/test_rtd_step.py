"""The RTD step's speed paths keep its results: no host synchronisation in forward and backward,
attention without a mask when the caller says the micro-batch has no padding."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rtd_scale.presets import preset
from rtd_scale.model.rtd import RTDModel
from tests.helpers.sync import SyncRecorder

SPECIAL = (0, 1, 2, 3, 4)


def _model(disallow_correct=False, compile_layers=False, dropout=0.0, attention="bert"):
    cfg = preset("tiny")
    if attention == "disentangled":  # DeBERTa's layout: relative positions, post-LN
        cfg.model.attention_type, cfg.model.layernorm_position = "disentangled", "post"
        cfg.model.position_buckets, cfg.model.max_relative_positions = 16, 64
    cfg.model.vocab_size = 300
    cfg.model.generator = dataclasses.replace(cfg.model.generator, hidden_size=32,
                                              ffn_hidden_size=64, hidden_dropout=dropout,
                                              attention_dropout=dropout)
    cfg.model.discriminator = dataclasses.replace(cfg.model.discriminator, hidden_size=32,
                                                  ffn_hidden_size=64, hidden_dropout=dropout,
                                                  attention_dropout=dropout)
    cfg.model.embedding_size = 32
    cfg.rtd.disallow_correct = disallow_correct
    cfg.model.compile_layers = compile_layers
    torch.manual_seed(3)
    return RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=SPECIAL,
                    pad_id=0, mask_id=4, seed=3)


def _ids(b=4, s=64):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 300, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    return ids


def test_the_recorder_sees_what_waits():
    t, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    rec = SyncRecorder()
    with rec:
        torch.nonzero(mask)
        t[mask]
        t[mask] = torch.tensor([1.0, 2.0, 3.0])
        float(t.sum())
        t[mask] = 0.0  # masked_fill_ inside ATen: no wait
    assert rec.ops == ["aten::nonzero", "aten::index", "aten::index_put_",
                       "aten::_local_scalar_dense"]


@pytest.mark.parametrize("disallow_correct", [False, True])
def test_forward_and_backward_never_wait_for_the_device(single_process_group, disallow_correct):
    model = _model(disallow_correct)
    ids = _ids()
    ids[3, 40:] = 0  # padding too
    rec = SyncRecorder()
    with rec:
        out = model(ids, torch.arange(4), step=7)
        out.loss.backward()
    assert rec.ops == []
    # and the step is the objective: L = L_MLM + λ·L_RTD, every masked slot sampled
    assert torch.isfinite(out.loss) and out.counts["masked"].item() == out.masked.sum().item()
    assert torch.equal(out.corrupted_ids[~out.masked], ids[~out.masked])


def test_no_padding_flag_gives_the_masked_result(single_process_group):
    """has_padding=False (attention without a mask) on a batch without [PAD] gives the same
    samples and losses as the default path that passes the all-False padding mask."""
    model = _model().eval()
    ids = _ids()
    with torch.no_grad():
        a = model(ids, torch.arange(4), step=2)
        b = model(ids, torch.arange(4), step=2, has_padding=False)
    assert torch.equal(a.corrupted_ids, b.corrupted_ids)
    assert abs(a.mlm_loss.item() - b.mlm_loss.item()) < 1e-5
    assert abs(a.rtd_loss.item() - b.rtd_loss.item()) < 1e-5


@pytest.mark.parametrize("attention", ["bert", "disentangled"])
def test_compiled_layers_compute_the_same_step(single_process_group, attention):
    """model.compile_layers compiles each encoder layer in place: same parameter names, the
    same losses and samples (to float tolerance), gradients reach every layer (with
    disentangled attention, the relative table too)."""
    plain = _model(attention=attention)
    compiled = _model(compile_layers=True, attention=attention)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in compiled.named_parameters()]
    ids = _ids()
    a = plain(ids, torch.arange(4), step=1)
    b = compiled(ids, torch.arange(4), step=1)
    assert torch.equal(a.masked, b.masked)
    assert abs(a.mlm_loss.item() - b.mlm_loss.item()) < 1e-4
    assert abs(a.rtd_loss.item() - b.rtd_loss.item()) < 1e-4
    b.loss.backward()
    layer = compiled.discriminator.block.layers[0]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())
    b_grads = {n: p.grad for n, p in compiled.named_parameters() if p.grad is not None}
    a.loss.backward()
    for n, p in plain.named_parameters():
        if p.grad is not None:
            assert torch.allclose(p.grad, b_grads[n], atol=1e-4, rtol=1e-3), n
    assert len(b_grads) == sum(p.grad is not None for p in plain.parameters())
    if attention == "disentangled":
        assert {"generator.rel_embeddings.weight", "discriminator.rel_embeddings.weight"} <= set(b_grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("has_padding", [False, True])
def test_cuda_step_never_makes_the_host_wait(single_process_group, has_padding):
    """On a GPU, forward and backward of the RTD step (dropout on, bf16 autocast) run without
    one host synchronisation (torch.cuda.set_sync_debug_mode("error") raises on any)."""
    from rtd_scale import distributed

    model = _model(dropout=0.1).cuda()
    distributed.seed_after_build(single_process_group, 3)
    ids = _ids().cuda()
    if has_padding:
        ids[3, 40:] = 0
    index = torch.arange(4, device="cuda")
    model(ids, index, step=0, has_padding=has_padding).loss.backward()  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(ids, index, step=1, has_padding=has_padding)
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss).item()
