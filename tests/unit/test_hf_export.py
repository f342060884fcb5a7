"""Export to Hugging Face transformers with exact parity, on one process (TP = PP = 1).

For each layout × sharing mode × (E = H, E ≠ H): perturb every weight of a tiny RTDModel, export
it, load the two directories with ``from_pretrained(..., output_loading_info=True)`` (zero missing,
unexpected or mismatched keys) and compare, in fp32 on a padded batch of real text, the
discriminator's hidden states and RTD logits and the generator's hidden states and MLM logits
with ours (1e-4 absolute). The fused-QKV head order is covered by using 4 heads.
"""
from __future__ import annotations

import json

import pytest
import torch

from rtd_scale.config import MLPActivation, Sharing
from rtd_scale.hf import convert
from rtd_scale.hf.export import write_export
from rtd_scale.model.sharing import exact_residual
from tests.helpers.env import TEST_DATA
from tests.helpers.hf_models import (  # noqa: F401
    DISENTANGLED,
    POST,
    PRE,
    ROTARY,
    TOL,
    build_model,
    canonical_state,
    hf_outputs,
    layout_config,
    load_checked,
    max_diffs,
    modern_config,
    ours,
    perturb,
    real_batch,
    tiny_config,
)

CASES = [(POST, s, proj) for s in Sharing for proj in (False, True)] + \
        [(PRE, s, False) for s in Sharing]
# the same exports with --sharing-scope tokens (each model its own positions, LayerNorm)
TOKEN_SCOPE_CASES = [(POST, Sharing.ES, True), (PRE, Sharing.GDES, False)]


@pytest.fixture(scope="module")
def tok(wiki_shards):
    from rtd_scale.data.tokenizer import Tokenizer

    return Tokenizer(wiki_shards[0])


def _export_perturbed(cfg, ctx, tok, wiki_shards, tmp_path):
    """(ids, our outputs on them, the export directory) of ``cfg``'s model, every weight
    perturbed, exported with the tokenizer: ``real_batch``, ``ours``."""
    model = build_model(cfg, ctx, tok)
    perturb(model)
    ids = real_batch(tok)
    out = tmp_path / "export"
    write_export(canonical_state(model, ctx), cfg.model, str(out), pad_id=tok.pad_id,
                 cls_id=tok.cls_id, sep_id=tok.sep_id, tokenizer_model=wiki_shards[0],
                 note=lambda m: None)
    return ids, ours(model, ids, tok.pad_id), out


@pytest.mark.parametrize(
    "layout,sharing,projected,scope",
    [c + ("embeddings",) for c in CASES] + [c + ("tokens",) for c in TOKEN_SCOPE_CASES],
    ids=[f"{l.value}-{s.value}-{'E!=H' if p else 'E=H'}" for l, s, p in CASES]
    + [f"{l.value}-{s.value}-{'E!=H' if p else 'E=H'}-tokens" for l, s, p in TOKEN_SCOPE_CASES])
def test_export_parity(single_process_group, tok, wiki_shards, tmp_path, layout, sharing,
                       projected, scope):
    """Every weight perturbed (E_Δ and P_Δ included), exported, loaded by transformers: the same
    outputs. Under the default scope the discriminator's export holds the tensors its forward
    reads (ES: the generator's embedding layer; GDES: P_G + P_Δ)."""
    cfg = tiny_config(layout, sharing, projected, tok.vocab_size)
    cfg.model.sharing_scope = scope
    cfg.validate()
    ids, mine, out = _export_perturbed(cfg, single_process_group, tok, wiki_shards, tmp_path)
    theirs = hf_outputs(out, layout, ids, tok.pad_id)
    diffs = max_diffs(mine, theirs)
    print(f"parity {layout.value} {sharing.value} projected={projected} scope={scope}: " +
          " ".join(f"{n} {d:.2e}" for n, d in zip(("disc_hidden", "rtd", "gen_hidden", "mlm"),
                                                  diffs)))
    assert max(diffs) < TOL, diffs
    assert mine[1].abs().max() > 0.1  # not a trivially zero comparison
    if layout == PRE:  # without position_ids: equal at every non-pad position
        theirs = hf_outputs(out, layout, ids, tok.pad_id, with_positions=False)
        assert max(max_diffs(mine, theirs, mask=ids != tok.pad_id)) < TOL


MODERN_CASES = [(False, MLPActivation.GEGLU), (True, MLPActivation.SWIGLU)]


@pytest.mark.parametrize("biases,activation", MODERN_CASES,
                         ids=["modernbert", "biases-swiglu"])
def test_modern_block_export_parity(single_process_group, tok, wiki_shards, tmp_path, biases,
                                    activation):
    """The modern block → ModernBertModel (+ rtd_head.safetensors) / ModernBertForMaskedLM,
    loaded by transformers with no missing or unexpected key: every output within 1e-5 of
    ours at every real token of a padded batch (rows of 40 … 19 tokens, a 16-token window:
    both encoders' local layers mask keys by distance and by padding). At pads the two differ
    (a pad query whose window holds no real key; no loss reads it). ModernBERT's settings (no
    bias anywhere: the MLM head's LayerNorm bias folded into the decoder's) and a block with
    biases and SwiGLU."""
    cfg = modern_config(tok.vocab_size, biases=biases, activation=activation)
    ids, mine, out = _export_perturbed(cfg, single_process_group, tok, wiki_shards, tmp_path)
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["hidden_activation"], config["local_attention"],
            config["norm_bias"], config["attention_bias"], config["mlp_bias"]) == (
        "modernbert", "gelu" if activation is MLPActivation.GEGLU else "silu", 16, biases,
        biases, biases)
    # transformers 5.x's fields and 4.x's, the same pattern and bases
    assert config["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert (config["global_attn_every_n_layers"], config["global_rope_theta"],
            config["local_rope_theta"]) == (2, 40_000.0, 2_000.0)
    assert {k: v["rope_theta"] for k, v in config["rope_parameters"].items()} == {
        "full_attention": 40_000.0, "sliding_attention": 2_000.0}
    theirs = hf_outputs(out, ROTARY, ids, tok.pad_id)
    real = ids != tok.pad_id
    assert not real.all()
    diffs = max_diffs(mine, theirs, mask=real)
    print(f"parity modern biases={biases} {activation.value}: " +
          " ".join(f"{n} {d:.2e}" for n, d in zip(("disc_hidden", "rtd", "gen_hidden", "mlm"),
                                                  diffs)))
    assert max(diffs) < 1e-5, diffs
    assert mine[1].abs().max() > 0.1  # not a trivially zero comparison


@pytest.mark.parametrize("change,message", [
    ({"normalization": "RMSNorm"}, "ModernBERT has LayerNorm only, but --normalization RMSNorm; "
                                   "train with --normalization LayerNorm"),
    ({"mlp_activation": MLPActivation.GELU},
     "ModernBERT has a gated MLP only (GeGLU, SwiGLU), but model.mlp_activation 'gelu'; train "
     "with --set model.mlp_activation=geglu or --swiglu"),
    ({"embedding_size": 24}, "ModernBERT has no embedding projection, but model.embedding_size "
                             "24 != model.discriminator.hidden_size 32; train with an embedding "
                             "size equal to both hidden sizes")],
    ids=["rmsnorm", "gelu", "E!=H"])
def test_modern_block_export_refuses_what_modernbert_cannot_hold(tok, tmp_path, change, message):
    import dataclasses

    cfg = modern_config(tok.vocab_size)
    model_cfg = dataclasses.replace(cfg.model, **change)
    with pytest.raises(convert.ExportError) as e:
        write_export({}, model_cfg, str(tmp_path / "x"), pad_id=tok.pad_id)
    assert str(e.value) == "cannot export: Hugging Face " + message
    assert not (tmp_path / "x").exists()


def test_pre_layout_with_projection_is_refused(single_process_group, tok, tmp_path):
    cfg = tiny_config(PRE, Sharing.GDES, True, tok.vocab_size)
    model = build_model(cfg, single_process_group, tok)
    with pytest.raises(convert.ExportError, match="model.embedding_size 24 != "
                                                  "model.discriminator.hidden_size 32"):
        write_export(canonical_state(model, single_process_group), cfg.model,
                     str(tmp_path / "x"), pad_id=tok.pad_id)
    assert not (tmp_path / "x").exists()


def test_qkv_split_is_per_head():
    """megatron's fused rows: head 0's q, k, v, then head 1's …"""
    heads, d, h = 2, 3, 6
    fused = torch.arange(3 * h * h, dtype=torch.float32).reshape(3 * h, h)
    q, k, v = convert.split_qkv(fused, heads)
    assert torch.equal(q[:d], fused[0:d]) and torch.equal(k[:d], fused[d:2 * d])
    assert torch.equal(v[:d], fused[2 * d:3 * d]) and torch.equal(q[d:], fused[3 * d:4 * d])
    assert torch.equal(convert.fuse_qkv(q, k, v, heads), fused)


def test_gdes_residual_round_trips_bitwise():
    """A discriminator table that is some fp32 E_G + E_Δ (any GDES export) gives back an E_Δ
    with E_G + E_Δ equal to it bitwise, at scales 1e-6 … 1e2 of either."""
    g = torch.Generator().manual_seed(0)
    gen = torch.randn(500, 64, generator=g) * torch.logspace(-6, 2, 64)
    disc = gen + torch.randn(500, 64, generator=g) * torch.logspace(2, -6, 64)
    delta = exact_residual(disc, gen)
    assert torch.equal(gen + delta, disc)


@pytest.mark.parametrize("layout", [POST, PRE])
def test_sequence_classification_fine_tunes(single_process_group, tok, wiki_shards, tmp_path,
                                            layout):
    """The export is what users fine-tune: AutoTokenizer + AutoModelForSequenceClassification
    from the directory alone, a few AdamW steps on a tiny labelled set, and the loss falls."""
    import transformers

    cfg = tiny_config(layout, Sharing.GDES, layout == POST, tok.vocab_size)
    model = build_model(cfg, single_process_group, tok)
    out = tmp_path / "export"
    write_export(canonical_state(model, single_process_group), cfg.model, str(out),
                 pad_id=tok.pad_id, cls_id=tok.cls_id, sep_id=tok.sep_id,
                 tokenizer_model=wiki_shards[0], note=lambda m: None)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    with open(TEST_DATA / "wiki_sample.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"][:200] for _, line in zip(range(8), f)]
    assert hf_tok(texts[0])["input_ids"] == [tok.cls_id] + tok.encode(texts[0]) + [tok.sep_id]
    batch = hf_tok(texts, padding=True, truncation=True, max_length=48, return_tensors="pt")
    labels = torch.tensor([0, 1] * 4)
    torch.manual_seed(0)
    clf = transformers.AutoModelForSequenceClassification.from_pretrained(out, num_labels=2)
    assert type(clf).__name__ == ("ElectraForSequenceClassification" if layout == POST
                                  else "RobertaPreLayerNormForSequenceClassification")
    opt = torch.optim.AdamW(clf.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = clf(**batch, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_export_tool_errors_are_one_line(tmp_path, capsys):
    from rtd_scale.cli_errors import run_cli
    from tests.helpers.tools import load_tool

    tool = load_tool("export_hf")
    run = tmp_path / "run"
    assert run_cli(tool.main, ["--load", str(run), "--output", str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == (f"error: --load {run}: no such directory; pass the "
                                       "--save directory of a run\n")
    run.mkdir()
    assert run_cli(tool.main, ["--load", str(run), "--output", str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == (f"error: --load {run}: no checkpoint (no global_step* "
                                       "directory); pass the --save directory of a run that "
                                       "saved one\n")
    (run / "global_step1").mkdir()
    assert run_cli(tool.main, ["--load", str(run), "--tag", "global_step3", "--output",
                               str(tmp_path / "hf")]) == 1
    assert capsys.readouterr().err == (f"error: --tag global_step3: {run} has no such "
                                       "checkpoint; pass one of global_step1\n")
    (run / "global_step1").rmdir()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert run_cli(tool.main, ["--load", str(run), "--output", str(tmp_path / "busy")]) == 1
    assert capsys.readouterr().err == (f"error: --output {tmp_path / 'busy'}: a non-empty "
                                       "directory that is not an export; pass a new directory\n")
    assert not (tmp_path / "hf").exists()


def test_a_training_runs_directory_is_never_an_exports(tmp_path):
    """A run's --save holds a config.json as an export does: an export onto it (--export-hf, or
    tools/export_hf.py with or without --overwrite) would replace its checkpoints, so it is
    refused in one line, from the moment pretrain.py started it (ds_config.json, progress/)."""
    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.hf.export import MANIFEST, check_output_dir

    run = tmp_path / "run"
    (run / "global_step3").mkdir(parents=True)
    (run / "latest").write_text("global_step3")
    (run / "config.json").write_text("{}")
    for overwrite in (None, "--overwrite"):
        with pytest.raises(UserInputError) as e:
            check_output_dir(str(run), "--output", overwrite_flag=overwrite)
        assert str(e.value) == (f"--output {run}: holds a training run (global_step3); an export "
                                "there would replace it: pass a new directory, e.g. hf/run")
    started = tmp_path / "started"  # no checkpoint yet
    (started / "progress").mkdir(parents=True)
    (started / "config.json").write_text("{}")
    with pytest.raises(UserInputError) as e:
        check_output_dir(str(started), "--export-hf")
    assert str(e.value) == (f"--export-hf {started}: holds a training run; an export there "
                            "would replace it: pass a new directory, e.g. hf/started")
    other = tmp_path / "other_hf"  # a transformers directory not written by us
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(UserInputError, match="a non-empty directory that is not an export"):
        check_output_dir(str(other), "--export-hf")
    (other / MANIFEST).write_text("{}")  # ours: replaced at the end of training
    check_output_dir(str(other), "--export-hf")


def _write(ctx, tok, spm_model, layout, out, **kwargs):
    cfg = layout_config(layout, tok.vocab_size)
    model = build_model(cfg, ctx, tok)
    perturb(model)
    write_export(canonical_state(model, ctx), cfg.model, str(out), pad_id=tok.pad_id,
                 cls_id=tok.cls_id, sep_id=tok.sep_id, tokenizer_model=spm_model,
                 note=lambda m: None, **kwargs)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_take_the_umask_and_a_tokenizer_class_both_majors_load(
        single_process_group, tok, wiki_shards, tmp_path, umask):
    """Every file as a plain write leaves it (safetensors writes 0600: other users of a shared
    file system could not read the weights); ``tokenizer_config.json`` names
    PreTrainedTokenizerFast (5.x saves TokenizersBackend, unknown to 4.x; loading under 4.57.3:
    tests/e2e/test_hf_export_transformers4.py); ``spm.model`` for the slow DebertaV2Tokenizer,
    in the DebertaV2 export only: the run's pieces with normalize_text as its own normaliser
    (tests/unit/test_tokenizer_byo.py::test_the_sentencepiece_file_for_deberta_encodes_like_the_pipeline)."""
    import os

    old = os.umask(umask)
    try:
        for layout in (POST, DISENTANGLED):
            _write(single_process_group, tok, wiki_shards[0], layout, tmp_path / layout)
    finally:
        os.umask(old)
    for layout in (POST, DISENTANGLED):
        out = tmp_path / layout
        paths = [out, *out.rglob("*")]
        assert {p.name for p in paths} >= {"model.safetensors", "tokenizer.json", "generator"}
        modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in paths}
        assert modes == {str(p.relative_to(tmp_path)): (0o777 if p.is_dir() else 0o666) & ~umask
                         for p in paths}
        for where in (out, out / convert.GENERATOR_DIR):
            config = json.loads((where / "tokenizer_config.json").read_text(encoding="utf-8"))
            assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
            spm = where / "spm.model"
            if layout == DISENTANGLED:
                assert spm.read_bytes() == tok.sentencepiece_for_transformers()
            else:
                assert not spm.exists()


def test_replacing_an_export_is_refused_or_atomic(single_process_group, tok, wiki_shards,
                                                  tmp_path, monkeypatch):
    """Under ``overwrite_flag`` an earlier export is refused in one line naming the directory
    and the flag; without it the export is replaced only once the new one is complete: a
    failure while writing the generator leaves the old export byte for byte, and no sibling."""
    from rtd_scale.cli_errors import UserInputError
    from rtd_scale.hf import export

    out = tmp_path / "hf"
    _write(single_process_group, tok, wiki_shards[0], POST, out)
    before = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(UserInputError) as e:
        _write(single_process_group, tok, wiki_shards[0], POST, out,
               overwrite_flag="--overwrite")
    assert str(e.value) == (f"--output {out}: already holds an export; pass --overwrite to "
                            "replace it, or a new directory")

    real = export.build_hf_model

    def fail_on_generator(m):
        if m.class_name.endswith("ForMaskedLM"):
            raise OSError("disk full")
        return real(m)

    monkeypatch.setattr(export, "build_hf_model", fail_on_generator)
    with pytest.raises(OSError, match="disk full"):
        _write(single_process_group, tok, wiki_shards[0], POST, out)
    after = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]

    monkeypatch.setattr(export, "build_hf_model", real)
    _write(single_process_group, tok, wiki_shards[0], PRE, out)  # replaced
    assert (out / convert.RTD_HEAD_FILE).is_file()
    assert (out / "model.safetensors").read_bytes() != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
