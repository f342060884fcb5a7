"""The corpus and tokenizer that tests/unit/test_preprocess.py and tests/tools/test_preprocess_cli.py
preprocess: real English (the stdlib's pydoc topic texts) followed by every case file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.env import CASES
from tests.helpers.tools import load_tool

CASE_FILES = ["empty_docs.jsonl", "single_sentence_docs.jsonl", "all_lines_too_long.jsonl",
              "no_space_70k.jsonl", "control_chars.jsonl"]


def texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


def write_corpus(directory: Path) -> Path:
    """``directory/corpus.jsonl``: the pydoc topic texts, then every case file's documents."""
    import pydoc_data.topics

    path = directory / "corpus.jsonl"
    docs = list(pydoc_data.topics.topics.values()) + [t for name in CASE_FILES for t in texts(CASES / name)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    return path


def train(corpus: Path, directory: Path):
    """A 400-piece Tokenizer trained on ``corpus`` into ``directory``."""
    from rtd_scale.data.tokenizer import Tokenizer
    from rtd_scale.data.tokenizer_training import train_tokenizer

    return Tokenizer(train_tokenizer(texts(corpus), directory / "spm", vocab_size=400, num_threads=2).model_path)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# the module-scoped fixtures both test files use: ``from tests.helpers.preprocess_corpus import
# corpus, tokenizer, preprocess_module`` makes them that module's fixtures
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Real English (the stdlib's pydoc topic texts) followed by every case file, as one jsonl."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    return train(corpus, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def preprocess_module():
    return load_tool("preprocess_data")
