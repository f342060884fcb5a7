"""tools/preprocess_data.py run as the command a user types, where its exit status, stdout and
stderr matter: empty documents skipped and counted, worker processes giving the in-process
bytes, an existing dataset kept, a missing input named in one line."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from rtd_scale.cli_errors import run_cli
from rtd_scale.data.shards import open_shard, read_manifest, read_shard_meta
from rtd_scale.data.normalize_text import normalize_text
from tests.helpers.env import CASES, REPO
from tests.helpers.preprocess_corpus import snapshot as _snapshot
from tests.helpers.preprocess_corpus import texts as _texts
from tests.helpers.preprocess_corpus import (  # noqa: F401 (module-scoped fixtures)
    corpus, preprocess_module, tokenizer)

TOOL = REPO / "tools" / "preprocess_data.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=REPO)


def test_empty_documents_skipped_and_counted(tokenizer, tmp_path):
    proc = _run("--input", str(CASES / "empty_docs.jsonl"), "--tokenizer-model", tokenizer.model_path,
                "--output-prefix", str(tmp_path / "empty_docs"))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "done: 2 documents written, 4 empty documents skipped, 0 bad lines skipped" in proc.stdout
    dataset = tmp_path / "empty_docs_text_document"  # Megatron-LM's naming
    assert f"--data-path {dataset}    # text: 2 documents" in proc.stdout
    prefix = tmp_path / "empty_docs_text_document_00000"  # its one shard
    ds = open_shard(prefix)
    assert len(ds) == 2 and ds.document_indices.tolist() == [0, 1, 2]
    non_empty = [t for t in _texts(CASES / "empty_docs.jsonl") if normalize_text(t)]
    assert [ds[i].tolist() for i in range(2)] == [tokenizer.encode(t) for t in non_empty]
    meta = read_shard_meta(prefix)
    assert (meta["documents"], meta["empty_documents_skipped"], meta["vocab_size"], meta["dtype"]) == (2, 4, 400, "uint16")
    assert meta["tokens"] == sum(len(tokenizer.encode(t)) for t in non_empty)
    assert meta["tokenizer_model_sha256"] == tokenizer.sha256
    manifest = read_manifest(dataset)
    assert (manifest["documents"], manifest["empty_documents_skipped"], manifest["shards"]) == (2, 4, [str(prefix)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "empty_docs_text_document.manifest.json", "empty_docs_text_document_00000.bin",
        "empty_docs_text_document_00000.idx", "empty_docs_text_document_00000.meta.json"]


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
    no_space_run = _texts(CASES / "no_space_70k.jsonl")[1]
    assert tokenizer.decode(ds[docs.index(no_space_run)]) == no_space_run


def test_byte_order_marks_with_two_workers(tokenizer, tmp_path, preprocess_module, capsys):
    """The concatenated file (a UTF-8 byte-order mark before lines 1 and 4) through the worker
    processes: the same six documents and bytes as one process, the note printed once."""
    args = ["--input", str(CASES / "c41_bom_concat.jsonl"), "--tokenizer-model", tokenizer.model_path]
    assert run_cli(preprocess_module.main, [*args, "--output-prefix", str(tmp_path / "w1" / "o")]) == 0
    proc = _run(*args, "--output-prefix", str(tmp_path / "w2" / "o"), "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("note: read 2 UTF-8 byte-order mark(s) (U+FEFF)") == 1
    assert "done: 6 documents written, 0 empty documents skipped, 0 bad lines skipped," in proc.stdout
    assert _snapshot(tmp_path / "w1") == _snapshot(tmp_path / "w2")


def test_existing_dataset_is_kept_unless_resume_or_overwrite(tokenizer, tmp_path, preprocess_module, capsys):
    good = run_cli(preprocess_module.main, ["--input", str(CASES / "empty_docs.jsonl"), "--tokenizer-model",
                                            tokenizer.model_path, "--output-prefix", str(tmp_path / "out")])
    assert good == 0
    before = _snapshot(tmp_path)

    proc = _run("--input", str(CASES / "malformed.jsonl"), "--tokenizer-model", tokenizer.model_path,
                "--output-prefix", str(tmp_path / "out"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr == (f"error: --output-prefix: {tmp_path / 'out_text_document'} already holds a dataset "
                           "(1 shard(s)); pass --resume to finish or keep it, --overwrite to replace it, or "
                           "choose another --output-prefix\n")
    assert _snapshot(tmp_path) == before  # same files, same bytes, no temporaries left

    # --resume on a complete dataset does nothing; with other inputs it refuses, naming the flag
    capsys.readouterr()
    args = ["--tokenizer-model", tokenizer.model_path, "--output-prefix", str(tmp_path / "out"), "--resume"]
    assert run_cli(preprocess_module.main, ["--input", str(CASES / "empty_docs.jsonl"), *args]) == 0
    assert capsys.readouterr().out.startswith("nothing to do: ")
    assert run_cli(preprocess_module.main, ["--input", str(CASES / "single_sentence_docs.jsonl"), *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --resume: shard {tmp_path / 'out_text_document_00000'} was written with other "
                          "arguments: --input differs") and err.count("\n") == 1
    assert _snapshot(tmp_path) == before

    # --overwrite replaces it
    assert run_cli(preprocess_module.main, ["--input", str(CASES / "single_sentence_docs.jsonl"), "--tokenizer-model",
                                            tokenizer.model_path, "--output-prefix", str(tmp_path / "out"),
                                            "--overwrite"]) == 0
    assert read_manifest(tmp_path / "out_text_document")["documents"] == 300


def test_missing_input_one_line_error(tokenizer, tmp_path):
    proc = _run("--input", str(tmp_path / "nope.jsonl"), "--tokenizer-model", tokenizer.model_path,
                "--output-prefix", str(tmp_path / "x"))
    assert proc.returncode == 1
    assert proc.stderr == f"error: input file not found: {tmp_path / 'nope.jsonl'}\n"
    assert list(tmp_path.iterdir()) == []
