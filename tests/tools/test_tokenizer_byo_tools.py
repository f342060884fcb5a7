"""Bring your own tokenizer through the commands: tools/add_special_pieces.py appends <pad> and
<mask> (and refuses a model that has them), and tools/preprocess_data.py's shards of a foreign
tokenizer's ids pack as the pipeline reads them."""
from __future__ import annotations

import subprocess
import sys

import pytest

from rtd_scale.data import tokenizer as tokmod
from rtd_scale.data.tokenizer import Tokenizer
from tests.helpers import byo_tokenizers as byo
from tests.helpers.env import REPO


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """layout -> the file to pass as --tokenizer-model."""
    return byo.every_layout(tmp_path_factory.mktemp("byo"))


def test_add_special_pieces_tool(tokenizers, tmp_path):
    tool = [sys.executable, str(REPO / "tools" / "add_special_pieces.py")]
    out = tmp_path / "x.model"
    r = subprocess.run([*tool, "--input", tokenizers["default_layout"], "--output", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"appended <pad> = 600, <mask> = 601 -> {out}"
    r = subprocess.run([*tool, "--input", str(out), "--output", str(tmp_path / "y.model")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: --input {out} already has pad, cls, sep and mask pieces; nothing to add"]


@pytest.mark.parametrize("layout", ["deberta_v3", "wordpiece_vocab"])
def test_preprocess_and_pack_with_the_tokenizers_ids(tokenizers, layout, tmp_path):
    import json

    import numpy as np

    from rtd_scale.data.blend import build_split
    from rtd_scale.data.packed import PackedDataset
    from rtd_scale.data.shards import check_tokenizer_matches, open_shard, read_shard_meta, resolve_data_path

    tok = Tokenizer(tokenizers[layout])
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in byo.wiki_texts(12)), encoding="utf-8")
    r = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus),
                        "--tokenizer-model", tokenizers[layout], "--output-prefix", str(tmp_path / "d")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    dataset = str(tmp_path / "d_text_document")
    shard = resolve_data_path(dataset)[0]
    meta = read_shard_meta(shard)
    assert meta["tokenizer_model_sha256"] == tokmod.file_sha256(tokenizers[layout]) == tok.sha256
    assert meta["vocab_size"] == tok.vocab_size
    check_tokenizer_matches(shard, tokenizers[layout], tok.vocab_size)
    raw = open_shard(shard)
    assert [list(map(int, raw[i])) for i in range(len(raw))] == [tok.encode(t) for t in byo.wiki_texts(12)]

    ds = PackedDataset([dataset], seq_length=64, cache_dir=str(tmp_path / "cache"), specials=tok.specials)
    stream = [i for t in byo.wiki_texts(12) for i in [*tok.encode(t), tok.sep_id]]
    assert np.concatenate([ds.content(i) for i in range(len(ds))]).tolist() == stream
    first, last = ds[0], ds[len(ds) - 1]
    assert first[0] == tok.cls_id and first[-1] == tok.sep_id and first[1:-1].tolist() == stream[:62]
    tail = stream[62 * (len(ds) - 1):]
    assert last.tolist() == [tok.cls_id, *tail, tok.sep_id] + [tok.pad_id] * (62 - len(tail))
    default = PackedDataset([dataset], seq_length=64, cache_dir=str(tmp_path / "cache"))
    # the cache is keyed by the special ids: DeBERTaV3's [CLS] 1 [SEP] 2 [PAD] 0 are the default's
    assert (default._index_key != ds._index_key) == ((tok.cls_id, tok.sep_id, tok.pad_id) != (1, 2, 0))
    blended = build_split([(1.0, [dataset])], seq_length=64, split=(1,), part=0, seed=0,
                          cache_path=str(tmp_path / "cache"), specials=tok.specials)
    assert blended.datasets[0][0].tolist() == first.tolist()
