"""Following the README leaves ``git status`` clean: what its commands write (the main job's run
directory, the sample corpus, tokenizer and shards, an export under ``hf/``) is ignored."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers.env import REPO

WRITTEN = ["runs/tiny-20261201-120000/global_step300/mp_rank_00_model_states.pt",
           "runs/tiny-20261201-120000/tensorboard/events.out.tfevents.1",
           "data/sample/corpus.jsonl", "data/sample/spm.model",
           "data/sample/wiki_text_document_00000.bin", "hf/tiny/model.safetensors",
           "hf/base/generator/config.json", ".venv/bin/python"]


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                    reason="not a git checkout")
def test_what_the_readme_writes_is_ignored():
    out = subprocess.run(["git", "check-ignore", "--no-index", "--verbose", "--non-matching",
                          *WRITTEN, "rtd_scale/pretrain.py", "tests/data/wiki_sample.jsonl"],
                         cwd=REPO, capture_output=True, text=True)
    ignored = {ln.split("\t")[1] for ln in out.stdout.splitlines() if not ln.startswith("::")}
    assert sorted(set(WRITTEN) - ignored) == []
    # negative control: the source and the test data stay tracked
    assert "rtd_scale/pretrain.py" not in ignored and "tests/data/wiki_sample.jsonl" not in ignored
