"""The encoding work of tools/preprocess_data.py, in an importable module.

The tool's worker pool pickles these functions by reference. Under the ``spawn`` start method (used
whenever the caller has imported torch) a child process can only find them in a module it can
import by name; functions defined in a script loaded under another name (a test, a notebook) are
not found, and ``multiprocessing.Pool`` then respawns the failing workers forever.
"""
from __future__ import annotations

import itertools

import numpy as np

from rtd_scale.data.text import LineBlock, parse_line_block, read_line_range
from rtd_scale.data.tokenizer import Tokenizer

# (tokenizer, shard dtype, keys), set once per worker process by init_worker
_worker_state: tuple[Tokenizer, np.dtype, tuple[str, ...]] | None = None


def init_worker(tokenizer: Tokenizer, dtype: np.dtype, keys: tuple[str, ...]) -> None:
    global _worker_state
    _worker_state = (tokenizer, dtype, keys)


def work_in_worker(task) -> tuple:
    assert _worker_state is not None
    return work(*_worker_state, task)


def work(tokenizer: Tokenizer, dtype: np.dtype, keys: tuple[str, ...], task) -> tuple:
    """A task -> (file index, ParsedRecords without texts, per key (ids [sum(lengths)] in the
    shard dtype, lengths [records] int64; 0 for an empty document), input bytes, whether its
    line numbers still count from the task's first line)."""
    if task[0] == "range":  # an uncompressed file: read here, line numbers fixed up later
        _, path, fmt, file, start, end, at_line_start = task
        block = read_line_range(path, file, start, end, at_line_start)
        parsed, nbytes = parse_line_block(block, path, fmt, keys), len(block.data)
    elif isinstance(task[0], LineBlock):
        block, path, fmt = task
        parsed, file, nbytes = parse_line_block(block, path, fmt, keys), block.file, len(block.data)
    else:
        file, parsed, nbytes = task
    encoded = _encode(tokenizer, dtype, len(keys), parsed.texts)
    parsed.texts = []  # not shipped back
    return file, parsed, encoded, nbytes, task[0] == "range"


def _encode(tokenizer: Tokenizer, dtype: np.dtype, width: int,
            records: list[tuple[str, ...]]) -> list[tuple[np.ndarray, np.ndarray]]:
    flat = tokenizer.encode_batch([text for record in records for text in record]) if records else []
    out = []
    for k in range(width):
        docs = flat[k::width]
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        ids = np.fromiter(itertools.chain.from_iterable(docs), dtype=dtype, count=int(lengths.sum()))
        out.append((ids, lengths))
    return out
