"""Hugging Face `datasets` inputs: a `save_to_disk` directory and bare `.arrow` files (IPC stream
and IPC file) are read row by row, resume after any row, give shards token for token equal to the
same text as JSON lines (with worker processes: tests/multiproc/test_arrow_input_workers.py),
survive a crash with --resume, and are refused in one line when they cannot work."""
from __future__ import annotations

import shutil

import datasets
import pytest

from rtd_scale.cli_errors import UserInputError, run_cli
from rtd_scale.data.shards import read_manifest, read_shard_meta
from rtd_scale.data.text import (Position, ReadStats, check_inputs, input_bytes, input_fingerprint,
                                 iter_positioned_records, iter_records)
from tests.helpers.arrow_inputs import TEXTS
from tests.helpers.arrow_inputs import inputs, tool  # noqa: F401 (module-scoped fixtures)


def test_rows_are_read_in_order_and_resume_after_any_row(inputs):
    paths = [inputs["saved"], inputs["stream"], inputs["file"]]
    assert len(list((inputs["saved"]).glob("*.arrow"))) == 3
    assert check_inputs(paths, ["text"]) == paths
    stats = ReadStats()
    everything = list(iter_positioned_records(paths, ["text"], stats=stats))
    assert [r for _, r in everything] == [(t,) for t in TEXTS] * 3
    assert [(p.file, p.offset, p.line) for p, _ in everything[:2]] == [(0, 1, 1), (0, 2, 2)]
    assert stats.bytes_read == sum(map(input_bytes, paths))
    for i in (0, 133, 134, 401, 402, 700, len(everything) - 2):
        rest = list(iter_positioned_records(paths, ["text"], start=everything[i][0]))
        assert rest == everything[i + 1:], i
    assert list(iter_records([inputs["saved"]], ["text", "text"]))[5] == (TEXTS[5], TEXTS[5])


def test_crash_then_resume_mid_dataset_is_byte_identical(tool, inputs, wiki_shards, tmp_path):
    tok, _ = wiki_shards
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    args = ["--input", str(inputs["saved"]), "--tokenizer-model", tok, "--shard-size-mb", "0.015",
            "--workers", "1"]
    assert run_cli(tool.main, [*args, "--output-prefix", str(clean / "x")]) == 0
    n = len(read_manifest(clean / "x_text_document")["shards"])
    assert n >= 4
    position = Position.from_dict(read_shard_meta(clean / "x_text_document_00001")["resume"]["position"])
    assert position.file == 0 and 0 < position.line < len(TEXTS)  # inside the one input
    shutil.copytree(clean, crashed)  # the state a crash leaves: shards 0 and 1 complete
    (crashed / "x_text_document.manifest.json").unlink()
    for i in range(2, n):
        for ext in ("bin", "idx", "meta.json"):
            (crashed / f"x_text_document_{i:05d}.{ext}").unlink()
    assert run_cli(tool.main, [*args, "--output-prefix", str(crashed / "x"), "--resume"]) == 0
    snapshot = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}  # noqa: E731
    assert snapshot(crashed) == snapshot(clean)

    # an edited dataset is noticed by --resume
    before = input_fingerprint(inputs["saved"])
    edited = tmp_path / "edited"
    shutil.copytree(inputs["saved"], edited)
    datasets.Dataset.from_dict({"text": TEXTS[:-1]}).save_to_disk(str(tmp_path / "other"))
    assert input_fingerprint(tmp_path / "other")["sha256_head_tail"] != before["sha256_head_tail"]
    assert input_fingerprint(edited)["sha256_head_tail"] == before["sha256_head_tail"]


def test_what_cannot_be_read_is_refused_in_one_line(inputs, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.arrow").write_bytes(inputs["stream"].read_bytes())
    with pytest.raises(UserInputError, match=r"plain is a directory but not a dataset saved by "
                       r"datasets' save_to_disk \(no readable state.json"):
        check_inputs([plain], ["text"])
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]}),
                          "validation": datasets.Dataset.from_dict({"text": ["b"]})}).save_to_disk(str(dd))
    with pytest.raises(UserInputError, match=r"a DatasetDict saved by datasets \(splits: train, "
                       r"validation\); pass one split's directory as --input, e\.g\. .*dd/train"):
        check_inputs([dd], ["text"])
    assert list(iter_records([dd / "train"], ["text"])) == [("a",)]
    with pytest.raises(UserInputError, match=r"saved: missing column 'body' \(columns: id, text\); "
                       "choose it with --json-keys"):
        list(iter_records([inputs["saved"]], ["body"]))
    broken = tmp_path / "broken.arrow"
    broken.write_bytes(b"not arrow at all" * 10)
    with pytest.raises(UserInputError, match=r"broken\.arrow: not a readable Arrow IPC stream or file"):
        list(iter_records([broken], ["text"]))
    with pytest.raises(UserInputError, match=r"\.arrow\.gz: arrow is not read through a decompressor"):
        check_inputs([shutil.copy(inputs["stream"], tmp_path / "s.arrow.gz")], ["text"])
    nulls = tmp_path / "nulls"
    datasets.Dataset.from_dict({"text": ["one", None, "three"]}).save_to_disk(str(nulls))
    stats = ReadStats()
    assert list(iter_records([nulls], ["text"], skip_bad_lines=True, stats=stats)) == [("one",), ("three",)]
    assert str(stats.bad_examples[0]) == f"{nulls}: row 2: key 'text' is null, expected a string"
