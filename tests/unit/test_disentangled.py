"""DeBERTa's disentangled attention (rtd_scale/model/disentangled.py): log buckets, equality with
Hugging Face's DebertaV2Model, gradient paths, presets and flags."""
from __future__ import annotations

import pytest
import torch

from rtd_scale.config import AttentionType, ConfigError, LayerNormPosition, Sharing
from rtd_scale.presets import preset
from rtd_scale.model.disentangled import (RELATIVE_TABLE_ATTENTION_ARG, disentangled_attention,
                                          distance_rows, log_bucket_position,
                                          relative_position_index, relative_shift, used_rows)
from rtd_scale.model.rtd import RTDModel
from tests.helpers.tiny_model import tiny_config

hf_deberta = pytest.importorskip("transformers.models.deberta_v2.modeling_deberta_v2")

SPECIAL = (0, 1, 2, 3, 4)
POST, DIS = LayerNormPosition.POST, AttentionType.DISENTANGLED


def _cfg(sharing=Sharing.GDES, embedding_size=48, buckets=8, max_rel=-1, dropout=0.0):
    """Tiny DeBERTa pair (generator 2 layers, discriminator 3); 8 buckets over 40 tokens, so
    distances beyond 4 are log-bucketed."""
    cfg = tiny_config(sharing, embedding_size=embedding_size, dropout=dropout, layout=POST,
                      attention=DIS, position_buckets=buckets, num_layers=(2, 3))
    cfg.model.max_relative_positions = max_rel
    cfg.model.max_position_embeddings = 64
    cfg.model.validate()
    return cfg


def _model(cfg, seed=5, recompute=False):
    torch.manual_seed(seed)
    return RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=SPECIAL,
                    pad_id=0, mask_id=4, seed=seed, recompute_activations=recompute)


def _ids(b=3, s=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (b, s), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    ids[1, 25:] = 0  # a padded sample
    ids[1, 24] = 2
    return ids


# --- relative positions ---------------------------------------------------------------------

@pytest.mark.parametrize("buckets, max_pos", [(256, 512), (8, 64), (16, 128), (64, 1024)])
def test_log_buckets_equal_hugging_face(buckets, max_pos):
    r = torch.arange(-3 * max_pos, 3 * max_pos + 1)
    ours = log_bucket_position(r, buckets, max_pos)
    theirs = hf_deberta.make_log_bucket_position(r, buckets, max_pos).long()
    assert torch.equal(ours, theirs)
    assert ours.dtype == torch.int64
    # near distances unchanged, the longest one mapped to the last bucket, odd symmetry
    assert torch.equal(ours[r.abs() <= buckets // 2], r[r.abs() <= buckets // 2])
    assert ours[r == max_pos - 1].item() == buckets - 1
    assert torch.equal(ours, -ours.flip(0))


@pytest.mark.parametrize("s, buckets, max_pos", [(40, 8, 64), (512, 256, 512), (300, -1, 128)])
def test_relative_index_equals_hugging_face_c2p_positions(s, buckets, max_pos):
    x = torch.zeros(1, s, 4)
    rel = hf_deberta.build_relative_position(x, x, bucket_size=buckets, max_position=max_pos)
    span = buckets if buckets > 0 else max_pos
    theirs = torch.clamp(rel[0] + span, 0, 2 * span - 1)  # HF's c2p_pos
    ours = relative_position_index(s, span, buckets, max_pos)
    assert ours.shape == (s, s) and torch.equal(ours, theirs)
    # position→content reads the same rows: HF's p2c_pos at [j, i] is δ(i, j)
    p2c = torch.clamp(-rel[0] + span, 0, 2 * span - 1)
    assert torch.equal(p2c.t(), ours)
    # only the rows the index reads are projected
    lo, hi = used_rows(s, span, buckets, max_pos)
    assert (ours.min().item(), ours.max().item() + 1) == (lo, hi)


@pytest.mark.parametrize("s", [1, 2, 20])
def test_shifted_relative_terms_equal_the_gathered_ones(s):
    """relative_terms="shift" (a matmul per distance, skewed by a view) gives the gathered
    c2p / p2c: the same output and gradients in fp64, for both cores, with padding."""
    g = torch.Generator().manual_seed(s)
    b, n, d, k = 2, 3, 8, 6
    leaves = [torch.randn(b, n, s, d, generator=g, dtype=torch.float64, requires_grad=True)
              for _ in range(3)]
    leaves += [torch.randn(n, 2 * k, d, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(2)]
    index = relative_position_index(s, k, k, 16)
    pad = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    pad[1, ..., s - 1:] = s > 1
    weights = torch.randn(b, n, s, d, generator=g, dtype=torch.float64)
    weights[1, :, s - 1:] *= s == 1  # a [PAD] query's output is read by no loss (the cores'
    # gradients differ there: sdpa lets the masked scores' gradient through, explicit does not)
    results = {}
    for impl in ("explicit", "sdpa"):
        for terms in ("gather", "shift"):
            out = disentangled_attention(*leaves[:3], leaves[4], leaves[3], index, pad,
                                         impl=impl, relative_terms=terms)
            grads = torch.autograd.grad((out * weights).sum(), leaves)
            results[impl, terms] = (out, grads)
    ref_out, ref_grads = results["explicit", "gather"]
    # every input gets a gradient (at s 1 only v: one key, so the scores do not matter)
    assert all(gr.abs().sum() > 0 for gr in (ref_grads[2:3] if s == 1 else ref_grads))
    for key, (out, grads) in results.items():
        assert (out - ref_out).abs().max().item() < 1e-12, key
        for a, r in zip(grads, ref_grads):
            assert (a - r).abs().max().item() < 1e-12, key


def test_relative_shift_puts_each_distance_under_its_pair():
    s = 4
    x = torch.arange(s * (2 * s - 1)).view(s, 2 * s - 1)  # x[i, c] = i·(2s − 1) + c
    out = relative_shift(x)
    i, j = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    assert torch.equal(out, x[i, j - i + s - 1])
    assert out.data_ptr() >= x.data_ptr() and out._base is not None  # a view, not a copy
    assert torch.equal(distance_rows(relative_position_index(3, 2, -1, 8)),
                       torch.tensor([0, 1, 2, 3, 3]))  # distances −2 … 2 at span 2: δ = r + 2
    # clamped to the 2·span rows


def test_sdpa_and_explicit_cores_agree():
    g = torch.Generator().manual_seed(0)
    b, n, s, d, k = 2, 3, 20, 8, 6
    q, kk, v = (torch.randn(b, n, s, d, generator=g, dtype=torch.float64) for _ in range(3))
    pq, pk = (torch.randn(n, 2 * k, d, generator=g, dtype=torch.float64) for _ in range(2))
    index = relative_position_index(s, k, k, 16)
    pad = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    pad[1, ..., 12:] = True
    a = disentangled_attention(q, kk, v, pq, pk, index, pad, impl="explicit")
    c = disentangled_attention(q, kk, v, pq, pk, index, pad, impl="sdpa")
    assert (a - c).abs().max().item() < 1e-10
    # a [PAD] query averages over every key (Hugging Face's fully masked row)
    assert torch.allclose(a[1, :, 15], v[1].mean(dim=1))


# --- equality with Hugging Face -------------------------------------------------------------

def _to_hf_deberta(enc, table_weight, vocab_size: int, num_heads: int) -> dict:
    """Our encoder's weights under Hugging Face DebertaV2Model's names (the fused QKV split per
    head: rows [3d·h, 3d·h + 3d) are head h's query, key, value)."""
    emb = enc.embeddings
    sd = {"embeddings.word_embeddings.weight": table_weight[:vocab_size],
          "embeddings.LayerNorm.weight": emb.norm.weight,
          "embeddings.LayerNorm.bias": emb.norm.bias,
          "encoder.rel_embeddings.weight": enc.rel_embeddings.weight,
          "encoder.LayerNorm.weight": enc.rel_embeddings_norm.weight,
          "encoder.LayerNorm.bias": enc.rel_embeddings_norm.bias}
    if emb.projection is not None:
        sd["embeddings.embed_proj.weight"] = emb.projection.weight
    for i, layer in enumerate(enc.block.layers):
        hf = f"encoder.layer.{i}."
        att = layer.self_attention
        h = att.linear_proj.weight.shape[0]
        w = att.linear_qkv.weight.view(num_heads, 3, h // num_heads, h)
        b = att.linear_qkv.bias.view(num_heads, 3, h // num_heads)
        for j, part in enumerate(("query_proj", "key_proj", "value_proj")):
            sd[f"{hf}attention.self.{part}.weight"] = w[:, j].reshape(h, h)
            sd[f"{hf}attention.self.{part}.bias"] = b[:, j].reshape(h)
        for ours, theirs in ((att.linear_proj, "attention.output.dense"),
                             (layer.post_self_attn_layernorm, "attention.output.LayerNorm"),
                             (layer.mlp.linear_fc1, "intermediate.dense"),
                             (layer.mlp.linear_fc2, "output.dense"),
                             (layer.post_mlp_layernorm, "output.LayerNorm")):
            sd[f"{hf}{theirs}.weight"] = ours.weight
            sd[f"{hf}{theirs}.bias"] = ours.bias
    return {k: v.detach().clone() for k, v in sd.items()}


def _hf_config(transformers, cfg, enc_cfg):
    m = cfg.model
    return transformers.DebertaV2Config(
        vocab_size=m.vocab_size, embedding_size=m.embedding_size,
        hidden_size=enc_cfg.hidden_size, num_hidden_layers=enc_cfg.num_layers,
        num_attention_heads=enc_cfg.num_attention_heads,
        intermediate_size=enc_cfg.ffn_hidden_size, hidden_act="gelu",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        max_position_embeddings=m.max_position_embeddings, type_vocab_size=0,
        layer_norm_eps=enc_cfg.layernorm_epsilon, pad_token_id=0, relative_attention=True,
        position_buckets=m.position_buckets, max_relative_positions=m.max_relative_positions,
        pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
        position_biased_input=False)


@pytest.mark.parametrize("sharing, embedding_size, buckets, max_rel",
                         [(Sharing.GDES, 48, 8, -1), (Sharing.ES, 16, 16, 32),
                          (Sharing.NES, 48, -1, 24)])
def test_both_encoders_equal_hf_deberta_v2_model(single_process_group, sharing, embedding_size,
                                                 buckets, max_rel):
    """Both encoders, weights copied into Hugging Face ``DebertaV2Model`` (every parameter
    perturbed first, so norms and biases are not at their initial 1 / 0): zero missing and
    unexpected keys, the same hidden states at every position of a padded batch (fp32, within
    1e-5); log buckets (8, 16), none with clamped distances (-1, 24), and E != H
    (``embed_proj``)."""
    transformers = pytest.importorskip("transformers")
    cfg = _cfg(sharing, embedding_size=embedding_size, buckets=buckets, max_rel=max_rel)
    m = _model(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ids = _ids()
    V = cfg.model.vocab_size
    tables = {"generator": m.generator_table.weight,
              "discriminator": (m.generator_table.weight + m.discriminator_table.delta
                                if sharing is Sharing.GDES else m.discriminator_table.weight)}
    for name, enc_cfg in (("generator", cfg.model.generator),
                          ("discriminator", cfg.model.discriminator)):
        enc = getattr(m, name)
        hf = transformers.DebertaV2Model(_hf_config(transformers, cfg, enc_cfg)).eval()
        report = hf.load_state_dict(
            _to_hf_deberta(enc, tables[name], V, enc_cfg.num_attention_heads), strict=False)
        assert report.missing_keys == [] and report.unexpected_keys == [], report
        with torch.no_grad():
            ours = enc(ids, ids == 0).transpose(0, 1)  # [b, s, H]
            theirs = hf(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state
            unmasked = enc(ids, None).transpose(0, 1)
            theirs_unmasked = hf(input_ids=ids).last_hidden_state
        assert ours.shape == theirs.shape
        diff = (ours - theirs).abs().max().item()
        assert diff < 1e-5, f"{name}: max |ours - HF| = {diff:.3g}"
        # no mask (a micro-batch without [PAD], has_padding=False): also Hugging Face's
        assert (unmasked - theirs_unmasked).abs().max().item() < 1e-5
        assert (ours - unmasked).abs().max().item() > 1e-3  # the mask did something


def test_parameter_names_and_shapes(single_process_group):
    cfg = _cfg(buckets=8)
    m = _model(cfg)
    names = dict(m.named_parameters())
    for enc, h in (("generator", 32), ("discriminator", 48)):
        assert names[f"{enc}.rel_embeddings.weight"].shape == (16, h)  # [2·buckets, H]
        assert names[f"{enc}.rel_embeddings_norm.weight"].shape == (h,)
        assert names[f"{enc}.rel_embeddings_norm.bias"].shape == (h,)
        assert f"{enc}.block.layers.0.self_attention.linear_qkv.weight" in names
        assert f"{enc}.block.layers.0.self_attention.linear_proj.weight" in names
        assert not any(n.startswith(f"{enc}.embeddings.position") for n in names)
        assert not any(n.startswith(f"{enc}.embeddings.token_type") for n in names)
        assert torch.equal(names[f"{enc}.rel_embeddings_norm.weight"], torch.ones(h))
        assert 0.015 < names[f"{enc}.rel_embeddings.weight"].std().item() < 0.025  # N(0, 0.02²)
    assert names["discriminator.embeddings.norm.weight"].shape == (48,)


# --- gradient paths -------------------------------------------------------------------------

def _capture_layer_positions(encoder):
    """Give every layer's attention its own leaf copy of P (forward pre-hooks); returns them."""
    copies = []

    def hook(module, args, kwargs):
        p = kwargs[RELATIVE_TABLE_ATTENTION_ARG].detach().clone().requires_grad_(True)
        copies.append(p)
        return args, {**kwargs, RELATIVE_TABLE_ATTENTION_ARG: p}

    handles = [layer.self_attention.register_forward_pre_hook(hook, with_kwargs=True)
               for layer in encoder.block.layers]
    return copies, handles


def test_relative_table_trained_by_every_layer(single_process_group):
    m = _model(_cfg(Sharing.GDES))
    copies = {}
    handles = []
    for name in ("generator", "discriminator"):
        copies[name], h = _capture_layer_positions(getattr(m, name))
        handles += h
    out = m(_ids(), torch.arange(3), step=1)
    out.loss.backward()
    for h in handles:
        h.remove()
    assert len(copies["generator"]) == 2 and len(copies["discriminator"]) == 3
    for name in ("generator", "discriminator"):
        for i, p in enumerate(copies[name]):
            assert p.grad is not None and p.grad.abs().sum().item() > 0, f"{name} layer {i}"
    # and without the hooks, the table itself gets the gradient through every layer
    m.zero_grad(set_to_none=True)
    out = m(_ids(), torch.arange(3), step=1)
    gen_rel, disc_rel = m.generator.rel_embeddings.weight, m.discriminator.rel_embeddings.weight
    g_mlm = torch.autograd.grad(out.mlm_loss, [gen_rel, disc_rel], retain_graph=True,
                                allow_unused=True)
    g_rtd = torch.autograd.grad(out.rtd_loss, [gen_rel, disc_rel], retain_graph=True,
                                allow_unused=True)
    assert g_mlm[0].abs().sum().item() > 0 and g_mlm[1] is None  # L_MLM: generator's only
    assert g_rtd[0] is None and g_rtd[1].abs().sum().item() > 0  # L_RTD: discriminator's only
    # 8 buckets over 40 tokens: rows 1..15 are read; row 0 never is (|bucket| ≤ k − 1, as in
    # Hugging Face)
    read = g_rtd[1].abs().sum(dim=1) > 0
    assert read[1:].all() and not read[0]


def test_gdes_paths_unchanged(single_process_group):
    m = _model(_cfg(Sharing.GDES))
    e_g, e_delta = m.generator_table.weight, m.discriminator_table.delta
    assert torch.count_nonzero(e_delta).item() == 0
    out = m(_ids(), torch.arange(3))
    g_mlm = torch.autograd.grad(out.mlm_loss, [e_g, e_delta], retain_graph=True, allow_unused=True)
    g_rtd = torch.autograd.grad(out.rtd_loss, [e_g, e_delta], retain_graph=True, allow_unused=True)
    assert g_mlm[0].abs().sum().item() > 0 and g_mlm[1] is None  # L_MLM trains E_G only
    assert g_rtd[0] is None and g_rtd[1].abs().sum().item() > 0  # L_RTD trains E_Δ only
    # [PAD] rows are zeroed after the embedding LayerNorm: the [PAD] row gets no gradient
    assert g_rtd[1][0].abs().sum().item() == 0.0


def test_activation_recompute_gives_the_same_step(single_process_group):
    cfg = _cfg(Sharing.GDES)
    grads = []
    for recompute in (False, True):
        m = _model(cfg, recompute=recompute)
        out = m(_ids(), torch.arange(3), step=2)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert "discriminator.rel_embeddings.weight" in grads[0]
    for n, g in grads[0].items():
        assert (g - grads[1][n]).abs().max().item() < 1e-6, n


# --- config, presets, flag ------------------------------------------------------------------

def test_presets_flag_and_validation():
    for size in ("xsmall", "small", "base", "large"):
        m = preset(f"debertav3-{size}").model
        assert m.attention_type is DIS and m.layernorm_position is POST
        assert m.position_buckets == 256 and m.relative_span() == 256
        assert m.resolved_max_relative_positions() == 512
        assert m.discriminator.layernorm_epsilon == 1e-7
    assert preset("tiny").model.attention_type is AttentionType.BERT
    assert preset("electra-base").model.attention_type is AttentionType.BERT

    from rtd_scale.arguments import build_parser, config_from_args

    base = ["--ds_config", "x.json", "--data-path", "d", "--tokenizer-model", "t.model"]
    args = build_parser().parse_args(base + ["--preset", "debertav3-xsmall",
                                             "--attention-type", "bert"])
    assert config_from_args(args).model.attention_type is AttentionType.BERT
    args = build_parser().parse_args(base + ["--preset", "electra-small", "--attention-type",
                                             "disentangled"])
    assert config_from_args(args).model.attention_type is DIS  # electra-* is post-LN
    args = build_parser().parse_args(base + ["--preset", "tiny", "--set",
                                             "model.attention_type=disentangled"])
    with pytest.raises(ConfigError, match="--layernorm-position post"):
        config_from_args(args)
    cfg = preset("tiny").model
    with pytest.raises(ConfigError, match="^model.attention_type 'relative': choose one of bert, "
                                          "disentangled, rotary$"):
        cfg.attention_type = "relative"  # typed as it is set
    cfg = _cfg().model
    cfg.position_buckets = 0
    with pytest.raises(ConfigError, match="model.position_buckets"):
        cfg.validate()


# --- CUDA (bench/device_check.sh runs these) ---------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("has_padding", [False, True])
def test_cuda_disentangled_cores_agree_and_never_make_the_host_wait(single_process_group,
                                                                    has_padding):
    """On a GPU: the "sdpa" core (CUDA's default) gives the "explicit" core's fp32 losses and
    gradients (the explicit core matches Hugging Face on the CPU, see
    test_hf_deberta.py; the process group is NCCL on a GPU machine, so no CPU model runs
    here); a bf16 step with dropout runs without one host synchronisation."""
    from rtd_scale import distributed
    from rtd_scale.model.disentangled import DisentangledCoreAttention

    cfg = _cfg(Sharing.GDES)
    ids = _ids()
    if not has_padding:
        ids[ids == 0] = 7
    results = {}
    for device, impl, terms in (("cuda", "explicit", "gather"), ("cuda", "sdpa", "gather"),
                                ("cuda", "sdpa", "shift")):
        m = _model(cfg).to(device)
        for core in m.modules():
            if isinstance(core, DisentangledCoreAttention):
                core.impl, core.relative_terms = impl, terms
        out = m(ids.to(device), torch.arange(3, device=device), step=1, has_padding=has_padding)
        out.loss.backward()
        results[device, impl, terms] = (out.loss.item(), {
            n: p.grad.cpu() for n, p in m.named_parameters() if p.grad is not None})
    ref_loss, ref = results["cuda", "explicit", "gather"]
    for key, (loss, grads) in results.items():
        assert loss == pytest.approx(ref_loss, abs=1e-4), key
        for n, g in ref.items():
            assert (grads[n] - g).abs().max().item() < 1e-4, (key, n)
    model = _model(_cfg(Sharing.GDES, dropout=0.1)).cuda()
    distributed.seed_after_build(single_process_group, 3)
    ids, index = ids.cuda(), torch.arange(3, device="cuda")
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


# --- the benchmark --------------------------------------------------------------------------

def test_deberta_bench_refuses_what_cpu_cannot_run_in_one_line(capsys):
    """FlexAttention has no CPU backward, flashdeberta's kernels no CPU build, megatron-core's
    linear layers no CPU autocast: the bench says so before building anything."""
    from bench import deberta_step_vs_hf as bench

    for argv, message in [
            (["--impls", "explicit,flex"], "--impls flex needs --device cuda (FlexAttention has "
             "no backward on CPU); time explicit,sdpa on CPU"),
            (["--impls", "flash"], "--impls flash needs --device cuda (flashdeberta's Triton "
             "kernels; on CPU only Triton's interpreter runs them, for the tests); time "
             "explicit,sdpa on CPU"),
            (["--tiny", "--bf16", "--ours-bf16", "both"], "--ours-bf16 both needs --device "
             "cuda (megatron-core's linear layers run their backward under autocast on CUDA "
             "only); use params on CPU")]:
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: {message}; bench/deberta_step_vs_hf.py --help lists every flag"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_flex_core_matches_explicit_forward_and_backward():
    """The FlexAttention core (``disentangled_flex.py``) gives the explicit core's outputs at
    every real query and the same gradients of q, k, v and both projected relative tables."""
    g = torch.Generator().manual_seed(0)
    b, n, s, d, k = 2, 4, 160, 64, 32
    q, kk, v = (torch.randn(b, n, s, d, generator=g) for _ in range(3))
    pq, pk = (torch.randn(n, 2 * k, d, generator=g) for _ in range(2))
    index = relative_position_index(s, k, k, 128).cuda()
    pad = torch.zeros(b, 1, 1, s, dtype=torch.bool)
    pad[1, ..., 100:] = True
    real = ~pad.view(b, 1, s, 1).cuda()
    upstream = torch.randn(b, n, s, d, generator=g).cuda() * real  # no gradient from [PAD] rows
    outs, grads = {}, {}
    for impl in ("explicit", "flex"):
        leaves = [t.cuda().requires_grad_() for t in (q, kk, v, pq, pk)]
        out = disentangled_attention(*leaves, index, pad.cuda(), impl=impl)
        (out * upstream).sum().backward()
        outs[impl] = out.detach() * real
        grads[impl] = [t.grad for t in leaves]
    assert (outs["flex"] - outs["explicit"]).abs().max().item() < 2e-3
    for name, a, c in zip("q k v pos_q pos_k".split(), grads["explicit"], grads["flex"]):
        assert (a - c).abs().max().item() < 2e-3 * max(1.0, a.abs().max().item()), name
