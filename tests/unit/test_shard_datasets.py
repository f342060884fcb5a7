"""Datasets of several shards: resumable reading positions, size-cut shards, --resume after a
simulated crash giving byte-identical output, merging, and how a --data-path entry resolves to
shards. A real SIGKILL of the tool and its workers is in tests/tools/test_preprocess_sigkill.py."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rtd_scale.cli_errors import UserInputError, run_cli
from rtd_scale.data.shards import ShardWriter, open_shard, read_manifest, read_shard_meta, resolve_data_path
from rtd_scale.data.text import Position, iter_positioned_records
from tests.helpers.env import TEST_DATA
from tests.helpers.tools import load_tool

WIKI = TEST_DATA / "wiki_sample.jsonl"


@pytest.fixture(scope="module")
def tools():
    return load_tool("preprocess_data"), load_tool("merge_datasets")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _preprocess(tools, tok: str, inputs, prefix: Path, *extra: str) -> None:
    argv = ["--input", *map(str, inputs), "--tokenizer-model", tok, "--output-prefix", str(prefix), *extra]
    assert run_cli(tools[0].main, argv) == 0


# -- reading positions -------------------------------------------------------------------------


def _write_formats(tmp_path: Path) -> list[Path]:
    lines = WIKI.read_bytes().splitlines(keepends=True)[:40]
    lines.insert(7, b'{"text": broken\n')  # a bad line, skipped and counted
    raw = b"".join(lines)
    out = [tmp_path / "w.jsonl", tmp_path / "w.jsonl.gz", tmp_path / "w.jsonl.xz", tmp_path / "w.jsonl.bz2"]
    out[0].write_bytes(raw)
    for path, module in zip(out[1:], (gzip, lzma, bz2)):
        path.write_bytes(module.compress(raw))
    texts = [json.loads(x)["text"] for x in lines if b"broken" not in x]
    (tmp_path / "w.txt").write_text("\n".join(t.replace("\n", " ") for t in texts[:25]) + "\n", encoding="utf-8")
    (tmp_path / "w.json").write_text(json.dumps([{"text": t} for t in texts[:25]]), encoding="utf-8")
    pq.write_table(pa.table({"text": texts[:25]}), tmp_path / "w.parquet", row_group_size=4)
    return out + [tmp_path / "w.txt", tmp_path / "w.json", tmp_path / "w.parquet"]


def test_reading_resumes_exactly_after_any_record_in_every_format(tmp_path):
    paths = _write_formats(tmp_path)
    everything = list(iter_positioned_records(paths, ["text"], skip_bad_lines=True))
    assert len(everything) == 4 * 40 + 3 * 25
    assert everything[6][0].bad_lines == 0 and everything[7][0].bad_lines == 1  # counted where it lies
    for i in (0, 6, 7, 39, 40, 100, 159, 160, 185, 209, len(everything) - 1):
        rest = list(iter_positioned_records(paths, ["text"], start=everything[i][0], skip_bad_lines=True))
        assert rest == everything[i + 1:], i
    # the compressed copies read exactly like the plain file, positions in decompressed bytes
    per_file = [[(p.offset, p.line, r) for p, r in everything if p.file == f] for f in range(4)]
    assert per_file[1] == per_file[2] == per_file[3] == per_file[0]
    assert Position.from_dict(everything[50][0].to_dict()) == everything[50][0]


# -- size-cut shards and --resume ----------------------------------------------------------------


def test_crash_then_resume_is_byte_identical_to_a_clean_run(tools, wiki_shards, tmp_path):
    tok, _ = wiki_shards
    xz = tmp_path / "wiki.jsonl.xz"  # compressed input: resuming seeks in the decompressed stream
    xz.write_bytes(lzma.compress(WIKI.read_bytes()))
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    args = ("--shard-size-mb", "0.015", "--workers", "1")
    _preprocess(tools, tok, [xz], clean / "x", *args)
    manifest = read_manifest(clean / "x_text_document")
    n = len(manifest["shards"])
    assert n >= 4 and manifest["documents"] == 402
    sizes = [os.path.getsize(s + ".bin") for s in manifest["shards"]]
    assert all(s >= 15_000 for s in sizes[:-1]) and sizes[-1] > 0  # cut once a shard reaches 15 kB

    # the state a crash leaves: complete shards 0 and 1, shard 2 without its .idx, a temporary
    shutil.copytree(clean, crashed)
    (crashed / "x_text_document.manifest.json").unlink()
    for i in range(3, n):
        for ext in ("bin", "idx", "meta.json"):
            (crashed / f"x_text_document_{i:05d}.{ext}").unlink()
    (crashed / "x_text_document_00002.idx").unlink()
    (crashed / ".x_text_document_00002.4242.beef.bin.tmp").write_bytes(b"\0" * 100)
    with pytest.raises(UserInputError, match="did not finish — re-run it with --resume"):
        resolve_data_path(crashed / "x_text_document")

    _preprocess(tools, tok, [xz], crashed / "x", *args, "--resume")
    assert _snapshot(crashed) == _snapshot(clean)
    assert resolve_data_path(crashed / "x_text_document") == [
        str(crashed / f"x_text_document_{i:05d}") for i in range(n)]


def test_resume_refuses_other_arguments(tools, wiki_shards, tmp_path, capsys):
    tok, _ = wiki_shards
    _preprocess(tools, tok, [WIKI], tmp_path / "x", "--shard-size-mb", "0.015")
    (tmp_path / "x_text_document.manifest.json").unlink()  # as if interrupted
    status = run_cli(tools[0].main, ["--input", str(WIKI), "--tokenizer-model", tok, "--output-prefix",
                                     str(tmp_path / "x"), "--shard-size-mb", "0.02", "--resume"])
    assert status == 1
    assert "was written with other arguments: --shard-size-mb differs (shard_size_bytes: was 15000, now 20000)" \
        in capsys.readouterr().err


# -- merging ------------------------------------------------------------------------------------


def test_merged_halves_equal_a_single_pass(tools, wiki_shards, tmp_path, capsys):
    tok, _ = wiki_shards
    lines = WIKI.read_bytes().splitlines(keepends=True)
    halves = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    halves[0].write_bytes(b"".join(lines[:201]))
    halves[1].write_bytes(b"".join(lines[201:]))
    _preprocess(tools, tok, [halves[0]], tmp_path / "a", "--shard-size-mb", "0.02")  # several shards each
    _preprocess(tools, tok, [halves[1]], tmp_path / "b", "--shard-size-mb", "0.02")
    _preprocess(tools, tok, halves, tmp_path / "single")  # one pass, one shard
    assert len(read_manifest(tmp_path / "a_text_document")["shards"]) > 1
    capsys.readouterr()
    assert run_cli(tools[1].main, ["--input", str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document"),
                                   "--output-prefix", str(tmp_path / "merged")]) == 0
    assert "merged " in capsys.readouterr().out

    single, merged = open_shard(tmp_path / "single_text_document_00000"), open_shard(tmp_path / "merged")
    assert len(merged) == len(single) == 402
    assert merged.document_indices.tolist() == single.document_indices.tolist() == list(range(403))
    for i in range(402):
        assert np.array_equal(merged[i], single[i]), i
    for ext in (".bin", ".idx"):  # the same bytes, too
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"single_text_document_00000{ext}").read_bytes()
    meta = read_shard_meta(tmp_path / "merged")
    assert (meta["documents"], meta["tokens"]) == (402, int(single.sequence_lengths.sum()))
    assert meta["tokenizer_model_sha256"] == read_manifest(tmp_path / "single_text_document")["tokenizer_model_sha256"]
    assert resolve_data_path(tmp_path / "merged") == [str(tmp_path / "merged")]


def test_merge_keeps_megatron_sentence_documents_and_refuses_mixed_tokenizers(tools, tmp_path, capsys):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    # a shard as Megatron-LM's preprocess_data.py --split-sentences writes it: no sidecar,
    # several sequences (sentences) per document
    builder = IndexedDatasetBuilder(str(tmp_path / "mlm.bin"), dtype=np.uint16)
    builder.add_document(torch.tensor([5, 6, 7, 8, 9]), [2, 3])
    builder.add_document(torch.tensor([10, 11]), [2])
    builder.finalize(str(tmp_path / "mlm.idx"))
    with ShardWriter(tmp_path / "ours", vocab_size=100) as w:
        w.add_document([12, 13, 14])
    assert run_cli(tools[1].main, ["--input", str(tmp_path / "mlm"), str(tmp_path / "ours"),
                                   "--output-prefix", str(tmp_path / "m")]) == 0
    m = open_shard(tmp_path / "m")
    assert m.sequence_lengths.tolist() == [2, 3, 2, 3] and m.document_indices.tolist() == [0, 2, 3, 4]
    assert [m[i].tolist() for i in range(4)] == [[5, 6], [7, 8, 9], [10, 11], [12, 13, 14]]

    with ShardWriter(tmp_path / "other", vocab_size=200) as w:
        w.add_document([1, 2])
    capsys.readouterr()
    assert run_cli(tools[1].main, ["--input", str(tmp_path / "ours"), str(tmp_path / "other"),
                                   "--output-prefix", str(tmp_path / "bad")]) == 1
    err = capsys.readouterr().err
    assert "were made with different tokenizers" in err and err.count("\n") == 1
    assert not list(tmp_path.glob("bad*")) and not list(tmp_path.glob(".bad*"))
    assert run_cli(tools[1].main, ["--input", str(tmp_path / "ours"), "--output-prefix", str(tmp_path / "m")]) == 1
    assert "m.idx already exists; pass --overwrite" in capsys.readouterr().err


# -- --data-path entries -------------------------------------------------------------------------


def test_resolve_data_path_errors_name_the_fix(tmp_path):
    with pytest.raises(UserInputError, match=r"pass the prefix without the \.idx suffix"):
        resolve_data_path(tmp_path / "x.idx")
    with pytest.raises(UserInputError, match="neither a shard .* nor a dataset manifest .* exists; pass the prefix"):
        resolve_data_path(tmp_path / "x")
    with ShardWriter(tmp_path / "x", vocab_size=10) as w:
        w.add_document([1])
    (tmp_path / "x.manifest.json").write_text(json.dumps({"shards": ["x"]}))
    with pytest.raises(UserInputError, match="both a shard .* and a dataset manifest .* exist"):
        resolve_data_path(tmp_path / "x")
    (tmp_path / "y.manifest.json").write_text(json.dumps({"shards": ["y_00000"]}))
    with pytest.raises(UserInputError, match="shard .*y_00000 listed in .* is incomplete.*--resume"):
        resolve_data_path(tmp_path / "y")
    (tmp_path / "z.manifest.json").write_text("{")
    with pytest.raises(UserInputError, match="is not valid JSON"):
        resolve_data_path(tmp_path / "z")


@pytest.mark.parametrize("dtype, vocab", [(np.uint16, 65_536), (np.int32, 128_100)])
def test_our_writer_is_byte_identical_to_megatron_core_builder(tmp_path, dtype, vocab):
    """ShardWriter writes megatron-core's format itself (no torch import in preprocessing);
    its .bin/.idx must equal IndexedDatasetBuilder's, byte for byte, and load with IndexedDataset."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, vocab, size=int(n)) for n in rng.integers(1, 300, size=50)]
    builder = IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=dtype)
    with ShardWriter(tmp_path / "ours", vocab_size=vocab) as w:
        for d in docs[:20]:
            builder.add_document(torch.tensor(d), [len(d)])
            assert w.add_document(d)
        w.add_document([])  # empty: counted, not written
        lengths = np.array([len(d) for d in docs[20:]] + [0])
        w.add_documents(np.concatenate(docs[20:]), lengths)  # the preprocessor's bulk path
        for d in docs[20:]:
            builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(str(tmp_path / "mc.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"mc{ext}").read_bytes(), ext
    assert read_shard_meta(tmp_path / "ours")["empty_documents_skipped"] == 2
    ds = open_shard(tmp_path / "ours")
    assert len(ds) == 50 and all(np.array_equal(ds[i], docs[i]) for i in range(50))


def test_worker_side_line_parsing_matches_the_record_reader(tmp_path):
    """The preprocessor ships whole-line byte blocks to its workers (parse_line_block); for any
    block size that gives the records, positions and bad lines of iter_positioned_records."""
    from rtd_scale.data.text import is_compressed, iter_line_blocks, line_format, parse_line_block, read_line_range

    paths = _write_formats(tmp_path)
    (tmp_path / "t2.txt").write_bytes(b"a\r\nb\n\nlast but one \xff\nno newline at the end")
    paths.append(tmp_path / "t2.txt")
    for path in paths:
        fmt = line_format(path)
        if fmt is None:  # parquet and JSON arrays are parsed by the reader itself
            assert path.suffix in (".parquet", ".json")
            continue
        expected = list(iter_positioned_records([path], ["text"], skip_bad_lines=True))
        for block_bytes in (7, 100, 1 << 20):
            got, bad = [], 0
            for block in iter_line_blocks(path, 0, 0, 0, block_bytes):
                parsed = parse_line_block(block, path, fmt, ["text"])
                got += [(Position(0, e, n, bad + b), t)
                        for t, e, n, b in zip(parsed.texts, parsed.ends, parsed.lines, parsed.bad_before)]
                bad += len(parsed.bad)
            assert got == expected, (path.name, block_bytes)
            if is_compressed(path):
                continue
            # uncompressed files: each worker reads its own byte range, numbering lines from it
            got, bad, base, size = [], 0, 0, path.stat().st_size
            for start in range(0, size, block_bytes):
                parsed = parse_line_block(read_line_range(path, 0, start, min(start + block_bytes, size), start == 0),
                                          path, fmt, ["text"])
                parsed.shift_lines(base)
                base += parsed.line_count
                got += [(Position(0, e, n, bad + b), t)
                        for t, e, n, b in zip(parsed.texts, parsed.ends, parsed.lines, parsed.bad_before)]
                bad += len(parsed.bad)
            assert got == expected, (path.name, block_bytes, "ranges")


def test_bad_line_keeps_complete_shards_then_skip_bad_lines_resume(tools, wiki_shards, tmp_path, capsys,
                                                                   monkeypatch):
    tok, _ = wiki_shards
    monkeypatch.setattr(tools[0], "_BLOCK_BYTES", 5000)  # many ranges: line numbers cross them
    lines = WIKI.read_bytes().splitlines(keepends=True)
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"".join(lines[:300]) + b'{"text": 7}\n' + b"".join(lines[300:]))
    args = ["--input", str(src), "--tokenizer-model", tok, "--shard-size-mb", "0.015", "--workers", "1"]
    assert run_cli(tools[0].main, [*args, "--output-prefix", str(tmp_path / "a" / "x")]) == 1
    err = capsys.readouterr().err
    assert f"{src}:301: key 'text' is int, expected a string" in err
    kept = len(list((tmp_path / "a").glob("x_text_document_*.idx")))
    assert kept >= 2 and f"the {kept} complete shard(s) before it are kept: add --skip-bad-lines --resume" in err
    assert not list((tmp_path / "a").glob(".*tmp"))  # nothing half-written
    assert run_cli(tools[0].main, [*args, "--output-prefix", str(tmp_path / "a" / "x"), "--skip-bad-lines",
                                   "--resume"]) == 0
    assert run_cli(tools[0].main, [*args, "--output-prefix", str(tmp_path / "b" / "x"), "--skip-bad-lines"]) == 0
    assert _snapshot(tmp_path / "a") == _snapshot(tmp_path / "b")
    manifest = read_manifest(tmp_path / "b" / "x_text_document")
    assert (manifest["documents"], manifest["bad_lines_skipped"]) == (402, 1)


# -- bad input found by a newcomer's review: one line naming the file or flag, nothing lost -------


def _error(tools, argv, capsys, tool=0) -> str:
    capsys.readouterr()
    assert run_cli(tools[tool].main, argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_broken_compressed_input_is_a_one_line_error(tools, wiki_shards, tmp_path, capsys):
    tok, _ = wiki_shards
    raw = WIKI.read_bytes()
    cases = {"trunc.jsonl.xz": lzma.compress(raw)[:30_000], "trunc.jsonl.gz": gzip.compress(raw)[:30_000],
             "trunc.jsonl.bz2": bz2.compress(raw)[:30_000], "plain.jsonl.xz": raw[:5000],
             "plain.jsonl.gz": raw[:5000], "plain.jsonl.bz2": raw[:5000]}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        err = _error(tools, ["--input", str(tmp_path / name), "--tokenizer-model", tok, "--output-prefix",
                             str(tmp_path / "out" / name)], capsys)
        suffix = name.rsplit(".", 1)[1]
        assert err.startswith(f"error: {tmp_path / name}: cannot decompress it as .{suffix} ("), err
        assert "re-create it, or rename it to its real format" in err
    assert not list((tmp_path / "out").glob(".*tmp")) if (tmp_path / "out").exists() else True


def test_flags_and_prefixes_that_cannot_work_are_refused(tools, wiki_shards, tmp_path, capsys):
    tok, _ = wiki_shards
    base = ["--input", str(WIKI), "--tokenizer-model", tok]
    for value in ("inf", "nan", "0", "-1"):
        err = _error(tools, [*base, "--output-prefix", str(tmp_path / "x"), "--shard-size-mb", value], capsys)
        assert "--shard-size-mb must be a positive number of megabytes" in err
    err = _error(tools, [*base, "--output-prefix", str(tmp_path) + "/"], capsys)
    assert "names a directory; give a file-name prefix inside it" in err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root can write anyway)
            err = _error(tools, [*base, "--output-prefix", str(locked / "x")], capsys)
            assert f"--output-prefix {locked / 'x'}: cannot write in {locked}" in err
    finally:
        locked.chmod(0o700)
    array = tmp_path / "a.json"
    array.write_text('[{"text": "a"}, {"text": "b"}', encoding="utf-8")  # missing bracket
    err = _error(tools, [*base[:1], str(array), *base[2:], "--output-prefix", str(tmp_path / "y")], capsys)
    assert f"{array}:1: invalid JSON" in err and "parsed as a whole" in err and "--skip-bad-lines" not in err


def test_overwrite_then_failure_says_the_old_dataset_is_gone(tools, wiki_shards, tmp_path, capsys):
    tok, _ = wiki_shards
    _preprocess(tools, tok, [WIKI], tmp_path / "x")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 1}\n', encoding="utf-8")
    err = _error(tools, ["--input", str(bad), "--tokenizer-model", tok, "--output-prefix", str(tmp_path / "x"),
                         "--overwrite"], capsys)
    assert "(nothing written; --overwrite had removed the previous dataset)" in err


def test_resume_matches_the_file_not_its_spelling_and_notices_edits(tools, wiki_shards, tmp_path,
                                                                    capsys, monkeypatch):
    tok, _ = wiki_shards
    src = tmp_path / "in.jsonl"
    src.write_bytes(WIKI.read_bytes())
    args = ["--tokenizer-model", tok, "--output-prefix", str(tmp_path / "x"), "--shard-size-mb", "0.015"]
    _preprocess(tools, tok, [src], tmp_path / "x", "--shard-size-mb", "0.015")
    (tmp_path / "x_text_document.manifest.json").unlink()  # as if interrupted
    monkeypatch.chdir(tmp_path)
    assert run_cli(tools[0].main, ["--input", "in.jsonl", *args, "--resume"]) == 0  # same file, other spelling
    (tmp_path / "x_text_document.manifest.json").unlink()
    data = bytearray(src.read_bytes())
    data[-2000:-1990] = data[-2000:-1990].upper()  # same size, same first MiB
    src.write_bytes(bytes(data))
    os.utime(src, ns=(time.time_ns(), time.time_ns() + 10**9))
    err = _error(tools, ["--input", str(src), *args, "--resume"], capsys)
    assert "was written with other arguments: --input differs" in err


def test_merge_refuses_outputs_that_would_clobber_or_confuse(tools, wiki_shards, tmp_path, capsys):
    tok, _ = wiki_shards
    _preprocess(tools, tok, [WIKI], tmp_path / "d" / "x", "--shard-size-mb", "0.05")
    (tmp_path / "link").symlink_to(tmp_path / "d")
    dataset = str(tmp_path / "d" / "x_text_document")
    err = _error(tools, ["--input", dataset, "--output-prefix", dataset], capsys, tool=1)
    assert "is a dataset (it has" in err
    err = _error(tools, ["--input", dataset + "_00000", "--output-prefix",
                         str(tmp_path / "link" / "x_text_document_00000"), "--overwrite"], capsys, tool=1)
    assert "is also an --input" in err
    err = _error(tools, ["--input", dataset + "_00000", "--output-prefix", dataset + "_00001", "--overwrite"],
                 capsys, tool=1)
    assert f"is a shard of the dataset {dataset}" in err
    err = _error(tools, ["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "m")], capsys, tool=1)
    assert err.startswith(f"error: --input {tmp_path / 'nope'}: neither a shard")
    assert read_manifest(tmp_path / "d" / "x_text_document")["documents"] == 402  # untouched
