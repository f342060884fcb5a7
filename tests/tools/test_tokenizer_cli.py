"""tools/train_tokenizer.py run as the command a user types, on the bug-report cases: every line
too long, a 70k-character run with no spaces, malformed lines (one-line error, or skipped and
counted), a missing input. The tokenizer library's side of each case is in
tests/unit/test_tokenizer.py."""
from __future__ import annotations

import subprocess
import sys

from rtd_scale.data.normalize_text import normalize_text
from rtd_scale.data.tokenizer import Tokenizer
from tests.helpers.env import CASES, REPO
from tests.helpers.env import case_texts as _case_texts

TRAIN_TOOL = REPO / "tools" / "train_tokenizer.py"


def _run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TRAIN_TOOL), *args], capture_output=True, text=True, cwd=REPO)


def _assert_one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def test_every_line_too_long_trains(tmp_path):
    lines = _case_texts("all_lines_too_long.jsonl")
    assert min(len(t.encode()) for t in lines) > 4192  # the case: every line beats SentencePiece's limit
    proc = _run_tool("--input", str(CASES / "all_lines_too_long.jsonl"), "--output-prefix",
                     str(tmp_path / "too_long"), "--vocab-size", "60", "--character-coverage", "1.0")
    assert proc.returncode == 0, proc.stderr
    assert "on 50 documents" in proc.stdout and "vocab 60" in proc.stdout
    tok = Tokenizer(tmp_path / "too_long.model")
    assert tok.vocab_size == 60
    # coverage 1.0: "D" of "Document 0." is rarer than SentencePiece's default 0.9995 keeps
    assert tok.decode(tok.encode(lines[0])) == normalize_text(lines[0])


def test_malformed_line_error_names_file_and_line(tmp_path):
    proc = _run_tool("--input", str(CASES / "malformed.jsonl"), "--output-prefix", str(tmp_path / "m"),
                     "--vocab-size", "40")
    line = _assert_one_line_error(proc)
    assert "malformed.jsonl:2: invalid JSON" in line
    assert "--skip-bad-lines" in line
    assert list(tmp_path.iterdir()) == []


def test_no_space_run_trains_alone(tmp_path):
    """The 70,014-byte run is hard-split into <= 4192-byte pieces. Encoding it with a tokenizer
    trained with its neighbours: tests/unit/test_tokenizer.py::test_no_space_run_encodes_and_neighbours_intact."""
    run = _case_texts("no_space_70k.jsonl")[1]
    assert len(run) == 70014 and run.count(" ") == 2  # "prefix <70,000 letters> suffix"
    proc = _run_tool("--input", str(CASES / "no_space_70k.jsonl"), "--output-prefix",
                     str(tmp_path / "no_space"), "--vocab-size", "40")
    assert proc.returncode == 0, proc.stderr
    assert "20 of 20 sentences fed" in proc.stdout  # 2 short + 1 + 17 pieces of the 70,014-byte document


def test_skip_bad_lines_trains_on_the_rest(tmp_path):
    """Which lines are bad and why: tests/unit/test_tokenizer.py::test_skip_bad_lines_counts_three."""
    proc = _run_tool("--input", str(CASES / "malformed.jsonl"), "--output-prefix", str(tmp_path / "m"),
                     "--vocab-size", "40", "--skip-bad-lines")
    assert proc.returncode == 0, proc.stderr
    assert "on 2 documents" in proc.stdout and "3 bad lines skipped" in proc.stdout
    assert (tmp_path / "m.model").is_file() and (tmp_path / "m.vocab").is_file()


def test_missing_input_is_one_line(tmp_path):
    proc = _run_tool("--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "x"))
    assert _assert_one_line_error(proc) == f"error: input file not found: {tmp_path / 'missing.jsonl'}"


def test_byte_order_marks_are_read_as_nothing(tmp_path):
    """A UTF-8 byte-order mark before line 1 and line 4 (a file joined from two): every document
    trains, the note is printed once; before, line 1 was refused ("decode using utf-8-sig")."""
    proc = _run_tool("--input", str(CASES / "c41_bom_concat.jsonl"), "--output-prefix",
                     str(tmp_path / "bom"), "--vocab-size", "60")
    assert proc.returncode == 0, proc.stderr
    assert "on 6 documents (0 empty skipped, 0 bad lines skipped)" in proc.stdout
    assert proc.stdout.count("note: read 2 UTF-8 byte-order mark(s) (U+FEFF) at the start of a "
                             "file or line as nothing (first: ") == 1
    assert "\ufeff" not in (tmp_path / "bom.vocab").read_text(encoding="utf-8")
