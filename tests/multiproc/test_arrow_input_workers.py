"""Hugging Face `datasets` inputs through tools/preprocess_data.py with 2 spawned worker
processes: shards token for token equal to those of the same text as JSON lines."""
from __future__ import annotations



from rtd_scale.cli_errors import run_cli
from rtd_scale.data.shards import read_manifest
from tests.helpers.arrow_inputs import TEXTS
from tests.helpers.arrow_inputs import inputs, tool  # noqa: F401 (module-scoped fixtures)


def test_shards_equal_those_of_the_same_text_as_json_lines(tool, inputs, wiki_shards, tmp_path):
    # With torch imported the tool spawns its 2 workers, which must import their functions by
    # name: from this module-under-another-name they could not, and the pool respawned them
    # forever (a hang, not a failure)
    import torch  # noqa: F401
    tok, _ = wiki_shards
    for name in ("jsonl", "saved", "stream"):
        argv = ["--input", str(inputs[name]), "--tokenizer-model", tok, "--output-prefix",
                str(tmp_path / name / "x"), "--workers", "1" if name == "jsonl" else "2"]
        assert run_cli(tool.main, argv) == 0
    reference = {ext: (tmp_path / "jsonl" / f"x_text_document_00000.{ext}").read_bytes()
                 for ext in ("bin", "idx")}
    assert len(reference["bin"]) > 50_000
    for name in ("saved", "stream"):
        manifest = read_manifest(tmp_path / name / "x_text_document")
        assert manifest["documents"] == len(TEXTS) and len(manifest["shards"]) == 1
        for ext in ("bin", "idx"):
            assert (tmp_path / name / f"x_text_document_00000.{ext}").read_bytes() == reference[ext]
