"""What ES and GDES share past the token table (``model.sharing_scope``,
``rtd_scale/model/sharing.py``): identity of the shared parameters, the gradient paths of
every shared tensor, the zero-initialised GDES residuals, the old token-only scope, the config
field and flag, and checkpoint compatibility.

ES, scope "embeddings": one embedding layer (ELECTRA's ``electra/embeddings`` scope). GDES,
scope "embeddings": token and position tables as stopgrad(E_G) + E_Δ (DeBERTa's
``rtd_task.py``). The token table's own gradient paths are tests/unit/test_model.py's.
"""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from rtd_scale.config import AttentionType, ConfigError, LayerNormPosition, Sharing, SharingScope
from rtd_scale.presets import preset
from rtd_scale.model import weights
from rtd_scale.model.sharing import GDESPositions, GDESTable

from tests.helpers.tiny_model import grad_abs_sums as _grad_sums
from tests.helpers.tiny_model import sample_ids as _ids
from tests.helpers.tiny_model import tiny_rtd_model as _model
PRE, POST = LayerNormPosition.PRE, LayerNormPosition.POST
EMB = ("position", "token_type", "norm")


def _cfg(sharing, scope=SharingScope.EMBEDDINGS, layout=PRE, embedding_size=48,
         attention=AttentionType.BERT):
    cfg = preset("tiny")
    cfg.model.vocab_size = 300
    cfg.model.sharing, cfg.model.sharing_scope = sharing, scope
    cfg.model.layernorm_position, cfg.model.attention_type = layout, attention
    no_dropout = dict(hidden_dropout=0.0, attention_dropout=0.0)
    cfg.model.generator = dataclasses.replace(cfg.model.generator, hidden_size=32,
                                              ffn_hidden_size=64, **no_dropout)
    cfg.model.discriminator = dataclasses.replace(cfg.model.discriminator, hidden_size=48,
                                                  ffn_hidden_size=96, **no_dropout)
    cfg.model.embedding_size = embedding_size
    cfg.validate()
    return cfg


def _names(m):
    return {n for n, _ in m.named_parameters()}


@pytest.mark.parametrize("layout", [PRE, POST])
def test_es_shares_the_whole_embedding_layer(single_process_group, layout):
    """ES: the discriminator holds the generator's position table, token-type row (post) and
    embedding LayerNorm — the very parameter objects — both losses train each of them, and the
    canonical state holds each once, under the generator's name; each model keeps its own
    projection (E != H)."""
    m = _model(_cfg(Sharing.ES, layout=layout, embedding_size=16))
    g, d = m.generator.embeddings, m.discriminator.embeddings
    assert d.table is g.table and d.position is g.position and d.norm is g.norm
    assert d.position.weight is g.position.weight and d.norm.weight is g.norm.weight
    assert (d.token_type is g.token_type) and ((g.token_type is None) == (layout is PRE))
    assert d.projection is not g.projection  # ELECTRA: embeddings_project per model
    assert d.projection.weight.shape == (48, 16) and g.projection.weight.shape == (32, 16)
    shared = [g.position.weight, g.norm.weight, g.norm.bias]
    if layout is POST:
        shared.append(g.token_type.weight)
    out = m(_ids(), torch.arange(4))
    for name, mlm, rtd in zip(("position", "norm.weight", "norm.bias", "token_type"),
                              _grad_sums(out.mlm_loss, shared), _grad_sums(out.rtd_loss, shared)):
        assert mlm > 0 and rtd > 0, name  # both losses reach the one tensor
    names = _names(m)
    assert not any(n.startswith(tuple(f"discriminator.embeddings.{c}" for c in EMB))
                   for n in names)
    state = weights.full_state_dict(m, tp_group=single_process_group.tp_group, vocab_size=300)
    assert "generator.embeddings.position.weight" in state
    assert not any(k.startswith("discriminator.embeddings.") and "projection" not in k
                   for k in state)


@pytest.mark.parametrize("layout", [PRE, POST])
def test_gdes_position_table_is_stopgrad_base_plus_zero_delta(single_process_group, layout):
    """GDES: the discriminator's position table is P_G.detach() + P_Δ with P_Δ exactly 0 at the
    start; L_RTD gives no gradient to P_G and L_MLM none to P_Δ; the token-type row and the
    embedding LayerNorm stay the discriminator's own (DeBERTa's hook touches neither)."""
    m = _model(_cfg(Sharing.GDES, layout=layout))
    g, d = m.generator.embeddings, m.discriminator.embeddings
    assert isinstance(d.table, GDESTable) and isinstance(d.position, GDESPositions)
    assert d.position.generator_position is g.position
    p_g, p_delta = g.position.weight, d.position.delta
    assert p_delta.shape == p_g.shape == (128, 48)
    assert torch.count_nonzero(p_delta).item() == 0
    pos = torch.arange(32)
    assert torch.equal(d.position(pos), g.position(pos))  # P_Δ = 0: the same positions
    assert d.norm is not g.norm and d.norm.weight is not g.norm.weight
    if layout is POST:
        assert d.token_type is not g.token_type
    out = m(_ids(), torch.arange(4))
    g_mlm = _grad_sums(out.mlm_loss, [p_g, p_delta])
    g_rtd = _grad_sums(out.rtd_loss, [p_g, p_delta])
    assert g_mlm[0] > 0 and g_mlm[1] == 0.0  # L_MLM trains P_G only
    assert g_rtd[0] == 0.0 and g_rtd[1] > 0  # L_RTD trains P_Δ only
    # the discriminator's own LayerNorm is trained by L_RTD only
    assert _grad_sums(out.mlm_loss, [d.norm.weight])[0] == 0.0
    assert _grad_sums(out.rtd_loss, [d.norm.weight])[0] > 0
    # ZeRO-3 gathers both foreign bases for the modules that read them
    pairs = {(type(mod).__name__, id(p)) for mod, p in m.foreign_parameters()}
    assert ("GDESTable", id(m.generator_table.weight)) in pairs
    assert ("GDESPositions", id(p_g)) in pairs
    assert "discriminator.embeddings.position.delta" in _names(m)
    assert "discriminator.embeddings.position.weight" not in _names(m)


@pytest.mark.parametrize("sharing", [Sharing.ES, Sharing.GDES])
def test_scope_tokens_keeps_separate_position_tables(single_process_group, sharing):
    """--sharing-scope tokens: only the token table is shared; each model has its own position
    table, token-type row and LayerNorm, each trained by its own loss only."""
    m = _model(_cfg(sharing, SharingScope.TOKENS, layout=POST))
    g, d = m.generator.embeddings, m.discriminator.embeddings
    for c in EMB:
        assert getattr(d, c) is not getattr(g, c), c
    assert isinstance(d.position, torch.nn.Embedding)
    assert (d.table is g.table) == (sharing is Sharing.ES)
    assert not any(n.endswith("position.delta") for n in _names(m))
    out = m(_ids(), torch.arange(4))
    params = [g.position.weight, d.position.weight]
    mlm, rtd = _grad_sums(out.mlm_loss, params), _grad_sums(out.rtd_loss, params)
    assert mlm[0] > 0 and mlm[1] == 0.0
    assert rtd[0] == 0.0 and rtd[1] > 0


@pytest.mark.parametrize("sharing", [Sharing.ES, Sharing.GDES])
def test_disentangled_attention_shares_only_the_token_table(single_process_group, sharing):
    """No position or token-type table under disentangled attention, and DeBERTa shares no
    LayerNorm: both scopes build the same parameters, and "tokens" warns that it changes
    nothing."""
    names = {}
    for scope in SharingScope:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = _cfg(sharing, scope, layout=POST, attention=AttentionType.DISENTANGLED)
        said = [str(w.message) for w in caught if "sharing-scope" in str(w.message)]
        assert said == ([] if scope is SharingScope.EMBEDDINGS else [
            "--sharing-scope tokens has no effect: disentangled attention has no position or "
            "token-type table"]), said
        m = _model(cfg)
        assert m.discriminator.embeddings.norm is not m.generator.embeddings.norm
        names[scope] = _names(m)
    assert names[SharingScope.TOKENS] == names[SharingScope.EMBEDDINGS]


def test_scope_config_field_flag_and_validation():
    """The default is "embeddings"; the flag and --set select "tokens"; a bad value is one
    ConfigError naming the field; "tokens" under NES warns; ES with two embedding LayerNorm
    epsilons cannot share one LayerNorm."""
    from rtd_scale.arguments import build_parser, config_from_args

    assert preset("tiny").model.sharing_scope is SharingScope.EMBEDDINGS
    base = ["--ds_config", "ds_configs/zero0.json", "--data-path", "x", "--tokenizer-model", "t"]
    cfg = config_from_args(build_parser().parse_args(base + ["--sharing-scope", "tokens"]))
    assert cfg.model.sharing_scope is SharingScope.TOKENS
    cfg = config_from_args(build_parser().parse_args(
        base + ["--set", "model.sharing_scope=tokens"]))
    assert cfg.model.sharing_scope is SharingScope.TOKENS
    assert "--sharing-scope {tokens,embeddings}" in build_parser().format_help()

    cfg = preset("tiny")
    with pytest.raises(ConfigError, match=r"^model.sharing_scope 'everything': choose one of "
                                          r"tokens, embeddings$"):
        cfg.model.sharing_scope = "everything"  # typed as it is set

    cfg = preset("tiny")
    cfg.model.sharing, cfg.model.sharing_scope = Sharing.NES, SharingScope.TOKENS
    with pytest.warns(UserWarning, match="^--sharing-scope tokens has no effect: --sharing nes "
                                         "shares nothing$"):
        cfg.validate()

    cfg = preset("electra-small")
    cfg.model.generator = dataclasses.replace(cfg.model.generator, layernorm_epsilon=1e-7)
    with pytest.raises(ConfigError, match="--sharing es shares the embedding LayerNorm, but "
                                          "model.generator.layernorm_epsilon 1e-07 != "
                                          "model.discriminator.layernorm_epsilon 1e-12; "):
        cfg.validate()
    cfg.model.sharing_scope = SharingScope.TOKENS
    cfg.validate()  # token-only sharing: each model its own LayerNorm


def _write_meta(tmp_path, config: dict) -> str:
    from rtd_scale.training.checkpoint.files import META_FILE

    tag = tmp_path / "global_step1"
    tag.mkdir(exist_ok=True)
    (tag / META_FILE).write_text(json.dumps({"layout": {"world_size": 1}, "config": config}))
    return str(tmp_path)


def test_a_checkpoint_at_another_sharing_scope_is_refused_where_the_scope_shapes_it(tmp_path):
    """A checkpoint saved under --sharing-scope tokens is refused under the default scope with
    the field and both values named, resumes under its own scope, and resumes either way where
    the scope changes nothing (disentangled attention)."""
    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.training.checkpoint.compat import check_compatible

    old = preset("tiny")
    old.model.sharing_scope = SharingScope.TOKENS
    run = _write_meta(tmp_path, old.to_dict())
    new = preset("tiny")
    with pytest.raises(UserInputError, match=r"holds another model \(model.sharing_scope "
                                             r"tokens → embeddings\)"):
        check_compatible(run, "global_step1", new, {"world_size": 1})
    new.model.sharing_scope = SharingScope.TOKENS
    check_compatible(run, "global_step1", new, {"world_size": 1})

    deberta = preset("debertav3-tiny")
    deberta.model.sharing_scope = SharingScope.TOKENS
    run = _write_meta(tmp_path, deberta.to_dict())
    check_compatible(run, "global_step1", preset("debertav3-tiny"), {"world_size": 1})
