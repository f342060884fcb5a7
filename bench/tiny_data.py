"""The launcher benches' data: ``tests/data/wiki_sample.jsonl`` tokenized by the repository's
own tools (no torch import, so that a bench which only launches ``pretrain.py`` starts fast).

A bench script is run as ``python bench/X.py`` from the repository root; it puts the root on
``sys.path`` and imports this module as ``bench.tiny_data``.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def wiki_sample_data(workdir: Path, vocab_size: int,
                     workers: Optional[int] = None) -> tuple[str, str]:
    """(tokenizer model, dataset prefix) of ``tests/data/wiki_sample.jsonl`` under ``workdir``
    (``spm.model``, ``wiki_text_document``), made by the repository's tools unless already there;
    ``workers``: ``tools/preprocess_data.py --workers`` (None: its default)."""
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = REPO / "tests" / "data" / "wiki_sample.jsonl"
    spm, prefix = workdir / "spm", workdir / "wiki"
    if not (workdir / "spm.model").exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input",
                        str(corpus), "--vocab-size", str(vocab_size), "--output-prefix", str(spm)],
                       cwd=REPO, check=True, capture_output=True)
    if not (workdir / "wiki_text_document.manifest.json").exists():  # written last: complete
        subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input",
                        str(corpus), "--tokenizer-model", f"{spm}.model", "--output-prefix",
                        str(prefix), *(["--workers", str(workers)] if workers else [])],
                       cwd=REPO, check=True, capture_output=True)
    return f"{spm}.model", f"{prefix}_text_document"
