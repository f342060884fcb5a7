"""The wiki sample as Hugging Face `datasets` / Arrow inputs, for tests/unit/test_arrow_input.py
and tests/multiproc/test_arrow_input_workers.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.env import TEST_DATA
from tests.helpers.tools import load_tool

WIKI = TEST_DATA / "wiki_sample.jsonl"
TEXTS = [json.loads(line)["text"] for line in WIKI.read_text(encoding="utf-8").splitlines()]


def write_inputs(out: Path) -> dict[str, Path]:
    """The wiki sample (402 documents) as JSON lines, as a saved dataset of 3 .arrow files, as
    one .arrow IPC stream (record batches of 50 rows) and as an .arrow IPC file, in ``out``."""
    import datasets
    import pyarrow as pa

    (out / "wiki.jsonl").write_bytes(WIKI.read_bytes())
    ds = datasets.Dataset.from_dict({"id": list(range(len(TEXTS))), "text": TEXTS})
    ds.save_to_disk(str(out / "saved"), num_shards=3)
    table = pa.table({"id": list(range(len(TEXTS))), "text": TEXTS})
    with pa.OSFile(str(out / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=50)
    with pa.OSFile(str(out / "file.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=50)
    return {"jsonl": out / "wiki.jsonl", "saved": out / "saved", "stream": out / "stream.arrow",
            "file": out / "file.arrow"}


# the module-scoped fixtures both test files use (imported by name into each)
@pytest.fixture(scope="module")
def tool():
    """tools/preprocess_data.py loaded under another module name."""
    return load_tool("preprocess_data", "preprocess_data_arrow")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The wiki sample as JSON lines, a saved dataset, an IPC stream and an IPC file."""
    return write_inputs(tmp_path_factory.mktemp("arrow"))
