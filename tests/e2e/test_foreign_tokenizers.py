"""Tokenizers not made by tools/train_tokenizer.py through the real tools: DeBERTaV3's
SentencePiece layout ([MASK] appended after the pieces), SentencePiece's default layout extended
by tools/add_special_pieces.py, and BERT's WordPiece vocab.txt each preprocess
(tools/preprocess_data.py) and train 3 steps (`deepspeed rtd_scale/pretrain.py`, tiny preset,
1 rank); the default layout itself is refused by both tools in one line."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rtd_scale.data.tokenizer import Tokenizer
from tests.helpers import byo_tokenizers as byo
from tests.helpers.env import REPO, TEST_DATA
from tests.helpers.launcher import launch, scalars

pytestmark = pytest.mark.e2e

LAYOUTS = ("deberta_v3", "default_layout_extended", "wordpiece_vocab")


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / name), *args], capture_output=True, text=True,
                          cwd=REPO)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, str]:
    """layout -> the tokenizer file (the default layout unextended too)."""
    out = tmp_path_factory.mktemp("foreign")
    paths = {"deberta_v3": byo.deberta_v3(out), "default_layout": byo.default_layout(out)}
    r = _tool("add_special_pieces.py", "--input", paths["default_layout"], "--output", str(out / "extended.model"))
    assert r.returncode == 0, r.stderr
    paths["default_layout_extended"] = str(out / "extended.model")
    (out / "wp").mkdir()
    paths["wordpiece_vocab"] = byo.wordpiece_vocab(out / "wp")
    return paths


def _preprocess(tok: str, prefix) -> subprocess.CompletedProcess:
    return _tool("preprocess_data.py", "--input", str(TEST_DATA / "wiki_sample.jsonl"), "--tokenizer-model", tok,
                 "--output-prefix", str(prefix))


def _train_args(tok: str, data: str, save) -> list[str]:
    return ["--ds_config", "ds_configs/zero0.json", "--preset", "tiny", "--data-path", data,
            "--tokenizer-model", tok, "--save", str(save), "--train-iters", "3", "--seq-length", "64",
            "--micro-batch-size", "4", "--global-batch-size", "8", "--log-interval", "1", "--seed", "5"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_foreign_tokenizer_preprocesses_and_trains(layouts, layout, tmp_path):
    tok = Tokenizer(layouts[layout])
    r = _preprocess(layouts[layout], tmp_path / "wiki")
    assert r.returncode == 0, r.stderr[-2000:]
    r = launch(_train_args(layouts[layout], str(tmp_path / "wiki_text_document"), tmp_path / "run"), ranks=1)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["model"]["vocab_size"] == tok.vocab_size  # DeBERTaV3: the pieces + the appended [MASK]
    tb = scalars(str(tmp_path / "run" / "tensorboard"))
    assert sorted(tb["loss/mlm"]) == [1, 2, 3]
    # A fresh generator predicts about uniformly over the real, non-special ids.
    assert abs(tb["loss/mlm"][1] - math.log(tok.vocab_size - len(tok.special_ids))) < 0.3, tb["loss/mlm"]
    assert all(0.0 < tb["rtd/replaced_fraction"][s] < 0.2 for s in (1, 2, 3))
    assert all(math.isfinite(tb["loss/rtd"][s]) for s in (1, 2, 3))


def test_default_layout_is_refused_by_both_tools_in_one_line(layouts, tmp_path):
    path = layouts["default_layout"]
    expected = (f"error: tokenizer {path} has no pad piece ([PAD] or <pad>) and no mask piece ([MASK] or <mask>); "
                f"add them with `python tools/add_special_pieces.py --input {path} --output NEW.model`")
    r = _preprocess(path, tmp_path / "wiki")
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith(expected), r.stderr
    r = launch(_train_args(path, str(tmp_path / "wiki_text_document"), tmp_path / "run"), ranks=1)
    assert r.returncode != 0
    assert expected in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr
