"""Two small shard datasets for the blending and loader tests (the ``two_datasets`` fixture of
tests/conftest.py: tests/unit/test_loader.py, tests/multiproc/test_loader_workers.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from rtd_scale.data.shards import ShardWriter


def _shard(tmp_path: Path, name: str, first_id: int, n_docs: int) -> str:
    prefix = str(tmp_path / name)
    with ShardWriter(prefix, vocab_size=1000) as w:
        for i in range(n_docs):
            w.add_document(np.full(5 + i % 7, first_id + i % 50))
    return prefix


def two_datasets(tmp: Path) -> tuple[str, str]:
    """Prefixes of ``a`` (200 documents of ids 100-149) and ``b`` (60 of ids 500-549), written
    into ``tmp``; documents of 5-11 tokens."""
    return _shard(tmp, "a", 100, 200), _shard(tmp, "b", 500, 60)
