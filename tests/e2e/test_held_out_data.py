"""--valid-data-path / --test-data-path (Megatron-LM's): held-out corpora read whole, so the
held-out RTD AUC and validation losses come from text the model never trains on; the test
corpus is evaluated once after the last step."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from rtd_scale import arguments, prepare
from tests.helpers.env import REPO
from tests.helpers.launcher import launch, scalars

# a corpus whose every token is one of few pieces, none of which needs most of the vocabulary
HELD_OUT_TEXT = "the cat sat on the mat and the dog sat on the log"


def _corpus(tmp_path, tok, name: str, docs: int = 40):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": " ".join([HELD_OUT_TEXT] * (1 + i % 3))}) + "\n"
                           for i in range(docs)))
    subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
                    str(src), "--tokenizer-model", tok, "--output-prefix", str(tmp_path / name)],
                   check=True, capture_output=True)
    return str(tmp_path / f"{name}_text_document")


def _argv(wiki_shards, save, *extra):
    tok, prefix = wiki_shards
    return ["--ds_config", "ds_configs/zero3.json", "--data-path", prefix, "--tokenizer-model",
            tok, "--save", str(save), "--train-iters", "2", "--seq-length", "64",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--lr-warmup-iters", "1",
            "--eval-interval", "2", "--eval-iters", "2", "--log-interval", "1", *extra]


def test_validation_reads_the_valid_data_path(wiki_shards, tmp_path, monkeypatch):
    from rtd_scale.data.tokenizer import Tokenizer

    tok_path, prefix = wiki_shards
    valid, test = _corpus(tmp_path, tok_path, "valid"), _corpus(tmp_path, tok_path, "test")
    monkeypatch.chdir(REPO)
    cfg = arguments.config_from_args(arguments.build_parser().parse_args(_argv(
        wiki_shards, tmp_path / "run", "--valid-data-path", valid, "--test-data-path", test)))
    prep = prepare.prepare(cfg, world_size=1)
    tok, data = prep.tokenizer, prep.data
    held_out = set(Tokenizer(tok_path).encode(HELD_OUT_TEXT)) | set(tok.special_ids)
    wanted = np.arange(cfg.train.eval_iters * cfg.train.global_batch_size)
    for split, corpus, base in (("valid", valid, 1 << 60), ("test", test, 1 << 61)):
        ds = data[split]
        assert [d.name for d in ds.datasets] == [corpus.rsplit("/", 1)[1]]
        assert ds.datasets[0].num_documents == ds.datasets[0].total_documents == 40  # whole
        batch = ds.host_batch(wanted)
        assert set(np.unique(batch.input_ids).tolist()) <= held_out  # only the held-out text
        assert batch.sample_index.tolist() == (base + wanted).tolist()  # the split's mask keys
    # the training split is the wiki text, all of it: --split's held-out shares train
    train = data["train"]
    assert [d.name for d in train.datasets] == [prefix.rsplit("/", 1)[1]]
    assert train.datasets[0].num_documents == train.datasets[0].total_documents
    assert len(set(np.unique(train.host_batch(wanted).input_ids).tolist()) - held_out) > 50
    # without the flags, validation is --split's validation share of the training data
    cfg = arguments.config_from_args(arguments.build_parser().parse_args(_argv(
        wiki_shards, tmp_path / "run2")))
    data = prepare.prepare(cfg, world_size=1).data
    assert sorted(data) == ["train", "valid"]
    assert data["valid"].datasets[0].name == prefix.rsplit("/", 1)[1]
    assert 0 < data["valid"].datasets[0].num_documents < data["valid"].datasets[0].total_documents


def test_launcher_validates_and_tests_on_held_out_corpora(wiki_shards, tmp_path):
    tok_path, _ = wiki_shards
    valid, test = _corpus(tmp_path, tok_path, "valid"), _corpus(tmp_path, tok_path, "test")
    save = tmp_path / "run"
    r = launch(_argv(wiki_shards, save, "--valid-data-path", valid, "--test-data-path", test))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "  data valid: 1 × valid_text_document (" in r.stdout
    assert " validation at iteration        2 | samples: 16 |" in r.stdout, r.stdout[-3000:]
    assert " test at iteration        2 | samples: 16 |" in r.stdout
    assert "  test (--test-data-path) L_MLM " in r.stdout
    tb = scalars(str(save / "tensorboard"))
    assert sorted(tb["valid/loss/mlm"]) == [2] and sorted(tb["test/loss/mlm"]) == [2]
    assert 0.0 <= tb["test/rtd/auc"][2] <= 1.0
    # the two held-out corpora hold the same text but are masked by their own keys
    assert tb["valid/loss/mlm"][2] != tb["test/loss/mlm"][2]
