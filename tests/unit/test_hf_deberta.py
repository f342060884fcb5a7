"""DeBERTaV3 (``--attention-type disentangled``) ⇄ Hugging Face ``DebertaV2``, on one process.

- Export parity, every sharing mode: a tiny disentangled RTDModel with every weight perturbed is
  exported; ``DebertaV2Model`` (discriminator), ``DebertaV2ForMaskedLM`` (generator) and
  ``DebertaV2ForTokenClassification`` load it with zero missing / unexpected / mismatched keys
  (the token classifier: only its fresh ``classifier.*``), and in fp32 on a padded batch of real
  text the hidden states, RTD logits (``rtd_head.safetensors``) and MLM logits equal ours within
  1e-4 at every non-pad position. ``position_buckets`` 8 with sequences up to 40 makes most
  relative distances go through DeBERTa's log buckets (with the released 256 they would all be
  exact below 128); 4 heads cover the fused-QKV head order.
- HF → rtd_scale → HF: a DebertaV2 pair drawn and saved by transformers itself comes back
  tensor for tensor (NES; GDES through E_Δ), and computes what transformers computes.
- export → import → export is bitwise; one-line refusals for the wrong attention type or
  relative-position settings.

Pad positions are not compared: Hugging Face zeroes the embedding output at pads and lets a pad
query attend to every key (its 2-D mask masks whole pad rows), ours computes pad rows like
any other with pad keys masked; no loss reads a pad position.
"""
from __future__ import annotations

import pytest
import torch

from rtd_scale.cli_errors import UserInputError
from rtd_scale.config import Sharing
from rtd_scale.hf import convert, debertav2
from rtd_scale.hf.export import write_export
from rtd_scale.hf.pretrained import load_pretrained
from tests.helpers.hf_deberta import _assert_bitwise, _diffs, _tensors, hf_outputs, round_trip
from tests.helpers.hf_models import (
    DISENTANGLED,
    POST,
    TOL,
    build_model,
    canonical_state,
    load_checked,
    ours,
    perturb,
    real_batch,
    tiny_config,
)

BUCKETS, SPAN = 8, 64  # position_buckets, max_relative_positions (= max positions)


def deberta_config(sharing: Sharing, vocab_size: int, projected: bool = False):
    """``tiny_config``'s post layout (4 heads of 8; discriminator 2 layers of 32, generator 1;
    E = H = 32, or ``projected``: E 24, generator 16 wide) with disentangled attention over 8
    log buckets."""
    cfg = tiny_config(POST, sharing, projected, vocab_size)
    cfg.model.attention_type = DISENTANGLED
    cfg.model.position_buckets = BUCKETS
    cfg.model.max_relative_positions = SPAN
    cfg.validate()
    return cfg


@pytest.fixture(scope="module")
def tok(wiki_shards):
    from rtd_scale.data.tokenizer import Tokenizer

    return Tokenizer(wiki_shards[0])


def _export(model, cfg, ctx, tok, path, tokenizer_model=None):
    write_export(canonical_state(model, ctx), cfg.model, str(path), pad_id=tok.pad_id,
                 cls_id=tok.cls_id, sep_id=tok.sep_id, tokenizer_model=tokenizer_model,
                 note=lambda m: None)


def _load(model, cfg, ctx, tok, path, lines=None):
    load_pretrained(model, str(path), cfg.model, pad_id=tok.pad_id, tp_group=ctx.tp_group,
                    tp_rank=0, print_fn=None if lines is None else lines.append)


CASES = [(s, False) for s in Sharing] + [(Sharing.GDES, True)]


@pytest.mark.parametrize("sharing,projected", CASES,
                         ids=[f"{s.value}-{'E!=H' if p else 'E=H'}" for s, p in CASES])
def test_export_parity_with_transformers(single_process_group, tok, wiki_shards, tmp_path,
                                         sharing, projected):
    import json

    import transformers

    cfg = deberta_config(sharing, tok.vocab_size, projected)
    model = build_model(cfg, single_process_group, tok)
    perturb(model)
    ids = real_batch(tok)
    keep = ids != tok.pad_id
    assert not bool(keep.all())  # a padded batch
    mine = ours(model, ids, tok.pad_id)
    out = tmp_path / "export"
    _export(model, cfg, single_process_group, tok, out, tokenizer_model=wiki_shards[0])

    config = json.loads((out / "config.json").read_text())
    want = dict(model_type="deberta-v2", architectures=[debertav2.ADAPTER.discriminator_class],
                relative_attention=True, position_buckets=BUCKETS, max_relative_positions=SPAN,
                pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
                position_biased_input=False, type_vocab_size=0, hidden_act="gelu",
                layer_norm_eps=cfg.model.discriminator.layernorm_epsilon,
                vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                pad_token_id=tok.pad_id)
    assert {k: config.get(k) for k in want} == want
    g_config = json.loads((out / convert.GENERATOR_DIR / "config.json").read_text())
    assert (g_config["architectures"], g_config["num_hidden_layers"], g_config["legacy"],
            g_config["hidden_size"], g_config["embedding_size"]) == (
        [debertav2.ADAPTER.generator_class], 1, True, 16 if projected else 32,
        24 if projected else 32)

    theirs = hf_outputs(out, ids, tok.pad_id)
    diffs = _diffs(mine, theirs, keep)
    from safetensors.torch import load_file

    d_keys = len(load_file(out / "model.safetensors"))
    g_keys = len(load_file(out / convert.GENERATOR_DIR / "model.safetensors"))
    print(f"parity deberta {sharing.value} projected={projected}: " +
          " ".join(f"{n} {d:.2e}" for n, d in zip(("disc_hidden", "rtd", "gen_hidden", "mlm"),
                                                  diffs)) +
          f" | keys: discriminator {d_keys}, generator {g_keys}, missing 0, unexpected 0")
    assert max(diffs) < TOL, diffs
    assert mine[1][keep].abs().max() > 0.1 and mine[3][keep].abs().max() > 0.1
    # table + embedding LayerNorm (3) (+ embed_proj), relative table + its LayerNorm (3), 16
    # per layer; the generator's legacy MLM head adds 5 (its tied decoder is not stored)
    assert d_keys == 3 + projected + 3 + 16 * 2
    assert g_keys == 3 + projected + 3 + 16 * 1 + 5

    if sharing is not Sharing.GDES or projected:
        return
    # what users fine-tune for token tasks: everything but the fresh classifier is read
    clf, info = transformers.DebertaV2ForTokenClassification.from_pretrained(
        out, num_labels=2, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["classifier.bias", "classifier.weight"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        hidden = clf.eval().deberta(ids, attention_mask=keep.long()).last_hidden_state
    assert (hidden[keep] - mine[0][keep]).abs().max() < TOL


def _foreign_deberta(tmp_path, tok, cfg, *, legacy=True, table="own"):
    """A DebertaV2Model (+ DebertaV2ForMaskedLM in generator/) drawn by transformers itself, every
    weight moved off its initial value, saved by save_pretrained. ``table``: the discriminator's
    token table is its "own", the generator's ("same"), or the generator's plus an fp32 residual
    ("residual", what any GDES model holds)."""
    import transformers

    torch.manual_seed(0)
    disc = transformers.DebertaV2Model(
        convert.hf_config(cfg.model, "discriminator", pad_id=tok.pad_id))
    g_cfg = convert.hf_config(cfg.model, "generator", pad_id=tok.pad_id)
    g_cfg.legacy = legacy
    gen = transformers.DebertaV2ForMaskedLM(g_cfg)
    for p in [*disc.parameters(), *gen.parameters()]:
        p.data.add_(torch.randn_like(p) * 0.05)
    g_table = gen.deberta.embeddings.word_embeddings.weight.data
    if table != "own":
        residual = torch.randn_like(g_table) * 0.01 if table == "residual" else 0.0
        disc.embeddings.word_embeddings.weight.data.copy_(g_table + residual)
    disc.save_pretrained(tmp_path / "hf")
    gen.save_pretrained(tmp_path / "hf" / convert.GENERATOR_DIR)
    return tmp_path / "hf"


@pytest.mark.parametrize("sharing", [Sharing.NES, Sharing.GDES], ids=["nes", "gdes"])
def test_transformers_checkpoint_round_trips_bitwise(single_process_group, tok, tmp_path,
                                                     sharing):
    """HF → rtd_scale → HF: the two model.safetensors come back tensor for tensor (GDES: the
    discriminator's table through E_Δ = D − G, exact), and our model computes what transformers
    computes from them."""
    ctx = single_process_group
    cfg = deberta_config(sharing, tok.vocab_size)
    src = _foreign_deberta(tmp_path, tok, cfg,
                           table="own" if sharing is Sharing.NES else "residual")
    model = build_model(cfg, single_process_group, tok, seed=5)
    lines = []
    _load(model, cfg, ctx, tok, src, lines)
    assert "note: no RTD head found (discriminator_predictions.*): it starts fresh" in lines
    _export(model, cfg, ctx, tok, tmp_path / "back")
    _assert_bitwise(_tensors(src, "model.safetensors"),
                    _tensors(tmp_path / "back", "model.safetensors"))
    ids = real_batch(tok)
    keep = ids != tok.pad_id
    from safetensors.torch import load_file

    head = load_file(tmp_path / "back" / convert.RTD_HEAD_FILE)  # our fresh head, in both
    diffs = _diffs(ours(model, ids, tok.pad_id), hf_outputs(src, ids, tok.pad_id, head), keep)
    print(f"HF->rtd_scale {sharing.value}: " + " ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) < TOL, diffs


def test_export_import_export_is_bitwise(single_process_group, tok, tmp_path):
    cfg = deberta_config(Sharing.GDES, tok.vocab_size)
    first, second = round_trip(cfg, single_process_group, tok, tmp_path)
    ids = real_batch(tok)
    for x, y in zip(ours(first, ids, tok.pad_id), ours(second, ids, tok.pad_id)):
        assert torch.equal(x, y)


def test_legacy_false_generator_gives_the_same_logits(single_process_group, tok, tmp_path):
    """A generator with DeBERTa's own MLM head names (``legacy=False``: ``lm_predictions``)
    gives the MLM logits transformers gives."""
    ctx = single_process_group
    cfg = deberta_config(Sharing.ES, tok.vocab_size)
    src = _foreign_deberta(tmp_path, tok, cfg, legacy=False, table="same")
    model = build_model(cfg, single_process_group, tok)
    _load(model, cfg, ctx, tok, src)
    ids = real_batch(tok)
    keep = ids != tok.pad_id
    gen = load_checked(debertav2.ADAPTER.generator_class, src / convert.GENERATOR_DIR)
    with torch.no_grad():
        logits = gen(ids, attention_mask=keep.long()).logits
    assert (ours(model, ids, tok.pad_id)[3][keep] - logits[keep]).abs().max() < TOL


def test_released_deberta_v3_layout_loads(single_process_group, tok, tmp_path):
    """The layout of microsoft/deberta-v3-*: one DebertaV2ForMaskedLM-style file with DeBERTa's
    ``lm_predictions`` and ``mask_predictions`` heads beside the encoder and a token table
    padded past the tokenizer (128,100 rows for 128,001 ids there). It loads as the
    discriminator: heads left aside, padding rows dropped, a note for each, the generator
    fresh; hidden states equal transformers' at every real token."""
    import transformers
    from safetensors.torch import load_file, save_file

    ctx = single_process_group
    cfg = deberta_config(Sharing.GDES, tok.vocab_size)
    hf_cfg = convert.hf_config(cfg.model, "discriminator", pad_id=tok.pad_id)
    hf_cfg.vocab_size, hf_cfg.legacy = tok.vocab_size + 7, False
    hf_cfg.max_relative_positions = -1  # the released configs: -1 = max_position_embeddings
    torch.manual_seed(1)
    mlm = transformers.DebertaV2ForMaskedLM(hf_cfg)
    for p in mlm.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    mlm.save_pretrained(tmp_path / "v3")
    tensors = load_file(tmp_path / "v3" / "model.safetensors")
    h = hf_cfg.hidden_size
    tensors.update({"mask_predictions.dense.weight": torch.randn(h, h),
                    "mask_predictions.dense.bias": torch.randn(h),
                    "mask_predictions.LayerNorm.weight": torch.randn(h),
                    "mask_predictions.LayerNorm.bias": torch.randn(h),
                    "mask_predictions.classifier.weight": torch.randn(1, h),
                    "mask_predictions.classifier.bias": torch.randn(1)})
    save_file(tensors, tmp_path / "v3" / "model.safetensors", metadata={"format": "pt"})
    model = build_model(cfg, single_process_group, tok, seed=6)
    lines = []
    _load(model, cfg, ctx, tok, tmp_path / "v3", lines)
    assert (f"note: the discriminator's token table has {tok.vocab_size + 7} rows there, the "
            f"tokenizer {tok.vocab_size} ids: rows {tok.vocab_size}…{tok.vocab_size + 6} "
            "(padding) are dropped") in lines
    assert "note: no generator/ beside the discriminator: the generator starts fresh" in lines
    ids = real_batch(tok)
    keep = ids != tok.pad_id
    with torch.no_grad():
        hidden = mlm.eval().deberta(ids, attention_mask=keep.long()).last_hidden_state
    assert (ours(model, ids, tok.pad_id)[0][keep] - hidden[keep]).abs().max() < TOL


def _message(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_mismatched_checkpoints_are_one_line(single_process_group, tok, tmp_path):
    ctx = single_process_group
    cfg = deberta_config(Sharing.GDES, tok.vocab_size)
    model = build_model(cfg, single_process_group, tok)
    _export(model, cfg, ctx, tok, tmp_path / "deb")
    bert = tiny_config(POST, Sharing.GDES, False, tok.vocab_size)
    with pytest.raises(UserInputError) as e:
        _load(build_model(bert, single_process_group, tok), bert, ctx, tok, tmp_path / "deb")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'deb'}: a deberta-v2 checkpoint "
                           "has disentangled attention; pass --attention-type disentangled")
    _export(build_model(bert, single_process_group, tok), bert, ctx, tok, tmp_path / "electra")
    with pytest.raises(UserInputError) as e:
        _load(model, cfg, ctx, tok, tmp_path / "electra")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'electra'}: a electra "
                           "checkpoint has BERT-style attention; pass --attention-type bert")
    wide = deberta_config(Sharing.GDES, tok.vocab_size)
    wide.model.position_buckets = 16
    with pytest.raises(UserInputError) as e:
        _load(build_model(wide, single_process_group, tok), wide, ctx, tok, tmp_path / "deb")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'deb'}: the discriminator's "
                           "position_buckets is 8 there but 16 in this model; pass --set "
                           "model.position_buckets=8")
    torch.save({"config": bert.to_dict(), "model": canonical_state(build_model(bert, single_process_group, tok), ctx)},
               tmp_path / "w.pt")
    with pytest.raises(UserInputError) as e:
        _load(model, cfg, ctx, tok, tmp_path / "w.pt")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'w.pt'}: saved with "
                           "--attention-type bert; pass --attention-type bert")


def test_absolute_position_deberta_is_refused(single_process_group, tok, tmp_path):
    """DeBERTa v1-style configs (absolute positions in the input) are not DeBERTaV3."""
    import transformers

    cfg = deberta_config(Sharing.GDES, tok.vocab_size)
    hf_cfg = convert.hf_config(cfg.model, "discriminator", pad_id=tok.pad_id)
    hf_cfg.position_biased_input = True
    transformers.DebertaV2Model(hf_cfg).save_pretrained(tmp_path / "v1")
    with pytest.raises(UserInputError) as e:
        _load(build_model(cfg, single_process_group, tok), cfg, single_process_group, tok, tmp_path / "v1")
    assert _message(e) == (f"--pretrained-checkpoint {tmp_path / 'v1'}: the discriminator's "
                           "position_biased_input is True there; rtd_scale's disentangled "
                           "attention is DeBERTaV3's (position_biased_input=False): pass a "
                           "DeBERTaV3 checkpoint")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_export_parity_on_gpu(single_process_group, tok, tmp_path):
    """On a GPU our attention core takes its other path (c2p + p2c as one float bias into
    PyTorch's scaled_dot_product_attention): in fp32 (TF32 off) the exported model still gives
    transformers' outputs at every real token, both on the GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = deberta_config(Sharing.GDES, tok.vocab_size)
    model = build_model(cfg, single_process_group, tok)
    perturb(model)
    _export(model, cfg, single_process_group, tok, tmp_path / "export")
    model = model.cuda()
    ids = real_batch(tok).cuda()
    keep = ids != tok.pad_id
    diffs = _diffs(ours(model, ids, tok.pad_id), hf_outputs(tmp_path / "export", ids,
                                                            tok.pad_id), keep)
    print("parity deberta on GPU: " + " ".join(f"{d:.2e}" for d in diffs))
    assert max(diffs) < TOL, diffs
