"""``--pretrained-checkpoint`` on one process: round trips are bitwise, the generator may start
fresh, and a checkpoint of another model is refused in one line naming the tensor and the flag."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import Sharing
from rtd_scale.hf import convert
from rtd_scale.hf.export import write_export
from rtd_scale.hf.pretrained import load_pretrained
from tests.helpers.hf_deberta import _assert_bitwise, _tensors, round_trip
from tests.helpers.hf_models import (
    POST,
    PRE,
    build_model,
    canonical_state,
    hf_outputs,
    max_diffs,
    modern_config,
    ours,
    perturb,
    real_batch,
    tiny_config,
)


@pytest.fixture(scope="module")
def tok(wiki_shards):
    from rtd_scale.data.tokenizer import Tokenizer

    return Tokenizer(wiki_shards[0])


def _export(model, cfg, ctx, tok, path):
    write_export(canonical_state(model, ctx), cfg.model, str(path), pad_id=tok.pad_id,
                 cls_id=tok.cls_id, sep_id=tok.sep_id, note=lambda m: None)


def _load(model, cfg, ctx, tok, path):
    load_pretrained(model, str(path), cfg.model, pad_id=tok.pad_id, tp_group=ctx.tp_group,
                    tp_rank=0)


# (layout, sharing, E != H, sharing scope)
CASES = [(POST, Sharing.ES, True, "embeddings"), (POST, Sharing.NES, False, "embeddings"),
         (POST, Sharing.GDES, True, "embeddings"), (PRE, Sharing.GDES, False, "embeddings"),
         (POST, Sharing.ES, True, "tokens"), (POST, Sharing.GDES, False, "tokens")]


@pytest.mark.parametrize("layout,sharing,projected,scope", CASES,
                         ids=[f"{l.value}-{s.value}-{'E!=H' if p else 'E=H'}-{c}"
                              for l, s, p, c in CASES])
def test_export_import_export_is_bitwise(single_process_group, tok, tmp_path, layout, sharing,
                                         projected, scope):
    """export → --pretrained-checkpoint into a differently seeded model → export: the same bytes
    of every tensor, and the imported model computes what the first did (under the default
    scope the shared embedding layer is split back exactly: ES one copy, GDES P_Δ)."""
    cfg = tiny_config(layout, sharing, projected, tok.vocab_size)
    cfg.model.sharing_scope = scope
    cfg.validate()
    first, second = round_trip(cfg, single_process_group, tok, tmp_path)
    ids = real_batch(tok)
    for x, y in zip(ours(first, ids, tok.pad_id), ours(second, ids, tok.pad_id)):
        assert torch.equal(x, y)


def test_modern_block_export_import_export_is_bitwise(single_process_group, tok, tmp_path):
    """ModernBERT's settings (no norm bias): export → --pretrained-checkpoint into a differently
    seeded model → export gives the same bytes of every tensor. The import holds every weight
    of the first model (GDES's E_G + E_Δ bitwise) but the MLM head's LayerNorm bias, which the
    export folded into the decoder's bias (ModernBertPredictionHead's norm has none): 0 there,
    and the output bias is b + Wβ, so the logits agree within 1e-5 and every other output is equal. A model whose
    window differs is refused in one line naming the config field and the flag."""
    ctx = single_process_group
    cfg = modern_config(tok.vocab_size)
    first, second = round_trip(cfg, ctx, tok, tmp_path)
    a, b = canonical_state(first, ctx), canonical_state(second, ctx)
    # GDES: E_Δ comes back as E_D − E_G, whose sum with E_G is E_D bitwise
    table, delta = "generator.embeddings.table.weight", "discriminator.embeddings.table.delta"
    assert torch.equal(a[table] + a[delta], b[table] + b[delta])
    assert sorted(a) == sorted(b) and [k for k in a if not torch.equal(a[k], b[k])] == [
        delta, "mlm_head.bias", "mlm_head.norm.bias"]
    assert torch.count_nonzero(b["mlm_head.norm.bias"]) == 0
    assert torch.count_nonzero(a["mlm_head.norm.bias"]) > 0  # the fold had something to do
    ids = real_batch(tok)
    mine, back = ours(first, ids, tok.pad_id), ours(second, ids, tok.pad_id)
    assert all(torch.equal(x, y) for x, y in zip(mine[:3], back[:3]))
    assert max_diffs(mine[3:], back[3:])[0] < 1e-5

    refusal = (f"--pretrained-checkpoint {tmp_path / 'a'}: the discriminator's local_attention "
               "is 16 there but 32 in this model; pass --window-size 16")
    other = modern_config(tok.vocab_size)
    other.model.window_size = 32
    with pytest.raises(UserInputError) as e:
        _load(build_model(other, ctx, tok), other, ctx, tok, tmp_path / "a")
    assert _message(e) == refusal


def _foreign_electra(tmp_path, tok, cfg, with_generator=True):
    """An ElectraForPreTraining (+ ElectraForMaskedLM in generator/) drawn by transformers itself,
    with its own random weights, saved by save_pretrained."""
    import transformers

    torch.manual_seed(0)
    disc = transformers.ElectraForPreTraining(
        convert.hf_config(cfg.model, "discriminator", pad_id=tok.pad_id))
    for p in disc.parameters():  # LayerNorms and biases off their defaults as well
        p.data.add_(torch.randn_like(p) * 0.05)
    disc.save_pretrained(tmp_path / "hf")
    if with_generator:
        gen = transformers.ElectraForMaskedLM(
            convert.hf_config(cfg.model, "generator", pad_id=tok.pad_id))
        for p in gen.parameters():
            p.data.add_(torch.randn_like(p) * 0.05)
        gen.save_pretrained(tmp_path / "hf" / "generator")
    return tmp_path / "hf"


def test_foreign_electra_round_trips_bitwise(single_process_group, tok, tmp_path):
    """HF → rtd_scale → HF: an ELECTRA pair saved by transformers comes back tensor for tensor
    (NES: two tables; E ≠ H: embeddings_project), and computes the same logits."""
    ctx = single_process_group
    cfg = tiny_config(POST, Sharing.NES, True, tok.vocab_size)
    src = _foreign_electra(tmp_path, tok, cfg)
    model = build_model(cfg, single_process_group, tok)
    _load(model, cfg, ctx, tok, src)
    _export(model, cfg, ctx, tok, tmp_path / "back")
    _assert_bitwise(_tensors(src), _tensors(tmp_path / "back"))
    ids = real_batch(tok)
    mine, theirs = ours(model, ids, tok.pad_id), hf_outputs(src, POST, ids, tok.pad_id)
    assert max((a - b).abs().max().item() for a, b in zip(mine, theirs)) < 1e-4


@pytest.mark.parametrize("sharing", [Sharing.GDES, Sharing.NES, Sharing.ES])
def test_discriminator_alone_gives_a_fresh_generator(single_process_group, tok, tmp_path,
                                                     sharing):
    """Without generator/ the generator starts fresh, except what it shares with the
    discriminator (sharing scope "embeddings"): under GDES its token and position tables start
    as the discriminator's with both Δ exactly 0, under ES the one embedding layer is the
    discriminator's; under NES nothing is shared."""
    ctx = single_process_group
    cfg = tiny_config(POST, sharing, False, tok.vocab_size)
    src = _foreign_electra(tmp_path, tok, cfg, with_generator=False)
    model = build_model(cfg, single_process_group, tok, seed=4)
    fresh = canonical_state(model, ctx)
    _load(model, cfg, ctx, tok, src)
    got = canonical_state(model, ctx)
    for k in fresh:
        if k.startswith(("generator.block.", "mlm_head.")) or (
                sharing is Sharing.NES and k.startswith("generator.embeddings.position")):
            assert torch.equal(got[k], fresh[k]), k  # the generator keeps its initial weights
        elif k.startswith(("discriminator.block.", "rtd_head.")):
            assert not torch.equal(got[k], fresh[k]), k
    hf = {k.split(":", 1)[1]: v for k, v in _tensors(src).items()}  # one file: no generator/
    theirs_position = hf["electra.embeddings.position_embeddings.weight"]
    if sharing is Sharing.GDES:  # P_G starts as P_D, P_Δ = 0
        assert torch.equal(got["generator.embeddings.position.weight"], theirs_position)
        assert torch.count_nonzero(got["discriminator.embeddings.position.delta"]) == 0
    if sharing is Sharing.ES:  # the one embedding layer is the discriminator's
        assert not any(k.startswith(("discriminator.embeddings.position",
                                     "discriminator.embeddings.norm",
                                     "discriminator.embeddings.token_type")) for k in got)
        assert torch.equal(got["generator.embeddings.position.weight"], theirs_position)
        assert torch.equal(got["generator.embeddings.norm.weight"],
                           hf["electra.embeddings.LayerNorm.weight"])
    ids = real_batch(tok)
    mine = ours(model, ids, tok.pad_id)
    theirs = hf_outputs(src, POST, ids, tok.pad_id, with_generator=False)
    assert (mine[0] - theirs[0]).abs().max() < 1e-4 and (mine[1] - theirs[1]).abs().max() < 1e-4
    if sharing is Sharing.GDES:  # the generator's table starts as the discriminator's, E_Δ = 0
        assert torch.count_nonzero(got["discriminator.embeddings.table.delta"]) == 0
    elif sharing is Sharing.NES:
        assert torch.equal(got["generator.embeddings.table.weight"],
                           fresh["generator.embeddings.table.weight"])


def test_export_pt_file_loads(single_process_group, tok, tmp_path):
    ctx = single_process_group
    cfg = tiny_config(PRE, Sharing.GDES, False, tok.vocab_size)
    first = build_model(cfg, single_process_group, tok, seed=3)
    perturb(first)
    state = canonical_state(first, ctx)
    torch.save({"config": cfg.to_dict(), "model": state}, tmp_path / "w.pt")
    second = build_model(cfg, single_process_group, tok, seed=8)
    _load(second, cfg, ctx, tok, tmp_path / "w.pt")
    got = canonical_state(second, ctx)
    assert sorted(got) == sorted(state)
    assert all(torch.equal(got[k], state[k]) for k in state)


def _message(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_mismatches_are_one_line_naming_tensor_and_flag(single_process_group, tok, tmp_path):
    ctx = single_process_group
    cfg = tiny_config(POST, Sharing.ES, False, tok.vocab_size)
    small = build_model(cfg, single_process_group, tok)
    _export(small, cfg, ctx, tok, tmp_path / "hf")
    torch.save({"config": cfg.to_dict(), "model": canonical_state(small, ctx)}, tmp_path / "w.pt")

    wide = dataclasses.replace(cfg.model.discriminator, ffn_hidden_size=96)
    big = tiny_config(POST, Sharing.ES, False, tok.vocab_size)
    big.model.discriminator = wide
    model = build_model(big, single_process_group, tok)
    with pytest.raises(UserInputError) as e:
        _load(model, big, ctx, tok, tmp_path / "hf")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'hf'}: the discriminator's "
                           "intermediate_size is 64 there but 96 in this model; pass --set "
                           "model.discriminator.ffn_hidden_size=64 (or the preset it was "
                           "trained with)")
    with pytest.raises(UserInputError) as e:
        _load(model, big, ctx, tok, tmp_path / "w.pt")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'w.pt'}: "
                           "discriminator.block.layers.0.mlp.linear_fc1.weight has shape (64, 32) "
                           "there but (96, 32) in this model; pass --set "
                           "model.discriminator.ffn_hidden_size=64")

    pre = tiny_config(PRE, Sharing.ES, False, tok.vocab_size)
    with pytest.raises(UserInputError) as e:
        _load(build_model(pre, single_process_group, tok), pre, ctx, tok, tmp_path / "hf")
    assert _message(e).endswith("a electra checkpoint has the post-LayerNorm layout; pass "
                                "--layernorm-position post")


def test_es_refuses_two_different_tables(single_process_group, tok, tmp_path):
    cfg = tiny_config(POST, Sharing.NES, False, tok.vocab_size)
    src = _foreign_electra(tmp_path, tok, cfg)
    es = tiny_config(POST, Sharing.ES, False, tok.vocab_size)
    with pytest.raises(UserInputError, match="tables differ, which one shared table "
                                             r"\(--sharing es\) cannot hold"):
        _load(build_model(es, single_process_group, tok), es, single_process_group, tok, src)


def test_es_refuses_two_different_position_tables_unless_scope_tokens(single_process_group,
                                                                        tok, tmp_path):
    """An ELECTRA pair with one word table but two position tables: ES with the default scope
    (one embedding layer) refuses it in one line naming the tensor and --sharing-scope tokens;
    with --sharing-scope tokens it loads, each model keeping its own positions."""
    import transformers

    cfg = tiny_config(POST, Sharing.ES, False, tok.vocab_size)
    torch.manual_seed(0)
    disc = transformers.ElectraForPreTraining(
        convert.hf_config(cfg.model, "discriminator", pad_id=tok.pad_id))
    gen = transformers.ElectraForMaskedLM(
        convert.hf_config(cfg.model, "generator", pad_id=tok.pad_id))
    with torch.no_grad():
        gen.electra.embeddings.word_embeddings.weight.copy_(
            disc.electra.embeddings.word_embeddings.weight)
    disc.save_pretrained(tmp_path / "hf")
    gen.save_pretrained(tmp_path / "hf" / "generator")
    with pytest.raises(UserInputError) as e:
        _load(build_model(cfg, single_process_group, tok), cfg, single_process_group, tok, tmp_path / "hf")
    assert _message(e) == (
        f"--pretrained-checkpoint {tmp_path / 'hf'}: the discriminator's and the generator's "
        "embeddings.position.weight differ, which one shared embedding layer (--sharing es) "
        "cannot hold; pass --sharing-scope tokens (only the token table shared), --sharing nes "
        "or --sharing gdes")
    cfg.model.sharing_scope = "tokens"
    cfg.validate()
    model = build_model(cfg, single_process_group, tok)
    _load(model, cfg, single_process_group, tok, tmp_path / "hf")
    assert torch.equal(model.discriminator.embeddings.position.weight,
                       disc.electra.embeddings.position_embeddings.weight)
    assert torch.equal(model.generator.embeddings.position.weight,
                       gen.electra.embeddings.position_embeddings.weight)


def test_export_pt_file_of_the_other_scope_is_refused(single_process_group, tok, tmp_path):
    """An --export .pt file saved under --sharing-scope tokens loads under that scope and is
    refused, naming the flag, under the default."""
    ctx = single_process_group
    cfg = tiny_config(POST, Sharing.GDES, False, tok.vocab_size)
    cfg.model.sharing_scope = "tokens"
    cfg.validate()
    first = build_model(cfg, single_process_group, tok)
    torch.save({"config": cfg.to_dict(), "model": canonical_state(first, ctx)}, tmp_path / "w.pt")
    _load(build_model(cfg, single_process_group, tok), cfg, ctx, tok, tmp_path / "w.pt")
    new = tiny_config(POST, Sharing.GDES, False, tok.vocab_size)
    with pytest.raises(UserInputError) as e:
        _load(build_model(new, single_process_group, tok), new, ctx, tok, tmp_path / "w.pt")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'w.pt'}: saved with "
                           "--sharing-scope tokens; pass --sharing-scope tokens (or load its "
                           "Hugging Face export, which converts between sharing scopes)")


def test_load_and_pretrained_checkpoint_together_resolve_to_load():
    """Megatron-LM's rule (a requeued job passes both): --load wins, with a one-line note."""
    from rtd_scale.arguments import build_parser, config_from_args
    from rtd_scale.run import pretrained_weights

    args = build_parser().parse_args([
        "--ds_config", "ds_configs/zero0.json", "--data-path", "x", "--tokenizer-model", "t",
        "--load", "runs/a", "--pretrained-checkpoint", "hf/a"])
    cfg = config_from_args(args)
    assert (cfg.train.load, cfg.train.pretrained_checkpoint) == ("runs/a", "hf/a")
    assert pretrained_weights(cfg) == (None, "note: --load runs/a resumes a run, so "
                                       "--pretrained-checkpoint hf/a is not read (it only starts "
                                       "a run)")
    cfg.train.load = None
    assert pretrained_weights(cfg) == ("hf/a", None)


def test_transformer_engine_norm_names_map_to_the_same_export(single_process_group, tok):
    """On GPU with TransformerEngine the pre-layout norms live inside linear_qkv / linear_fc1
    (``layer_norm_weight``); the export is the same tensors under the same names."""
    cfg = tiny_config(PRE, Sharing.GDES, False, tok.vocab_size)
    model = build_model(cfg, single_process_group, tok)
    perturb(model)
    plain = canonical_state(model, single_process_group)
    te = {}
    for k, v in plain.items():
        for fused, unfused in convert.TE_NAMES.items():
            if k.endswith("." + unfused) and ".layers." in k:
                k = k[: -len(unfused)] + fused
        te[k] = v
    assert sum(k.endswith("layer_norm_weight") for k in te) == 2 * (2 + 1)  # 2 norms × 3 layers
    a, _ = convert.to_hf(plain, cfg.model, pad_id=tok.pad_id)
    b, _ = convert.to_hf(te, cfg.model, pad_id=tok.pad_id)
    assert sorted(a.state) == sorted(b.state)
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def test_released_electra_layout_loads_with_notes(single_process_group, tok, tmp_path):
    """A released ELECTRA has two token types and LayerNorm eps 1e-12: row 0 is kept (the type
    every pretraining sequence uses), and both differences are said in one note each."""
    import transformers

    cfg = tiny_config(POST, Sharing.ES, False, tok.vocab_size)
    hf_cfg = convert.hf_config(cfg.model, "discriminator", pad_id=tok.pad_id)
    hf_cfg.type_vocab_size, hf_cfg.layer_norm_eps = 2, 1e-12
    torch.manual_seed(0)
    transformers.ElectraForPreTraining(hf_cfg).save_pretrained(tmp_path / "hf")
    model = build_model(cfg, single_process_group, tok)
    lines = []
    load_pretrained(model, str(tmp_path / "hf"), cfg.model, pad_id=tok.pad_id,
                    tp_group=single_process_group.tp_group, tp_rank=0, print_fn=lines.append)
    src = transformers.ElectraForPreTraining.from_pretrained(tmp_path / "hf")
    assert torch.equal(model.discriminator.embeddings.token_type.weight[0],
                       src.electra.embeddings.token_type_embeddings.weight[0])
    assert lines[0] == f"loaded weights from --pretrained-checkpoint {tmp_path / 'hf'} " \
                       "(optimizer and schedule start fresh)"
    assert ("note: the discriminator's layer_norm_eps is 1e-12 there, 1e-07 here (--set "
            "model.discriminator.layernorm_epsilon=1e-12 to keep it)") in lines
    assert ("note: the discriminator's token-type rows 1…1 are dropped (rtd_scale's encoders "
            "have one token type)") in lines
    assert "note: no generator/ beside the discriminator: the generator starts fresh" in lines


def test_foreign_roberta_preln_folds_its_token_type_and_leaves_its_pooler(
        single_process_group, tok, tmp_path):
    """A RobertaPreLayerNormModel saved with its pooler and a non-zero token-type row: the
    pooler is left aside, the row is folded into every position (one note), and positions are
    read from row pad_id + 1 on (RoBERTa's offset)."""
    import transformers

    cfg = tiny_config(PRE, Sharing.NES, False, tok.vocab_size)
    torch.manual_seed(0)
    src = transformers.RobertaPreLayerNormModel(
        convert.hf_config(cfg.model, "discriminator", pad_id=tok.pad_id))
    for p in src.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    assert src.pooler is not None
    src.save_pretrained(tmp_path / "hf")
    model = build_model(cfg, single_process_group, tok)
    lines = []
    load_pretrained(model, str(tmp_path / "hf"), cfg.model, pad_id=tok.pad_id,
                    tp_group=single_process_group.tp_group, tp_rank=0, print_fn=lines.append)
    want = (src.embeddings.position_embeddings.weight[tok.pad_id + 1:]
            + src.embeddings.token_type_embeddings.weight[0])
    assert torch.equal(model.discriminator.embeddings.position.weight, want)
    assert ("note: the discriminator's token-type row 0 is folded into its position table"
            in lines)
