"""Exports load under transformers 4.x as under 5.x (``pyproject.toml``: ``transformers>=4.46,<6``).

For each layout — post-LayerNorm (ELECTRA), pre-LayerNorm (RoBERTa-PreLayerNorm),
disentangled attention (DebertaV2) and the modern block (ModernBERT: its layer pattern and RoPE
bases set off transformers' defaults, which 4.x reads from other config fields than 5.x) — a tiny
model with every weight perturbed is exported with
its real SentencePiece tokenizer; ``tests/helpers/hf_load_worker.py`` then loads it, through
``AutoTokenizer`` and the export's model classes, once under the project's transformers 5.x and
once under 4.57.3 (a virtual environment built once and cached, ``tests/helpers/hf4.py``), each in
its own process. Asserted: 4.x names the tokenizer ``PreTrainedTokenizerFast``; both give the
pipeline's ids (``[CLS] + encode(text) + [SEP]``) for real sentences and the same ids for a pair;
both load the models with no missing or unexpected keys; the discriminator's and generator's
hidden states and logits agree within 1e-5 at every non-pad position, and so do those of the
same layout's masked-LM control (``rtd.objective=mlm``: one model, its layout's ``…ForMaskedLM``
class, loaded in the same worker); the DebertaV2 export's own
tokenizer class, ``DebertaV2Tokenizer`` (under 4.x the slow SentencePiece one, built from
``spm.model``), gives the pipeline's ids too, on Austen's paragraphs, NFD text and control
characters as well. ``Tokenizer.save_pretrained`` alone (outside an export) loads under 4.x as
``PreTrainedTokenizerFast`` and gives the pipeline's ids.

The first run builds the 4.x environment (pip: the project's torch release, transformers 4.57.3,
safetensors, tokenizers, sentencepiece, numpy), which took 18 minutes on the 2-core CI machine
while it was busy; later runs reuse it. Skipped, with the reason, only when the package index
cannot be reached.
"""
from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch

from rtd_scale.config import AttentionType, LayerNormPosition, Objective
from rtd_scale.hf import convert
from rtd_scale.hf.export import write_export
from tests.helpers.byo_tokenizers import normalisation_texts
from tests.helpers.env import REPO, TEST_DATA
from tests.helpers.hf4 import HF4_VERSION, Unreachable, hf4_python
from tests.helpers.hf_models import build_model, canonical_state, layout_config, perturb

POST, PRE = LayerNormPosition.POST, LayerNormPosition.PRE
DISENTANGLED = AttentionType.DISENTANGLED
ROTARY = AttentionType.ROTARY
pytestmark = pytest.mark.e2e

TOL = 1e-5
LAYOUTS = [POST, PRE, DISENTANGLED, ROTARY]
WORKER = REPO / "tests" / "helpers" / "hf_load_worker.py"


@pytest.fixture(scope="module")
def hf4():
    try:
        python, seconds = hf4_python()
    except Unreachable as e:
        pytest.skip(f"transformers {HF4_VERSION} cannot be installed: the package index is "
                    f"unreachable ({e})")
    if seconds:
        print(f"built the transformers {HF4_VERSION} environment in {seconds:.0f} s")
    return python


def _texts():
    with open(TEST_DATA / "wiki_sample.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for _, line in zip(range(4), f)]
    return [t[:80 + 40 * i] for i, t in enumerate(texts)]  # different lengths: padding


def _load(python, export, spec, out):
    r = subprocess.run([str(python), str(WORKER), str(export), str(spec), str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[l.value for l in LAYOUTS])
def test_export_loads_under_transformers_4_as_under_5(single_process_group, wiki_shards, hf4,
                                                      tmp_path, layout):
    from rtd_scale.data.tokenizer import Tokenizer

    tok = Tokenizer(wiki_shards[0])
    cfg = layout_config(layout, tok.vocab_size)
    model = build_model(cfg, single_process_group, tok)
    perturb(model)
    export = tmp_path / "export"
    state = canonical_state(model, single_process_group)
    write_export(state, cfg.model, str(export), pad_id=tok.pad_id, cls_id=tok.cls_id,
                 sep_id=tok.sep_id, tokenizer_model=wiki_shards[0], note=lambda m: None)
    texts = _texts()
    disc, gen = convert.to_hf(state, cfg.model, pad_id=tok.pad_id, cls_id=tok.cls_id,
                              sep_id=tok.sep_id)  # the classes and kwargs users load them with
    # the masked-LM control of the same layout: one model, its layout's ForMaskedLM class
    mlm_cfg = copy.deepcopy(cfg)
    mlm_cfg.rtd.objective = Objective.MLM
    mlm_model = build_model(mlm_cfg, single_process_group, tok)
    perturb(mlm_model)
    mlm_export = tmp_path / "export_mlm"
    write_export(canonical_state(mlm_model, single_process_group), mlm_cfg.trained_model(),
                 str(mlm_export), pad_id=tok.pad_id, cls_id=tok.cls_id, sep_id=tok.sep_id,
                 note=lambda m: None, masked_lm=True)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"texts": texts, "discriminator": [disc.class_name, disc.model_kwargs],
                                "generator": [gen.class_name, gen.model_kwargs],
                                "masked_lm": [gen.class_name, {}, str(mlm_export)],
                                "tokenizer_texts": normalisation_texts()}), encoding="utf-8")
    v5 = _load(sys.executable, export, spec, tmp_path / "v5.pt")
    v4 = _load(hf4, export, spec, tmp_path / "v4.pt")
    assert v4["transformers"] == HF4_VERSION and v5["transformers"].startswith("5.")
    assert v4["tokenizer_class"] == "PreTrainedTokenizerFast"
    if layout == ROTARY:  # ModernBertModel.forward takes no token_type_ids, which 4.x returns
        assert v4["input_names"] == v5["input_names"] == ["attention_mask", "input_ids"]

    pipeline = [[tok.cls_id] + tok.encode(t) + [tok.sep_id] for t in texts]
    assert v4["ids"] == pipeline and v5["ids"] == pipeline
    assert v4["pair_ids"] == v5["pair_ids"] == pipeline[0] + pipeline[1][1:]
    if layout == DISENTANGLED:  # DebertaV2Tokenizer, slow on 4.x, on paragraph breaks and NFD
        more = pipeline + [[tok.cls_id] + tok.encode(t) + [tok.sep_id] for t in normalisation_texts()]
        assert v4["slow_ids"] == v4["fast_ids"] == more
        assert v5["slow_ids"] == v5["fast_ids"] == more
    else:
        assert "slow_ids" not in v4 and "slow_ids" not in v5

    clean = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    keep = v5["attention_mask"].bool()
    assert torch.equal(v4["attention_mask"], v5["attention_mask"]) and not keep.all()
    diffs = {}
    for role in ("discriminator", "generator", "masked_lm"):
        assert v4[f"{role}_loading_info"] == v5[f"{role}_loading_info"] == clean, role
        assert sorted(v4[role]) == sorted(v5[role])
        for name in v5[role]:
            a, b = v4[role][name][keep], v5[role][name][keep]
            assert a.abs().max() > 0.01, (role, name)  # not a comparison of zeros
            diffs[f"{role}.{name}"] = (a - b).abs().max().item()
    print(f"transformers {v4['transformers']} vs {v5['transformers']}, {layout.value}: " +
          " ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    assert max(diffs.values()) < TOL, diffs


def test_tokenizer_save_pretrained_loads_under_transformers_4(hf4, wiki_shards, tmp_path):
    """``Tokenizer.save_pretrained`` on its own writes the class its docstring names
    (PreTrainedTokenizerFast; 5.x would write TokenizersBackend, which 4.x cannot load)."""
    from rtd_scale.data.tokenizer import Tokenizer

    tok = Tokenizer(wiki_shards[0])
    tok.save_pretrained(tmp_path / "tok")
    texts = _texts() + normalisation_texts()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"texts": texts}), encoding="utf-8")
    v4 = _load(hf4, tmp_path / "tok", spec, tmp_path / "v4.pt")
    assert v4["transformers"] == HF4_VERSION and v4["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert v4["ids"] == [[tok.cls_id] + tok.encode(t) + [tok.sep_id] for t in texts]
