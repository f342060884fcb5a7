"""The generator + discriminator pair on one process: sharing modes, padding, precision."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rtd_scale.config import LayerNormPosition, Sharing
from rtd_scale.presets import preset
from rtd_scale.model.rtd import RTDModel

from tests.helpers.tiny_model import SPECIAL
from tests.helpers.tiny_model import grad_abs_sums as _grads
from tests.helpers.tiny_model import sample_ids as _ids
from tests.helpers.tiny_model import tiny_rtd_model as _model
LAYOUTS = [LayerNormPosition.PRE, LayerNormPosition.POST]


def _cfg(sharing=Sharing.GDES, dropout=0.0, embedding_size=None, layout=LayerNormPosition.PRE):
    cfg = preset("tiny")
    cfg.model.vocab_size = 300
    cfg.model.sharing = sharing
    cfg.model.layernorm_position = layout
    cfg.model.generator = dataclasses.replace(cfg.model.generator, hidden_size=32,
                                              ffn_hidden_size=64, hidden_dropout=dropout,
                                              attention_dropout=dropout)
    cfg.model.discriminator = dataclasses.replace(cfg.model.discriminator, hidden_size=48,
                                                  ffn_hidden_size=96, hidden_dropout=dropout,
                                                  attention_dropout=dropout)
    cfg.model.embedding_size = embedding_size or 48
    return cfg


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gdes_gradient_paths_and_zero_init(single_process_group, layout):
    m = _model(_cfg(Sharing.GDES, layout=layout))
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_es_one_table_trained_by_both_losses(single_process_group, layout):
    m = _model(_cfg(Sharing.ES, layout=layout))
    assert m.discriminator_table is m.generator_table
    assert m.mlm_head.table is m.generator_table  # tied MLM output
    out = m(_ids(), torch.arange(4))
    e = m.generator_table.weight
    assert _grads(out.mlm_loss, [e])[0] > 0 and _grads(out.rtd_loss, [e])[0] > 0
    n_tables = sum(1 for n, _ in m.named_parameters() if n.endswith("table.weight"))
    assert n_tables == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nes_separate_tables(single_process_group, layout):
    m = _model(_cfg(Sharing.NES, layout=layout))
    e_g, e_d = m.generator_table.weight, m.discriminator_table.weight
    assert e_g is not e_d
    out = m(_ids(), torch.arange(4))
    assert _grads(out.mlm_loss, [e_g, e_d]) [1] == 0.0
    g = _grads(out.rtd_loss, [e_g, e_d])
    assert g[0] == 0.0 and g[1] > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_electra_style_narrow_generator_projects_the_shared_table(single_process_group, layout):
    cfg = _cfg(Sharing.ES, embedding_size=16, layout=layout)
    m = _model(cfg)
    assert m.generator.embeddings.projection.weight.shape == (32, 16)
    assert m.discriminator.embeddings.projection.weight.shape == (48, 16)
    out = m(_ids(), torch.arange(4))
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_real_tokens_do_not_depend_on_padding(single_process_group, layout):
    """Outputs at real tokens are the same however much padding follows."""
    m = _model(_cfg(Sharing.GDES, layout=layout)).eval()
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


def test_heavily_padded_batch_fp32_and_bf16(single_process_group):
    """Rows 90% padding (one row all padding): finite loss and gradients at step 1; bf16
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


@pytest.mark.parametrize("layout", LAYOUTS)
def test_activation_recompute_gives_the_same_step(single_process_group, layout):
    """megatron-core's full-layer recompute, on CPU: same losses and gradients (dropout on, so
    the recomputed forward must replay the same dropout masks)."""
    cfg = _cfg(Sharing.GDES, dropout=0.1, layout=layout)
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


# --- the post-LayerNorm layout (BERT / ELECTRA, Hugging Face ElectraModel) -------------------

POST = LayerNormPosition.POST


def test_post_ln_parameters_and_output_shape(single_process_group):
    cfg = _cfg(Sharing.GDES, layout=POST)
    m = _model(cfg).eval()
    names = {n for n, _ in m.named_parameters()}
    assert not any("final_layernorm" in n or "input_layernorm" in n or "pre_mlp_layernorm" in n
                   for n in names)
    for enc, h, layers in (("generator", 32, 2), ("discriminator", 48, 4)):
        for i in range(layers):
            for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
                assert f"{enc}.block.layers.{i}.{norm}.weight" in names
        assert m.get_parameter(f"{enc}.embeddings.token_type.weight").shape == (1, 48)
        assert m.get_parameter(f"{enc}.block.layers.0.self_attention.linear_qkv.weight").shape \
            == (3 * h, h)
    # the pre layout has neither the token-type row nor the post norms, but a final LayerNorm
    pre = {n for n, _ in _model(_cfg(Sharing.GDES)).named_parameters()}
    assert "discriminator.block.final_layernorm.weight" in pre
    assert not any("token_type" in n or "post_" in n for n in pre)
    ids = _ids(b=3, s=20)
    with torch.no_grad():
        hidden = m.discriminator(ids, ids == 0)
    assert hidden.shape == (20, 3, 48)  # [s, b, H]
    # the last op is a LayerNorm with weight 1, bias 0: every position has mean 0, variance 1
    assert hidden.mean(-1).abs().max().item() < 1e-5
    assert (hidden.var(-1, unbiased=False) - 1).abs().max().item() < 1e-3


def test_post_ln_initialisation(single_process_group):
    """LayerNorms 1 / 0; token-type row N(0, std²); residual output projections N(0, std²) in
    the post layout (BERT / ELECTRA) but N(0, (std / sqrt(2L))²) in the pre layout."""
    post, pre = _model(_cfg(layout=POST)), _model(_cfg())
    for name, p in post.named_parameters():
        if "layernorm" in name or ".norm." in name:
            assert torch.all(p == (1.0 if name.endswith("weight") else 0.0)), name
    tt = post.discriminator.embeddings.token_type.weight
    assert 0.012 < tt.std().item() < 0.028 and tt.abs().max().item() > 0
    key = "discriminator.block.layers.1.mlp.linear_fc2.weight"  # [48, 96]: 4608 draws
    assert post.get_parameter(key).std().item() == pytest.approx(0.02, rel=0.05)
    assert pre.get_parameter(key).std().item() == pytest.approx(0.02 / 8 ** 0.5, rel=0.05)


def test_fused_layernorm_weights_initialised_to_one():
    """TransformerEngine's LayerNorm+linear keeps its norm as ``layer_norm_weight`` /
    ``layer_norm_bias``: they start at 1 and 0 like any LayerNorm (not 0 like a bias)."""
    from rtd_scale.model import weights

    class FusedLinear(torch.nn.Module):  # TELayerNormColumnParallelLinear's parameter names
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(6, 8))
            self.bias = torch.nn.Parameter(torch.empty(6))
            self.layer_norm_weight = torch.nn.Parameter(torch.empty(8))
            self.layer_norm_bias = torch.nn.Parameter(torch.empty(8))

    model = torch.nn.Module()
    model.generator = torch.nn.Module()
    model.generator.linear_qkv = FusedLinear()
    weights.initialize(model, seed=1, std=0.02, num_layers={"generator": 1}, tp_rank=0,
                       tp_size=1, vocab_size=10)
    lin = model.generator.linear_qkv
    assert torch.equal(lin.layer_norm_weight, torch.ones(8))
    assert torch.equal(lin.layer_norm_bias, torch.zeros(8))
    assert torch.equal(lin.bias, torch.zeros(6)) and lin.weight.std().item() > 0.01


def _to_hf_electra(enc, table_weight, position_weight, vocab_size: int, num_heads: int) -> dict:
    """Our encoder's weights under Hugging Face ElectraModel's names (the fused QKV is split
    per head: rows [3d·h, 3d·h + 3d) are head h's query, key, value)."""
    sd = {"embeddings.word_embeddings.weight": table_weight[:vocab_size],
          "embeddings.position_embeddings.weight": position_weight,
          "embeddings.token_type_embeddings.weight": enc.embeddings.token_type.weight,
          "embeddings.LayerNorm.weight": enc.embeddings.norm.weight,
          "embeddings.LayerNorm.bias": enc.embeddings.norm.bias}
    if enc.embeddings.projection is not None:
        sd["embeddings_project.weight"] = enc.embeddings.projection.weight
        sd["embeddings_project.bias"] = enc.embeddings.projection.bias
    for i, layer in enumerate(enc.block.layers):
        hf = f"encoder.layer.{i}."
        att = layer.self_attention
        h = att.linear_proj.weight.shape[0]
        w = att.linear_qkv.weight.view(num_heads, 3, h // num_heads, h)
        b = att.linear_qkv.bias.view(num_heads, 3, h // num_heads)
        for j, part in enumerate(("query", "key", "value")):
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


@pytest.mark.parametrize("sharing, embedding_size", [(Sharing.GDES, 48), (Sharing.ES, 16)])
def test_post_ln_equals_hf_electra_model(single_process_group, sharing, embedding_size):
    """Both encoders, weights copied into Hugging Face ``ElectraModel`` (every parameter
    perturbed first, so LayerNorms and biases are not at their initial 1 / 0): zero missing and
    unexpected keys and the same hidden states on a padded batch (fp32, within 1e-5). E = H
    without ``embeddings_project``, E != H with it; under GDES the word table is E_G + E_Δ and
    the position table P_G + P_Δ; under ES both read the generator's embedding layer."""
    transformers = pytest.importorskip("transformers")
    cfg = _cfg(sharing, embedding_size=embedding_size, layout=POST)
    # one epsilon for both: ES shares the embedding LayerNorm
    cfg.model.generator = dataclasses.replace(cfg.model.generator, layernorm_epsilon=1e-12)
    cfg.model.discriminator = dataclasses.replace(cfg.model.discriminator,
                                                  layernorm_epsilon=1e-12)
    m = _model(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ids = _ids(b=3, s=24)
    ids[1, 15:] = 0
    ids[1, 14] = 2
    V = cfg.model.vocab_size
    tables = {"generator": m.generator_table.weight,
              "discriminator": (m.generator_table.weight + m.discriminator_table.delta
                                if sharing is Sharing.GDES else m.discriminator_table.weight)}
    gen_pos = m.generator.embeddings.position.weight
    positions = {"generator": gen_pos,
                 "discriminator": (gen_pos + m.discriminator.embeddings.position.delta
                                   if sharing is Sharing.GDES
                                   else m.discriminator.embeddings.position.weight)}
    for name, enc_cfg in (("generator", cfg.model.generator),
                          ("discriminator", cfg.model.discriminator)):
        enc = getattr(m, name)
        hf_cfg = transformers.ElectraConfig(
            vocab_size=V, embedding_size=embedding_size, hidden_size=enc_cfg.hidden_size,
            num_hidden_layers=enc_cfg.num_layers, num_attention_heads=enc_cfg.num_attention_heads,
            intermediate_size=enc_cfg.ffn_hidden_size, hidden_act="gelu",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            max_position_embeddings=cfg.model.max_position_embeddings, type_vocab_size=1,
            layer_norm_eps=enc_cfg.layernorm_epsilon, pad_token_id=0)
        hf = transformers.ElectraModel(hf_cfg).eval()
        report = hf.load_state_dict(
            _to_hf_electra(enc, tables[name], positions[name], V, enc_cfg.num_attention_heads),
            strict=False)
        assert report.missing_keys == [] and report.unexpected_keys == [], report
        with torch.no_grad():
            ours = enc(ids, ids == 0).transpose(0, 1)  # [b, s, H]
            theirs = hf(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state
        assert ours.shape == theirs.shape
        diff = (ours - theirs).abs().max().item()
        assert diff < 1e-5, f"{name}: max |ours - HF| = {diff:.3g}"


def test_layout_presets_flag_and_validation():
    from rtd_scale.config import ConfigError
    from rtd_scale.arguments import build_parser, config_from_args

    for name in ("electra-small", "electra-base", "electra-large"):
        cfg = preset(name)
        assert cfg.model.layernorm_position is POST
        assert cfg.model.discriminator.layernorm_epsilon == 1e-12  # BERT / HF ElectraConfig
    assert preset("tiny").model.layernorm_position is LayerNormPosition.PRE
    assert preset("debertav3-base").model.layernorm_position is POST  # DeBERTa is post-LN
    base = ["--ds_config", "x.json", "--preset", "tiny", "--data-path", "d", "--tokenizer-model",
            "t.model"]  # config_from_args only checks that they are given
    args = build_parser().parse_args(base + ["--layernorm-position", "post"])
    assert config_from_args(args).model.layernorm_position is POST
    args = build_parser().parse_args(base + ["--set", "model.layernorm_position=post"])
    assert config_from_args(args).model.layernorm_position is POST
    cfg = preset("tiny")
    with pytest.raises(ConfigError, match="^model.layernorm_position 'sandwich': choose one of "
                                          "pre, post$"):
        cfg.model.layernorm_position = "sandwich"  # typed as it is set


def test_checkpoint_of_the_other_layout_is_refused(tmp_path):
    import json

    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.training.checkpoint.compat import check_compatible
    from rtd_scale.training.checkpoint.files import META_FILE

    saved = preset("tiny")
    layout = {"world_size": 2, "tensor_model_parallel_size": 1}
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "global_step5" / META_FILE).write_text(
        json.dumps({"layout": layout, "config": saved.to_dict()}))
    assert check_compatible(str(tmp_path), "global_step5", saved, layout) is not None
    post = preset("tiny")
    post.model.layernorm_position = POST
    with pytest.raises(UserInputError, match="model.layernorm_position pre → post"):
        check_compatible(str(tmp_path), "global_step5", post, layout)


def test_checkpoint_from_before_the_layout_field_counts_as_pre_ln(tmp_path):
    """A checkpoint written before model.layernorm_position existed was pre-LN: it resumes a
    pre-LN run and is refused by a post-LN one."""
    import json

    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.training.checkpoint.compat import check_compatible
    from rtd_scale.training.checkpoint.files import META_FILE

    old = preset("tiny").to_dict()
    del old["model"]["layernorm_position"]
    layout = {"world_size": 1, "tensor_model_parallel_size": 1}
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "global_step5" / META_FILE).write_text(json.dumps({"layout": layout, "config": old}))
    assert check_compatible(str(tmp_path), "global_step5", preset("tiny"), layout)
    post = preset("tiny")
    post.model.layernorm_position = POST
    with pytest.raises(UserInputError, match="model.layernorm_position pre → post"):
        check_compatible(str(tmp_path), "global_step5", post, layout)


def test_checkpoint_with_another_vocab_multiple_is_refused(tmp_path):
    """Another --make-vocab-size-divisible-by changes the padded tables' shapes: one line
    naming the field, not DeepSpeed's shape-mismatch traceback; a checkpoint from before the
    field existed counts as 128."""
    import json

    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.training.checkpoint.compat import check_compatible
    from rtd_scale.training.checkpoint.files import META_FILE

    old = preset("tiny").to_dict()
    del old["model"]["make_vocab_size_divisible_by"]
    layout = {"world_size": 1, "tensor_model_parallel_size": 1}
    (tmp_path / "global_step5").mkdir()
    (tmp_path / "global_step5" / META_FILE).write_text(json.dumps({"layout": layout, "config": old}))
    assert check_compatible(str(tmp_path), "global_step5", preset("tiny"), layout)
    other = preset("tiny")
    other.model.make_vocab_size_divisible_by = 64
    with pytest.raises(UserInputError, match="model.make_vocab_size_divisible_by 128 → 64"):
        check_compatible(str(tmp_path), "global_step5", other, layout)


def test_mlm_loss_normaliser_by_hand(single_process_group):
    """Uniform logits over 4 ids cost ln 4 per masked row; the unused slot costs nothing; the
    sum 2 ln 4 is divided by the normaliser given (0.5 → 4 ln 4), else by the 2 valid rows."""
    import math

    from rtd_scale.model.heads import mlm_loss

    targets, valid = torch.tensor([1, 3, 0]), torch.tensor([True, True, False])
    got = mlm_loss(torch.zeros(3, 4), targets, valid, torch.tensor(0.5))
    assert got.item() == pytest.approx(4 * math.log(4), rel=1e-6)
    assert mlm_loss(torch.zeros(3, 4), targets, valid).item() == pytest.approx(math.log(4),
                                                                               rel=1e-6)


@pytest.mark.parametrize("strategy", ["span", "whole_word"])
def test_micro_batches_with_global_counts_give_the_whole_batch_step(single_process_group,
                                                                   strategy):
    """A padded batch of 4 under whole-word / span masking (unequal masked counts per sample),
    as 4 micro-batches given the global counts: the mean of their losses and the accumulated
    gradient of loss / 4 are the whole batch's (its own means) within 1e-6 (gradients: 1e-6
    relative to max(1, |g|); float32 summation order); the micro-batches'
    own means (no counts) would not be."""
    from rtd_scale.objectives.losses import MLM_COUNT, RTD_COUNT
    from rtd_scale.training.normalise import global_counts

    cfg = _cfg()
    cfg.rtd.mask_strategy = strategy
    table = torch.arange(300) % 2 == 0  # a word every 2 tokens on average
    torch.manual_seed(5)
    model = RTDModel(cfg.model, cfg.rtd, tensor_model_parallel_size=1, special_ids=SPECIAL,
                     pad_id=0, mask_id=4, seed=5, word_start_table=table)
    ids, index = _ids(s=64), torch.arange(10, 14)
    ids[1, 22:], ids[1, 21] = 0, 2
    ids[3, 9:], ids[3, 8] = 0, 2
    whole = model(ids, index, step=1)
    whole.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    parts = [(ids[j:j + 1], index[j:j + 1]) for j in range(4)]
    counts = global_counts(model, parts, single_process_group)
    assert counts.tolist() == [whole.masked.sum().item(), (ids != 0).sum().item()]
    per_sample = [model.loss_counts(i, x)[MLM_COUNT].item() for i, x in parts]
    assert len(set(per_sample)) > 1  # what per-micro-batch means would weigh wrongly
    outs = [model(i, x, step=1, global_counts=counts, num_micro_batches=4) for i, x in parts]
    for out in outs:
        (out.loss / 4).backward()  # what DeepSpeed's accumulation does
    for key in ("mlm_loss", "rtd_loss"):
        mean = sum(getattr(o, key).item() for o in outs) / 4
        assert mean == pytest.approx(getattr(whole, key).item(), abs=1e-6), key
    worst = max(((p.grad - want[n]).abs() / want[n].abs().clamp(min=1)).max().item()
                for n, p in model.named_parameters() if n in want)
    assert worst <= 1e-6, worst  # measured 2.4e-7 (span), 1.5e-7 (whole_word)
    own = [model(i, x, step=1) for i, x in parts]  # each micro-batch its own global batch
    assert abs(sum(o.mlm_loss.item() for o in own) / 4 - whole.mlm_loss.item()) > 1e-3
    assert RTD_COUNT == 1
