"""The generator + discriminator pair on one process: sharing modes, padding, precision."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rtd_scale.config import Sharing, preset
from rtd_scale.model.rtd import RTDModel

SPECIAL = (0, 1, 2, 3, 4)


def _cfg(sharing=Sharing.GDES, dropout=0.0, embedding_size=None):
    cfg = preset("tiny")
    cfg.model.vocab_size = 300
    cfg.model.sharing = sharing
    cfg.model.generator = dataclasses.replace(cfg.model.generator, hidden_size=32,
                                              ffn_hidden_size=64, hidden_dropout=dropout,
                                              attention_dropout=dropout)
    cfg.model.discriminator = dataclasses.replace(cfg.model.discriminator, hidden_size=48,
                                                  ffn_hidden_size=96, hidden_dropout=dropout,
                                                  attention_dropout=dropout)
    cfg.model.embedding_size = embedding_size or 48
    return cfg


def _model(cfg, seed=5):
    torch.manual_seed(seed)
    return RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=SPECIAL,
                    pad_id=0, mask_id=4, seed=seed)


def _ids(b=4, s=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    return ids


def _grads(loss, params):
    gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return [0.0 if g is None else g.abs().sum().item() for g in gs]


def test_gdes_gradient_paths_and_zero_init(single_process_group):
    m = _model(_cfg(Sharing.GDES))
    e_g, e_delta = m.generator_table.weight, m.discriminator_table.delta
    assert torch.count_nonzero(e_delta).item() == 0  # E_Δ starts at exactly zero
    assert m.discriminator_table.generator_table is m.generator_table
    out = m(_ids(), torch.arange(4))
    g_mlm = _grads(out.mlm_loss, [e_g, e_delta])
    g_rtd = _grads(out.rtd_loss, [e_g, e_delta])
    assert g_mlm[0] > 0 and g_mlm[1] == 0.0  # L_MLM trains E_G only
    assert g_rtd[0] == 0.0 and g_rtd[1] > 0  # L_RTD trains E_Δ only
    # E_D = E_G + E_Δ: with E_Δ = 0 the two models see the same token rows
    ids = _ids()
    assert torch.equal(m.discriminator_table(ids), m.generator_table(ids))


def test_es_one_table_trained_by_both_losses(single_process_group):
    m = _model(_cfg(Sharing.ES))
    assert m.discriminator_table is m.generator_table
    assert m.mlm_head.table is m.generator_table  # tied MLM output
    out = m(_ids(), torch.arange(4))
    e = m.generator_table.weight
    assert _grads(out.mlm_loss, [e])[0] > 0 and _grads(out.rtd_loss, [e])[0] > 0
    n_tables = sum(1 for n, _ in m.named_parameters() if n.endswith("table.weight"))
    assert n_tables == 1


def test_nes_separate_tables(single_process_group):
    m = _model(_cfg(Sharing.NES))
    e_g, e_d = m.generator_table.weight, m.discriminator_table.weight
    assert e_g is not e_d
    out = m(_ids(), torch.arange(4))
    assert _grads(out.mlm_loss, [e_g, e_d]) [1] == 0.0
    g = _grads(out.rtd_loss, [e_g, e_d])
    assert g[0] == 0.0 and g[1] > 0


def test_electra_style_narrow_generator_projects_the_shared_table(single_process_group):
    cfg = _cfg(Sharing.ES, embedding_size=16)
    m = _model(cfg)
    assert m.generator.embeddings.projection.weight.shape == (32, 16)
    assert m.discriminator.embeddings.projection.weight.shape == (48, 16)
    out = m(_ids(), torch.arange(4))
    assert torch.isfinite(out.loss)


def test_c22_real_tokens_do_not_depend_on_padding(single_process_group):
    """C22: outputs at real tokens are the same however much padding follows."""
    m = _model(_cfg(Sharing.GDES)).eval()
    row = _ids(b=1, s=12)
    short = torch.cat([row, torch.zeros(1, 4, dtype=torch.long)], 1)
    long = torch.cat([row, torch.zeros(1, 52, dtype=torch.long)], 1)
    with torch.no_grad():
        h_short = m.discriminator(short, short == 0)[:12]
        h_long = m.discriminator(long, long == 0)[:12]
        out_s, out_l = m(short, torch.tensor([9])), m(long, torch.tensor([9]))
    assert (h_short - h_long).abs().max().item() < 1e-5
    # same masks, same samples, same losses: padding is invisible to the objective
    assert torch.equal(out_s.masked[:, :12], out_l.masked[:, :12])
    assert not out_l.masked[:, 12:].any()
    assert torch.equal(out_s.corrupted_ids[:, :16], out_l.corrupted_ids[:, :16])
    assert abs(out_s.mlm_loss.item() - out_l.mlm_loss.item()) < 1e-5
    assert abs(out_s.rtd_loss.item() - out_l.rtd_loss.item()) < 1e-5
    assert out_l.counts["tokens"].item() == 12


def test_c03_heavily_padded_batch_fp32_and_bf16(single_process_group):
    """C03: rows 90% padding (one row all padding): finite loss and gradients at step 1; bf16
    agrees with fp32 to bf16 precision; padding contributes nothing."""
    cfg = _cfg(Sharing.GDES)
    ids = _ids(b=8, s=64)
    ids[:, 7:] = 0
    ids[:, 6] = 2
    ids[7, :] = 0  # a row of nothing but padding
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = _model(cfg).to(dtype)
        out = m(ids, torch.arange(8))
        out.loss.backward()
        assert torch.isfinite(out.loss).item()
        for name, p in m.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), name
        results[dtype] = out
    f, b = results[torch.float32], results[torch.bfloat16]
    assert f.counts["tokens"].item() == 7 * 7
    assert abs(b.mlm_loss.item() - f.mlm_loss.item()) / f.mlm_loss.item() < 2e-2
    assert abs(b.rtd_loss.item() - f.rtd_loss.item()) / f.rtd_loss.item() < 5e-2


def test_padded_vocab_never_predicted_or_sampled(single_process_group):
    cfg = _cfg()
    m = _model(cfg)
    assert m.padded_vocab_size == 384  # 300 rounded up to a multiple of 128
    out = m(_ids(b=16, s=64), torch.arange(16))
    sampled = out.corrupted_ids[out.masked]
    assert sampled.max().item() < 300
    assert not torch.isin(sampled, torch.tensor([0, 1, 2, 3, 4])).any()


def test_activation_recompute_gives_the_same_step(single_process_group):
    """megatron-core's full-layer recompute, on CPU: same losses and gradients (dropout on, so
    the recomputed forward must replay the same dropout masks)."""
    cfg = _cfg(Sharing.GDES, dropout=0.1)
    results = []
    for recompute in (False, True):
        torch.manual_seed(3)
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().reset()
        tensor_parallel.get_cuda_rng_tracker().add("model-parallel-rng", 77)
        m = RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=SPECIAL,
                     pad_id=0, mask_id=4, seed=5, recompute_activations=recompute).train()
        assert m.generator.block.config.recompute_granularity == ("full" if recompute else None)
        out = m(_ids(), torch.arange(4))
        out.loss.backward()
        results.append((out.loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()
                                          if p.grad is not None}))
    (l0, g0), (l1, g1) = results
    assert l0 == pytest.approx(l1, abs=1e-6)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert (g0[name] - g1[name]).abs().max().item() < 1e-5, name
