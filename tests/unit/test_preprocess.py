"""Preprocessing into megatron-core shards: empty documents, round trip, worker-count
independence, dtype choice around 16 bits, malformed input, atomic outputs, and the
tokenizer check.

tools/preprocess_data.py is run as a subprocess (the real CLI) where its exit status and stderr
matter; other cases call its main() in-process to save megatron-core's ~4 s import per run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pydoc_data.topics
import pytest

from rtd_scale.cli_errors import run_cli
from rtd_scale.data.shards import (
    ShardMismatchError,
    ShardWriter,
    check_tokenizer_matches,
    dtype_for_vocab,
    open_shard,
    read_manifest,
    read_shard_meta,
    shard_paths,
)
from rtd_scale.data.text import BadLineError, ReadStats, iter_records
from rtd_scale.data.tokenizer import Tokenizer, normalize_text, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
from tests.helpers.env import CASES  # noqa: E402
TOOL = REPO / "tools" / "preprocess_data.py"
CASE_FILES = ["c05_empty_docs.jsonl", "c06_single_sentence_docs.jsonl", "c10_all_lines_too_long.jsonl",
              "c11_no_space_70k.jsonl", "c12_control_chars.jsonl"]


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Real English (the stdlib's pydoc topic texts) followed by every case file, as one jsonl."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    docs = list(pydoc_data.topics.topics.values()) + [t for name in CASE_FILES for t in _texts(CASES / name)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory) -> Tokenizer:
    prefix = tmp_path_factory.mktemp("tok") / "spm"
    return Tokenizer(train_tokenizer(_texts(corpus), prefix, vocab_size=400, num_threads=2).model_path)


@pytest.fixture(scope="module")
def preprocess_module():
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=REPO)


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# -- empty documents and the round trip -------------------------------------------------------


def test_empty_documents_skipped_and_counted(tokenizer, tmp_path):
    proc = _run("--input", str(CASES / "c05_empty_docs.jsonl"), "--tokenizer-model", tokenizer.model_path,
                "--output-prefix", str(tmp_path / "c05"))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "done: 2 documents written, 4 empty documents skipped, 0 bad lines skipped" in proc.stdout
    dataset = tmp_path / "c05_text_document"  # Megatron-LM's naming
    assert f"--data-path {dataset}    # text: 2 documents" in proc.stdout
    prefix = tmp_path / "c05_text_document_00000"  # its one shard
    ds = open_shard(prefix)
    assert len(ds) == 2 and ds.document_indices.tolist() == [0, 1, 2]
    non_empty = [t for t in _texts(CASES / "c05_empty_docs.jsonl") if normalize_text(t)]
    assert [ds[i].tolist() for i in range(2)] == [tokenizer.encode(t) for t in non_empty]
    meta = read_shard_meta(prefix)
    assert (meta["documents"], meta["empty_documents_skipped"], meta["vocab_size"], meta["dtype"]) == (2, 4, 400, "uint16")
    assert meta["tokens"] == sum(len(tokenizer.encode(t)) for t in non_empty)
    assert meta["tokenizer_model_sha256"] == tokenizer.sha256
    manifest = read_manifest(dataset)
    assert (manifest["documents"], manifest["empty_documents_skipped"], manifest["shards"]) == (2, 4, [str(prefix)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "c05_text_document.manifest.json", "c05_text_document_00000.bin", "c05_text_document_00000.idx",
        "c05_text_document_00000.meta.json"]


def test_round_trip_and_workers_give_identical_bytes(corpus, tokenizer, tmp_path, preprocess_module, capsys):
    args = ["--input", str(corpus), "--tokenizer-model", tokenizer.model_path]
    assert run_cli(preprocess_module.main, [*args, "--output-prefix", str(tmp_path / "w1" / "o"), "--workers", "1"]) == 0
    proc = _run(*args, "--output-prefix", str(tmp_path / "w2" / "o"), "--workers", "2")  # spawned workers
    assert proc.returncode == 0, proc.stderr
    outputs = {w: _snapshot(tmp_path / f"w{w}") for w in (1, 2)}
    assert outputs[1] == outputs[2] and len(outputs[1]) == 4  # manifest + one shard, same bytes

    docs = [t for t in _texts(corpus) if normalize_text(t)]
    ds = open_shard(tmp_path / "w2" / "o_text_document_00000")
    assert len(ds) == len(docs) == len(_texts(corpus)) - 4  # the case file's four empty documents
    for i, text in enumerate(docs):
        assert ds[i].dtype == np.uint16
        assert ds[i].tolist() == tokenizer.encode(text), i
    no_space_run = _texts(CASES / "c11_no_space_70k.jsonl")[1]
    assert tokenizer.decode(ds[docs.index(no_space_run)]) == no_space_run


# -- dtype around the 16-bit limit ---------------------------------------------------------------


def test_dtype_for_vocab_around_16_bits():
    assert dtype_for_vocab(65_535) == np.uint16
    assert dtype_for_vocab(65_536) == np.uint16  # largest id 65,535 still fits
    assert dtype_for_vocab(65_537) == np.int32
    assert dtype_for_vocab(128_100) == np.int32
    with pytest.raises(ValueError):
        dtype_for_vocab(0)


@pytest.mark.parametrize(
    "vocab_size, ids, dtype",
    [(65_535, [0, 65_534, 7], np.uint16), (65_536, [65_535, 0, 65_535], np.uint16), (128_100, [65_535, 65_536, 128_099], np.int32)],
)
def test_ids_round_trip_exactly_around_16_bits(tmp_path, vocab_size, ids, dtype):
    prefix = tmp_path / f"v{vocab_size}"
    with ShardWriter(prefix, vocab_size=vocab_size) as w:
        w.add_document(ids)
        w.add_document(np.array(ids[::-1], dtype=np.int64))
    ds = open_shard(prefix)
    assert ds.index.dtype == dtype
    assert [ds[0].tolist(), ds[1].tolist()] == [ids, ids[::-1]]
    assert read_shard_meta(prefix)["dtype"] == np.dtype(dtype).name


@pytest.mark.parametrize("bad", [65_536, -1])
def test_id_outside_vocab_raises_and_writes_nothing(tmp_path, bad):
    with pytest.raises(ValueError, match=f"token id {bad} is outside \\[0, 65536\\)"):
        with ShardWriter(tmp_path / "x", vocab_size=65_536) as w:
            w.add_document([1, 2, 3])
            w.add_document([5, bad])
    assert list(tmp_path.iterdir()) == []


def test_dtype_too_small_for_vocab_raises(tmp_path):
    with pytest.raises(ValueError, match="uint16 cannot hold ids up to 65536"):
        ShardWriter(tmp_path / "x", vocab_size=65_537, dtype=np.uint16)


# -- errors: malformed input, missing input, empty corpus, atomic outputs -------------------------


def test_existing_dataset_is_kept_unless_resume_or_overwrite(tokenizer, tmp_path, preprocess_module, capsys):
    good = run_cli(preprocess_module.main, ["--input", str(CASES / "c05_empty_docs.jsonl"), "--tokenizer-model",
                                            tokenizer.model_path, "--output-prefix", str(tmp_path / "out")])
    assert good == 0
    before = _snapshot(tmp_path)

    proc = _run("--input", str(CASES / "c12b_malformed.jsonl"), "--tokenizer-model", tokenizer.model_path,
                "--output-prefix", str(tmp_path / "out"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"error: --output-prefix: {tmp_path / 'out_text_document'} already holds a dataset "
                           "(1 shard(s)); pass --resume to finish or keep it, --overwrite to replace it, or "
                           "choose another --output-prefix\n")
    assert _snapshot(tmp_path) == before  # same files, same bytes, no temporaries left

    # --resume on a complete dataset does nothing; with other inputs it refuses, naming the flag
    capsys.readouterr()
    args = ["--tokenizer-model", tokenizer.model_path, "--output-prefix", str(tmp_path / "out"), "--resume"]
    assert run_cli(preprocess_module.main, ["--input", str(CASES / "c05_empty_docs.jsonl"), *args]) == 0
    assert capsys.readouterr().out.startswith("nothing to do: ")
    assert run_cli(preprocess_module.main, ["--input", str(CASES / "c06_single_sentence_docs.jsonl"), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume: shard {tmp_path / 'out_text_document_00000'} was written with other "
                          "arguments: --input differs") and err.count("\n") == 1
    assert _snapshot(tmp_path) == before

    # --overwrite replaces it
    assert run_cli(preprocess_module.main, ["--input", str(CASES / "c06_single_sentence_docs.jsonl"), "--tokenizer-model",
                                            tokenizer.model_path, "--output-prefix", str(tmp_path / "out"),
                                            "--overwrite"]) == 0
    assert read_manifest(tmp_path / "out_text_document")["documents"] == 300


def test_malformed_new_prefix_writes_nothing(tokenizer, tmp_path, preprocess_module, capsys):
    status = run_cli(preprocess_module.main, ["--input", str(CASES / "c12b_malformed.jsonl"), "--tokenizer-model",
                                              tokenizer.model_path, "--output-prefix", str(tmp_path / "new" / "m")])
    assert status == 1
    assert ":2: invalid JSON" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # not even the output directory


def test_skip_bad_lines_counts(tokenizer, tmp_path, preprocess_module, capsys):
    status = run_cli(preprocess_module.main, ["--input", str(CASES / "c12b_malformed.jsonl"), "--tokenizer-model",
                                              tokenizer.model_path, "--output-prefix", str(tmp_path / "m"), "--skip-bad-lines"])
    out = capsys.readouterr().out
    assert status == 0
    assert "done: 2 documents written, 0 empty documents skipped, 3 bad lines skipped (first: " in out
    assert len(open_shard(tmp_path / "m_text_document_00000")) == 2


def test_missing_input_one_line_error(tokenizer, tmp_path):
    proc = _run("--input", str(tmp_path / "nope.jsonl"), "--tokenizer-model", tokenizer.model_path,
                "--output-prefix", str(tmp_path / "x"))
    assert proc.returncode == 1
    assert proc.stderr == f"error: input file not found: {tmp_path / 'nope.jsonl'}\n"
    assert list(tmp_path.iterdir()) == []


def test_empty_corpus_and_bad_tokenizer(tokenizer, tmp_path, preprocess_module, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": " \\u200b "}\n', encoding="utf-8")
    status = run_cli(preprocess_module.main, ["--input", str(empty), "--tokenizer-model", tokenizer.model_path,
                                              "--output-prefix", str(tmp_path / "e")])
    assert status == 1
    assert f"error: no non-empty documents in {empty} (read 2 records" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["empty.jsonl"]

    status = run_cli(preprocess_module.main, ["--input", str(empty), "--tokenizer-model", str(tmp_path / "x.model"),
                                              "--output-prefix", str(tmp_path / "e")])
    assert status == 1
    assert capsys.readouterr().err.startswith("error: tokenizer model not found: ")


def test_several_json_keys_one_shard_each(tokenizer, tmp_path, preprocess_module, capsys):
    src = tmp_path / "in.jsonl"
    rows = [{"text": "The river rises in the hills.", "title": "River"}, {"text": "Copper is a metal.", "title": ""}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    status = run_cli(preprocess_module.main, ["--input", str(src), "--json-keys", "text", "title",
                                              "--tokenizer-model", tokenizer.model_path, "--output-prefix", str(tmp_path / "o")])
    assert status == 0, capsys.readouterr().err
    text = open_shard(tmp_path / "o_text_document_00000")  # keep it alive: ds[i] are views of its mmap
    assert [d.tolist() for d in text[0:2]] == [tokenizer.encode(r["text"]) for r in rows]
    title = open_shard(tmp_path / "o_title_document_00000")
    assert len(title) == 1 and title[0].tolist() == tokenizer.encode("River")
    assert read_shard_meta(tmp_path / "o_title_document_00000")["empty_documents_skipped"] == 1
    assert read_manifest(tmp_path / "o_title_document")["empty_documents_skipped"] == 1


# -- readers other than jsonl ----------------------------------------------------------------------


def test_parquet_txt_and_json_array_inputs(tmp_path):
    pq.write_table(pa.table({"text": ["first row", None, "third row"], "n": [1, 2, 3]}), tmp_path / "p.parquet")
    stats = ReadStats()
    assert list(iter_records([tmp_path / "p.parquet"], ["text"], skip_bad_lines=True, stats=stats)) == [
        ("first row",), ("third row",)]
    assert str(stats.bad_examples[0]) == f"{tmp_path / 'p.parquet'}: row 2: key 'text' is null, expected a string"
    with pytest.raises(BadLineError, match="row 2: key 'text' is null"):
        list(iter_records([tmp_path / "p.parquet"], ["text"]))

    (tmp_path / "t.txt").write_bytes(b"one line\r\n\nthird \xff line\n")
    stats = ReadStats()
    assert list(iter_records([tmp_path / "t.txt"], ["text"], skip_bad_lines=True, stats=stats)) == [("one line",), ("",)]
    assert stats.bad_examples[0].line == 3

    (tmp_path / "a.json").write_text('[{"text": "a"},\n {"text": "b"}, {"body": "c"}]', encoding="utf-8")
    with pytest.raises(BadLineError, match="element 3: missing key 'text'"):
        list(iter_records([tmp_path / "a.json"], ["text"]))
    (tmp_path / "l.json").write_text('{"text": "loose"}\n{"text": "json"}\n', encoding="utf-8")  # Megatron's .json
    assert list(iter_records([tmp_path / "l.json"], ["text"])) == [("loose",), ("json",)]


# -- shards and the tokenizer they were made with --------------------------------------------------


def test_check_tokenizer_matches(corpus, tokenizer, tmp_path):
    prefix = tmp_path / "s"
    with ShardWriter(prefix, vocab_size=tokenizer.vocab_size, tokenizer_model=tokenizer.model_path) as w:
        for text in _texts(CASES / "c06_single_sentence_docs.jsonl"):
            w.add_document(tokenizer.encode(text))
    check_tokenizer_matches(prefix, tokenizer.model_path, tokenizer.vocab_size)  # same tokenizer: fine

    other = Tokenizer(train_tokenizer(_texts(corpus), tmp_path / "other", vocab_size=300, num_threads=2).model_path)
    with pytest.raises(ShardMismatchError) as e:
        check_tokenizer_matches(prefix, other.model_path, other.vocab_size)
    msg = str(e.value)
    assert f"shard {prefix} was written with tokenizer {tokenizer.model_path} (vocab_size 400, sha256 {tokenizer.sha256[:12]})" in msg
    assert f"this run uses {other.model_path} (vocab_size 300, sha256 {other.sha256[:12]})" in msg
    assert "re-run tools/preprocess_data.py" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)

    # Without a sidecar (a shard from Megatron-LM's preprocessing): the max id must fit the vocab.
    Path(shard_paths(prefix)[2]).unlink()
    assert read_shard_meta(prefix) is None
    max_id = max(max(tokenizer.encode(t)) for t in _texts(CASES / "c06_single_sentence_docs.jsonl"))
    check_tokenizer_matches(prefix, other.model_path, max_id + 1)
    with pytest.raises(ShardMismatchError, match=f"contains token id {max_id} but tokenizer .* has vocab_size {max_id}"):
        check_tokenizer_matches(prefix, other.model_path, max_id)


def test_open_shard_names_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'none'}.idx and {tmp_path / 'none'}.bin not found"):
        open_shard(tmp_path / "none")


def test_a_file_that_is_not_parquet_is_a_one_line_error(tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"not parquet at all")
    stats = ReadStats()
    with pytest.raises(ValueError, match=r"fake\.parquet: not a readable parquet file"):
        list(iter_records([fake], ("text",), stats=stats))
