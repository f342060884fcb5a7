"""Preprocessing into megatron-core shards: empty documents, round trip, worker-count
independence, dtype choice around 16 bits, malformed input, atomic outputs, and the
tokenizer check.

tools/preprocess_data.py's main() is called in-process; the cases where the real CLI's exit
status and stderr matter, and its worker processes, are in tests/tools/test_preprocess_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
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
from rtd_scale.data.tokenizer import Tokenizer
from rtd_scale.data.tokenizer_training import train_tokenizer
from tests.helpers.env import CASES
from tests.helpers.preprocess_corpus import texts as _texts
from tests.helpers.preprocess_corpus import (  # noqa: F401 (module-scoped fixtures)
    corpus, preprocess_module, tokenizer)


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


def test_malformed_new_prefix_writes_nothing(tokenizer, tmp_path, preprocess_module, capsys):
    status = run_cli(preprocess_module.main, ["--input", str(CASES / "malformed.jsonl"), "--tokenizer-model",
                                              tokenizer.model_path, "--output-prefix", str(tmp_path / "new" / "m")])
    assert status == 1
    assert ":2: invalid JSON" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # not even the output directory


def test_skip_bad_lines_counts(tokenizer, tmp_path, preprocess_module, capsys):
    status = run_cli(preprocess_module.main, ["--input", str(CASES / "malformed.jsonl"), "--tokenizer-model",
                                              tokenizer.model_path, "--output-prefix", str(tmp_path / "m"), "--skip-bad-lines"])
    out = capsys.readouterr().out
    assert status == 0
    assert "done: 2 documents written, 0 empty documents skipped, 3 bad lines skipped (first: " in out
    assert len(open_shard(tmp_path / "m_text_document_00000")) == 2


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


def _utf8_sig_texts(path: Path) -> list[str]:
    """Each line's ``text``, every line decoded as Python's utf-8-sig does (a leading byte-order
    mark read as nothing): what HF ``datasets`` gives for a file with one mark at its start."""
    return [json.loads(raw.decode("utf-8-sig"))["text"] for raw in path.read_bytes().splitlines()
            if raw.strip()]


def test_byte_order_marks_are_read_as_nothing(tmp_path):
    """A UTF-8 byte-order mark at the start of a file, or of a line (files joined with cat),
    is no character of the text, in every line-read format, counted for the one log line;
    before, line 1 of each part was invalid JSON ("decode using utf-8-sig"). A UTF-16 file
    is named as such."""
    import gzip

    from rtd_scale.data.text import parse_line_block, read_line_range

    one, two = CASES / "c41_bom.jsonl", CASES / "c41_bom_concat.jsonl"
    assert one.read_bytes().startswith(b"\xef\xbb\xbf") and two.read_bytes().count(b"\n\xef\xbb\xbf") == 1
    for path, marks in ((one, 1), (two, 2)):
        stats = ReadStats()
        assert [t for (t,) in iter_records([path], ["text"], stats=stats)] == _utf8_sig_texts(path)
        assert (stats.records, stats.boms, stats.first_bom) == (3 * marks, marks, f"{path}:1")
    assert len(set(_utf8_sig_texts(two))) == 3 and not any("\ufeff" in t for t in _utf8_sig_texts(two))
    assert stats.bom_note() == ("note: read 2 UTF-8 byte-order mark(s) (U+FEFF) at the start of a "
                                f"file or line as nothing (first: {two}:1)")
    assert ReadStats().bom_note() is None

    # a preprocessing worker's byte range that starts at the second part (line 4)
    start = two.read_bytes().index(b"\n\xef\xbb\xbf") + 1
    parsed = parse_line_block(read_line_range(two, 0, start, start + 10, True), two, "jsonl", ["text"])
    parsed.shift_lines(3)
    assert (parsed.texts, parsed.lines, parsed.boms, parsed.first_bom_line) == (
        [(_utf8_sig_texts(two)[3],)], [4], 1, 4)

    bom = "\ufeff".encode()
    (tmp_path / "t.txt").write_bytes(bom + b"first\nsecond\n" + bom + b"third\n")
    (tmp_path / "a.json").write_bytes(bom + b'[{"text": "x"}, {"text": "y"}]')
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as f:
        f.write(two.read_bytes())
    for path, want, marks in ((tmp_path / "t.txt", ["first", "second", "third"], 2),
                              (tmp_path / "a.json", ["x", "y"], 1),
                              (tmp_path / "c.jsonl.gz", _utf8_sig_texts(two), 2)):
        stats = ReadStats()
        assert [t for (t,) in iter_records([path], ["text"], stats=stats)] == want, path
        assert stats.boms == marks, path

    (tmp_path / "u16.jsonl").write_bytes('{"text": "a"}\n'.encode("utf-16"))
    with pytest.raises(BadLineError) as e:
        list(iter_records([tmp_path / "u16.jsonl"], ["text"]))
    assert str(e.value) == (f"{tmp_path / 'u16.jsonl'}:1: UTF-16 text (its byte-order mark 0xff "
                            "0xfe), not UTF-8; save the file as UTF-8")


def test_preprocess_reads_every_document_after_a_byte_order_mark(tokenizer, tmp_path, preprocess_module,
                                                                 capsys):
    """tools/preprocess_data.py on the concatenated file: all six documents, the note once.
    With --workers 2: tests/tools/test_preprocess_cli.py::test_byte_order_marks_with_two_workers."""
    path = CASES / "c41_bom_concat.jsonl"
    assert run_cli(preprocess_module.main, ["--input", str(path), "--tokenizer-model", tokenizer.model_path,
                                            "--output-prefix", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.count("note: read 2 UTF-8 byte-order mark(s) (U+FEFF) at the start of a file or "
                     f"line as nothing (first: {path}:1)\n") == 1
    assert "done: 6 documents written, 0 empty documents skipped, 0 bad lines skipped," in out
    ds = open_shard(tmp_path / "b_text_document_00000")
    assert [ds[i].tolist() for i in range(len(ds))] == [tokenizer.encode(t) for t in _utf8_sig_texts(path)]


# -- shards and the tokenizer they were made with --------------------------------------------------


def test_check_tokenizer_matches(corpus, tokenizer, tmp_path):
    prefix = tmp_path / "s"
    with ShardWriter(prefix, vocab_size=tokenizer.vocab_size, tokenizer_model=tokenizer.model_path) as w:
        for text in _texts(CASES / "single_sentence_docs.jsonl"):
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
    max_id = max(max(tokenizer.encode(t)) for t in _texts(CASES / "single_sentence_docs.jsonl"))
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
