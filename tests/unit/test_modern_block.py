"""The modern block (model/modern.py; ModernBERT, arXiv 2412.13663): which layers are local and
at which RoPE base, where the norms sit, no bias anywhere in the encoder, the gated FFN, the
sliding window against a naive reference, rotary positions given per token, the flags, and the
presets' sizes against the published ones."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.identity_op import IdentityOp

from rtd_scale.arguments import build_parser, config_from_args
from rtd_scale.config import AttentionType, ConfigError, MLPActivation, RunConfig, Sharing
from rtd_scale.model.attention import SDPACoreAttention
from rtd_scale.model.encoder import Encoder, transformer_config
from rtd_scale.model.modern import GLOBAL, LOCAL
from rtd_scale.model.sharing import embedding_pair
from rtd_scale.presets import preset
from tests.helpers.tiny_model import sample_ids, tiny_config, tiny_rtd_model

BASE = ["--ds_config", "ds_configs/zero0.json", "--data-path", "data/x_text_document",
        "--tokenizer-model", "spm.model"]


def from_flags(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args([*BASE, *argv]))


def _modern_tiny(sharing=Sharing.GDES, **fields):
    cfg = tiny_config(sharing, attention="rotary", num_layers=(2, 4))
    for k, v in fields.items():
        setattr(cfg.model, k, v)
    cfg.validate()
    return cfg


def test_modernberts_layer_pattern_and_bases():
    """ModernBERT-base: layers 1, 4, …, 22 (1-based; Hugging Face's layer_id % 3 == 0) global at
    base 160,000, the other 14 local at 10,000 within ±64 tokens; megatron-core's own rule reads
    the same pattern from the TransformerConfig."""
    from megatron.core.transformer.utils import is_layer_window_attention

    m = preset("modernbert-base").model
    local = [n for n in range(1, 23) if m.local_layer(n)]
    assert [n for n in range(1, 23) if n not in local] == [1, 4, 7, 10, 13, 16, 19, 22]
    tc = transformer_config(m.discriminator, init_std=0.02, tensor_model_parallel_size=1,
                            model=m)
    assert tc.window_size == (64, 64)
    assert [n for n in range(1, 23) if is_layer_window_attention(
        tc.window_size, tc.window_attn_skip_freq, n)] == local
    assert (m.rotary_base, m.local_rotary_base) == (160_000.0, 10_000.0)
    bert = preset("tiny").model
    assert not any(bert.local_layer(n) for n in range(1, 5))  # other attention types: none


def test_each_layer_attends_and_rotates_by_its_kind(single_process_group):
    model = tiny_rtd_model(_modern_tiny())
    disc = model.discriminator
    assert [layer.local for layer in disc.block.layers] == [False, True, True, False]
    windows = [layer.self_attention.core_attention.window_size for layer in disc.block.layers]
    assert windows == [None, (4, 4), (4, 4), None]  # tiny_config's 8-token window
    d = 48 // 4
    for kind, base in ((GLOBAL, 160_000.0), (LOCAL, 10_000.0)):
        inv_freq = disc.rotary.kinds[kind].inv_freq
        assert inv_freq.shape == (d // 2,)
        assert inv_freq[1].item() == pytest.approx(base ** (-2 / d), rel=1e-6)


def test_norms_sit_where_modernbert_puts_them_and_nothing_has_a_bias(single_process_group):
    """Embedding norm, no attention norm in layer 1, an attention and an MLP norm in every other
    layer, a final norm; every norm a LayerNorm without bias; no linear of either encoder has a
    bias (ModernBertConfig's norm_bias, attention_bias and mlp_bias false). RMSNorm replaces
    every norm when asked. The BERT pre layout as the control keeps both."""
    model = tiny_rtd_model(_modern_tiny(Sharing.NES))
    for enc in (model.generator, model.discriminator):
        layers = enc.block.layers
        assert isinstance(layers[0].input_layernorm, IdentityOp)
        norms = ([enc.embeddings.norm, enc.block.final_layernorm]
                 + [layer.input_layernorm for layer in layers[1:]]
                 + [layer.pre_mlp_layernorm for layer in layers])
        assert all(type(n) is torch.nn.LayerNorm and n.bias is None for n in norms)
        names = [n for n, _ in enc.named_parameters()]
        assert not [n for n in names if n.endswith("bias")], names
    rms = tiny_rtd_model(_modern_tiny(Sharing.NES, normalization="RMSNorm")).discriminator
    assert isinstance(rms.embeddings.norm, torch.nn.RMSNorm)
    assert isinstance(rms.block.final_layernorm, torch.nn.RMSNorm)
    assert isinstance(rms.block.layers[1].input_layernorm, torch.nn.RMSNorm)
    bert = tiny_rtd_model(tiny_config(Sharing.NES)).discriminator  # control
    assert any(n.endswith("linear_fc1.bias") for n, _ in bert.named_parameters())
    assert not isinstance(bert.block.layers[0].input_layernorm, IdentityOp)


@pytest.mark.parametrize("activation, act", [("geglu", F.gelu), ("swiglu", F.silu)])
def test_gated_ffn_is_fc2_of_act_of_the_first_half_times_the_second(single_process_group,
                                                                  activation, act):
    cfg = _modern_tiny(mlp_activation=MLPActivation(activation))
    mlp = tiny_rtd_model(cfg).discriminator.block.layers[0].mlp
    fc1, fc2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    assert fc1.shape == (2 * 96, 48) and fc2.shape == (48, 96)
    x = torch.randn(5, 2, 48)
    a, g = (x @ fc1.T).chunk(2, dim=-1)  # Hugging Face ModernBertMLP: input, gate = Wi(x).chunk(2)
    out, bias = mlp(x)
    assert bias is None
    torch.testing.assert_close(out, (act(a) * g) @ fc2.T)
    other = F.silu if act is F.gelu else F.gelu  # negative control: the other activation
    assert not torch.allclose(out, (other(a) * g) @ fc2.T, atol=1e-4)


def _naive_attention(q, k, v, keep):
    """softmax(q·kᵀ / sqrt(d)) · v over the True entries of ``keep`` [b, 1, s, s]."""
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    s, b, h, d = q.shape
    return torch.einsum("bhst,tbhd->sbhd", probs, v).reshape(s, b, h * d)


def test_window_mask_equals_a_naive_banded_attention(single_process_group):
    """A local layer's core attention = attention over keys |i - j| <= 4 and not [PAD]; the
    global layer's over every non-[PAD] key (Hugging Face ModernBERT's sliding-window mask)."""
    model = tiny_rtd_model(_modern_tiny())
    layers = model.discriminator.block.layers
    local, glob = layers[1].self_attention.core_attention, layers[0].self_attention.core_attention
    assert isinstance(local, SDPACoreAttention)
    g = torch.Generator().manual_seed(0)
    s, b, h, d = 20, 2, 3, 12  # d: the layer's head size (its softmax scale)
    q, k, v = (torch.randn(s, b, h, d, generator=g) for _ in range(3))
    pad = torch.zeros(b, s, dtype=torch.bool)
    pad[1, 14:] = True
    i = torch.arange(s)
    band = (i.view(-1, 1) - i.view(1, -1)).abs() <= 4
    keys = ~pad.view(b, 1, 1, s)
    got_local = local(q, k, v, pad.view(b, 1, 1, s))
    got_global = glob(q, k, v, pad.view(b, 1, 1, s))
    rows = ~pad.T  # [s, b]: the queries that are not [PAD] (a [PAD] query's output is unread)
    torch.testing.assert_close(got_local[rows], _naive_attention(q, k, v, keys & band)[rows])
    torch.testing.assert_close(got_global[rows], _naive_attention(q, k, v, keys)[rows])
    assert not torch.allclose(got_local[rows], got_global[rows], atol=1e-3)  # the band bit
    # a [b, 1, s, s] pair mask (e.g. documents in a packed sample) is combined with the band
    pairs = torch.ones(b, 1, s, s, dtype=torch.bool)
    pairs[:, :, :10, 10:] = pairs[:, :, 10:, :10] = False
    torch.testing.assert_close(local(q, k, v, ~pairs),
                               _naive_attention(q, k, v, pairs & band))


def test_rotary_positions_are_relative_and_taken_per_token(single_process_group):
    """Explicit position ids [b, s]: shifted by a constant they give the same encoder output as
    none (RoPE depends on i - j only); restarting inside a sample (a packed document) changes
    it — the ids reach every layer's rotation."""
    torch.manual_seed(0)
    disc = tiny_rtd_model(_modern_tiny()).discriminator
    with torch.no_grad():  # sharper attention than at initialisation: positions matter more
        for layer in disc.block.layers:
            layer.self_attention.linear_qkv.weight.mul_(20)
    ids = sample_ids(b=2, s=24)
    b, s = ids.shape
    base = disc(ids, None)
    shifted = disc(ids, None, position_ids=torch.arange(s).repeat(b, 1) + 37)
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)
    restart = torch.cat([torch.arange(12), torch.arange(12)]).repeat(b, 1)
    assert (disc(ids, None, position_ids=restart) - base).abs().max() > 0.1


def test_flags_round_trip_and_their_errors():
    cfg = from_flags("--position-embedding-type", "rope", "--rotary-base", "500000",
                     "--local-rotary-base", "20000", "--window-size", "64,64",
                     "--global-attn-every-n-layers", "2", "--swiglu", "--disable-bias-linear",
                     "--normalization", "RMSNorm")
    m = cfg.model
    assert (m.attention_type, m.rotary_base, m.local_rotary_base, m.window_size,
            m.global_attn_every_n_layers, m.mlp_activation, m.add_bias_linear,
            m.normalization) == (AttentionType.ROTARY, 500_000.0, 20_000.0, 128, 2,
                                 MLPActivation.SWIGLU, False, "RMSNorm")
    assert RunConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()  # config.json
    assert from_flags("--use-rotary-position-embeddings", "--window-size", "128").model \
        .window_size == 128
    modern = from_flags("--preset", "modernbert-tiny", "--position-embedding-type",
                        "learned_absolute", "--set", "model.window_size=-1", "--set",
                        "model.mlp_activation=gelu", "--set", "model.norm_bias=true", "--set",
                        "model.add_bias_linear=true")
    assert modern.model.attention_type is AttentionType.BERT
    for argv, message in [
            (["--swiglu"], "--swiglu (model.mlp_activation) 'swiglu' belongs to the modern "
                           "block; add --position-embedding-type rope"),
            (["--position-embedding-type", "rope", "--window-size", "10,20"],
             "--window-size 10,20: expected N"),
            (["--position-embedding-type", "rope", "--layernorm-position", "post"],
             "needs --layernorm-position pre"),
            (["--position-embedding-type", "rope", "--normalization", "BatchNorm"],
             "--normalization (model.normalization) 'BatchNorm': choose LayerNorm or RMSNorm"),
            (["--position-embedding-type", "rope", "--window-size", "0"],
             "--window-size (model.window_size) must be > 0 or -1")]:
        with pytest.raises(ConfigError) as e:
            from_flags(*argv)
        assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("name, published", [("modernbert-base", 149e6),
                                             ("modernbert-large", 395e6)])
def test_presets_have_modernberts_published_sizes(single_process_group, name, published):
    """The discriminator with its embeddings (real vocabulary rows) is ModernBERT's size (arXiv
    2412.13663 Table 4 / the Hugging Face model cards: 149M and 395M); built on the meta device,
    so nothing is allocated. The generator: half the depth, the same width."""
    m = preset(name).model
    m.sharing = Sharing.NES  # the discriminator owns its table
    with torch.device("meta"):
        tcs = [transformer_config(e, init_std=0.02, tensor_model_parallel_size=1, model=m)
               for e in (m.generator, m.discriminator)]
        _, emb = embedding_pair(m, *tcs, m.padded_vocab_size(1))
        disc = Encoder(emb, tcs[1], layernorm_position=m.layernorm_position,
                       attention_type=m.attention_type, norm_bias=m.norm_bias)
    padding = (m.padded_vocab_size(1) - m.vocab_size) * m.embedding_size
    n = sum(p.numel() for p in disc.parameters()) - padding
    assert abs(n - published) < 0.005 * published, n
    assert (m.generator.num_layers * 2, m.generator.hidden_size) == \
        (m.discriminator.num_layers, m.discriminator.hidden_size)
