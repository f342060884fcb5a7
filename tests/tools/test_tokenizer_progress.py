"""Progress of tools/train_tokenizer.py run as a command: reading the corpus, then
SentencePiece's training relayed from its own log, on stderr and on a terminal. Small inputs with
a zero interval, so every step prints."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

from rtd_scale.data.tokenizer_training import train_tokenizer
from tests.helpers.env import CASES, REPO

CORPUS = CASES / "list_a.jsonl"  # 10 documents, 35 training sentences


def _tool(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input", str(CORPUS),
         "--vocab-size", "200", "--output-prefix", str(tmp_path / "spm"), "--num-threads", "1",
         *extra], capture_output=True, text=True, timeout=300)


def test_tokenizer_progress_covers_reading_and_sentencepiece(tmp_path):
    proc = _tool(tmp_path, "--progress-interval", "0")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert all(line.startswith("train_tokenizer: ") for line in lines), proc.stderr
    size = CORPUS.stat().st_size
    reading = [line for line in lines if ": reading: " in line]
    assert len(reading) == 10  # one per record at interval 0
    assert re.fullmatch(r"train_tokenizer: reading: 10 records, 0\.0 of 0\.0 MB \(100%\) \(\d+ s\)",
                        reading[-1]) and size < 50_000
    assert any("read 10 records; SentencePiece is loading the sentences" in x for x in lines)
    assert any("SentencePiece: 35 sentences preprocessed" in x for x in lines)
    em = [int(m.group(1)) for x in lines
          if (m := re.search(r"SentencePiece unigram EM: ([\d,]+) pieces \(target 200\)", x))]
    assert len(em) >= 2 and em == sorted(em, reverse=True) and em[-1] >= 200  # pruning toward 200
    assert "trainer_interface.cc" not in proc.stderr  # SentencePiece's raw log is condensed
    # the relay changes nothing of the model: the same bytes as the library call
    direct = train_tokenizer([json.loads(x)["text"] for x in CORPUS.read_text().splitlines()],
                             tmp_path / "direct", vocab_size=200, num_threads=1)
    assert (hashlib.sha256((tmp_path / "spm.model").read_bytes()).hexdigest()
            == hashlib.sha256(open(direct.model_path, "rb").read()).hexdigest())


def test_tokenizer_progress_bpe_merges_and_quiet_short_runs(tmp_path):
    proc = _tool(tmp_path, "--progress-interval", "0", "--model-type", "bpe")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"SentencePiece BPE: [\d,]+ merges \(vocab 200\)", proc.stderr), proc.stderr
    quiet = _tool(tmp_path)  # the default 30 s interval: a run this short prints no progress
    assert quiet.returncode == 0 and quiet.stderr == ""
    verbose = _tool(tmp_path, "--verbose")  # SentencePiece's own log, whole
    assert "EM sub_iter=" in verbose.stderr and "train_tokenizer:" not in verbose.stderr


def test_tokenizer_progress_on_a_terminal_is_one_redrawn_line(tmp_path):
    import os
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input", str(CORPUS),
         "--vocab-size", "200", "--output-prefix", str(tmp_path / "spm"), "--num-threads", "1",
         "--progress-interval", "0"], stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    out, _ = proc.communicate(timeout=300)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.returncode == 0 and b"trained unigram tokenizer" in out
    term = b"".join(chunks).decode()
    # one status line redrawn in place (carriage return, erase line), closed by one newline
    draws = term.split("\r\x1b[K")
    assert draws[0] == "" and term.endswith("\n") and term.count("\n") == 1, repr(term)
    assert draws[1].startswith("train_tokenizer: reading: 1 records, ")
    assert any(d.startswith("train_tokenizer: SentencePiece unigram EM: ") for d in draws)
