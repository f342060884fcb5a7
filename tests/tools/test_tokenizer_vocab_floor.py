"""tools/train_tokenizer.py with a --vocab-size below what the corpus needs: one line giving the
smallest size that trains, and that size does train (SentencePiece's own message suggested
lowering --character-coverage, which it then refuses in turn)."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rtd_scale.data.normalize_text import normalize_text
from tests.helpers.env import CASES, REPO

CORPUS = CASES / "list_a.jsonl"
FLOOR = re.compile(r"^error: --vocab-size (\d+) is too small for this corpus: .* need (\d+); "
                   r"pass --vocab-size (\d+) or more$")


def _train(tmp_path, vocab: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input", str(CORPUS),
         "--vocab-size", str(vocab), "--output-prefix", str(tmp_path / f"spm{vocab}"),
         "--num-threads", "1", *extra], capture_output=True, text=True, timeout=120)


def _floor(r: subprocess.CompletedProcess) -> int:
    """The size the one-line error advises (it names it twice, the same)."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    m = FLOOR.match(lines[0])
    assert m and m.group(2) == m.group(3), lines[0]
    assert "INTERNAL" not in lines[0] and "character_coverage option" not in lines[0]
    return int(m.group(2))


def test_floor_at_full_coverage_is_distinct_characters_plus_specials(tmp_path):
    # every character kept (coverage 1): the floor is the corpus's distinct characters (the space
    # included, as SentencePiece's ▁) plus the 5 special pieces, and 256 more with byte fallback
    chars = set()
    for line in CORPUS.read_text(encoding="utf-8").splitlines():
        chars |= set(normalize_text(json.loads(line)["text"]))
    assert len(chars) == 63
    assert _floor(_train(tmp_path, 20, "--character-coverage", "1.0")) == 63 + 5
    assert _floor(_train(tmp_path, 20, "--character-coverage", "1.0", "--byte-fallback")) == \
        63 + 5 + 256


@pytest.mark.parametrize("extra", [(), ("--model-type", "bpe"), ("--byte-fallback",)])
def test_following_the_advice_trains(tmp_path, extra):
    floor = _floor(_train(tmp_path, 20, *extra))
    assert _floor(_train(tmp_path, floor - 1, *extra)) == floor  # the floor is exact
    r = _train(tmp_path, floor, *extra)
    assert r.returncode == 0, r.stderr
    assert f"vocab {floor}," in r.stdout and (tmp_path / f"spm{floor}.model").is_file()
