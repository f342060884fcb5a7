"""tools/preprocess_data.py killed with SIGKILL mid-run (the tool and its worker processes),
then --resume: the same bytes as a clean run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rtd_scale.cli_errors import run_cli
from rtd_scale.data.shards import read_manifest
from tests.helpers.env import REPO, TEST_DATA
from tests.helpers.preprocess_corpus import snapshot as _snapshot
from tests.helpers.tools import load_tool

TOOL = REPO / "tools" / "preprocess_data.py"
WIKI = TEST_DATA / "wiki_sample.jsonl"


def _preprocess(tools, tok: str, inputs, prefix, *extra: str) -> None:
    argv = ["--input", *map(str, inputs), "--tokenizer-model", tok, "--output-prefix", str(prefix), *extra]
    assert run_cli(tools[0].main, argv) == 0


@pytest.fixture(scope="module")
def tools():
    return (load_tool("preprocess_data"),)


def test_sigkill_then_resume_is_byte_identical(tools, wiki_shards, tmp_path):
    tok, _ = wiki_shards
    big = tmp_path / "big.jsonl"
    big.write_bytes(WIKI.read_bytes() * 30)  # 12,060 documents, ~6 MB
    args = ["--input", str(big), "--tokenizer-model", tok, "--shard-size-mb", "0.05", "--workers", "2"]
    proc = subprocess.Popen([sys.executable, str(TOOL), *args, "--output-prefix", str(tmp_path / "killed" / "x")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    third = tmp_path / "killed" / "x_text_document_00002.idx"
    deadline = time.monotonic() + 120
    while not third.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the tool and its workers, mid-run
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed" / "x_text_document.manifest.json").exists()

    resumed = subprocess.run([sys.executable, str(TOOL), *args, "--output-prefix", str(tmp_path / "killed" / "x"),
                              "--resume"], cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after shard " in resumed.stdout
    # in-process, so one worker (spawned workers cannot import a module loaded from a file path);
    # the bytes do not depend on the worker count
    _preprocess(tools, tok, [big], tmp_path / "clean" / "x", "--shard-size-mb", "0.05")
    assert _snapshot(tmp_path / "killed") == _snapshot(tmp_path / "clean")
    assert read_manifest(tmp_path / "clean" / "x_text_document")["documents"] == 12_060
