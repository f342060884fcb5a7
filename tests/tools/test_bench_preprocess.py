"""bench/preprocess.py end to end at toy size, so that the benchmark keeps working.

Its numbers mean nothing at this size; the test checks that every row runs and that every path
(the bound, the datasets.map baseline, preprocess_data.py at 1x and 4x) writes the same tokens.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_preprocess_runs_at_toy_size(tmp_path):
    report = tmp_path / "report.json"
    corpus = REPO / "tests" / "data" / "wiki_sample.jsonl"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "preprocess.py"), "--corpus", str(corpus), "--max-docs", "100",
         "--vocab-size", "500", "--workers", "2", "--out-dir", str(tmp_path / "out"), "--json", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(report.read_text())
    rows = {row["name"].split()[0]: row for row in result["rows"]}
    bound, raw, baseline = rows["(a)"], rows["(a')"], rows["(b)"]
    ours, ours_x4 = (row for row in result["rows"] if row["name"].startswith("ours"))
    assert "1x" in ours["name"] and "4x" in ours_x4["name"]
    assert bound["tokens"] > 0 and raw["tokens"] > 0
    assert baseline["tokens"] == ours["tokens"] == bound["tokens"]
    assert ours_x4["tokens"] == 4 * ours["tokens"]
    assert ours_x4["input_bytes"] == 4 * ours["input_bytes"]
    for row in (baseline, ours, ours_x4):
        assert row["wall_s"] > 0 and 0 < row["peak_pss_mb"] <= row["peak_rss_mb"]
    assert "| row | MB/s |" in r.stdout and "peak PSS" in r.stdout and "of (a)" in r.stdout
