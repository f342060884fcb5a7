#!/usr/bin/env python
"""Merge shards into one megatron-core shard (Megatron-LM's tools/merge_datasets.py, by prefix).

    python tools/merge_datasets.py --input data/part-00000_text_document data/part-00001_text_document \\
        --output-prefix data/all_text_document

Each --input is a --data-path entry: one shard (PREFIX.bin/.idx, also from Megatron-LM's own
preprocessing) or a dataset written by tools/preprocess_data.py (PREFIX.manifest.json and its
shards). The output OUTPUT.bin/.idx/.meta.json holds every document of every input, in the order
given, with document boundaries kept (megatron-core's IndexedDatasetBuilder.add_index); it reads
back exactly like a single-pass run over the concatenated corpus
(tests/unit/test_shard_datasets.py::test_merged_halves_equal_a_single_pass). Inputs must come from
the same tokenizer (checked through their sidecars) and share a dtype. The output is written under
temporary names and renamed when complete; on any error nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.cli_errors import (OneLineArgumentParser, UserInputError,  # noqa: E402
                                  exit_process, run_cli)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PREFIX",
                   help="shard or dataset prefixes (as passed to --data-path), merged in this order")
    p.add_argument("--output-prefix", required=True, help="writes OUTPUT.bin, OUTPUT.idx and OUTPUT.meta.json")
    p.add_argument("--overwrite", action="store_true", help="replace an existing shard at --output-prefix")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import numpy as np

    from rtd_scale.data import shards

    out = args.output_prefix
    if os.path.exists(out + ".idx") and not args.overwrite:
        raise UserInputError(f"--output-prefix {out}: {out}.idx already exists; pass --overwrite to "
                             "replace it or choose another prefix")
    if os.path.exists(out + shards.MANIFEST_SUFFIX):
        raise UserInputError(f"--output-prefix {out} is a dataset (it has {out}{shards.MANIFEST_SUFFIX}); "
                             "a shard there would make --data-path ambiguous: choose another prefix")
    sources = [s for prefix in args.input for s in shards.resolve_data_path(prefix, flag="--input")]
    if os.path.realpath(out) in {os.path.realpath(s) for s in sources}:
        raise UserInputError(f"--output-prefix {out} is also an --input; choose another output prefix")
    out_dir = os.path.dirname(os.path.abspath(out)) or "."
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        if name.endswith(shards.MANIFEST_SUFFIX):  # a shard of some dataset must not be replaced
            owner = os.path.join(out_dir, name[: -len(shards.MANIFEST_SUFFIX)])
            try:
                listed = shards.read_manifest(owner)["shards"]
            except UserInputError:
                continue
            if os.path.realpath(out) in {os.path.realpath(s) for s in listed}:
                raise UserInputError(f"--output-prefix {out} is a shard of the dataset {owner}; "
                                     "choose another prefix")
    metas = [(s, shards.read_shard_meta(s)) for s in sources]
    with_meta = [(s, m) for s, m in metas if m is not None]
    def tokenizer_of(meta: dict) -> tuple:
        return meta.get("vocab_size"), meta.get("tokenizer_model_sha256")

    for s, m in with_meta[1:]:
        s0, m0 = with_meta[0]
        if tokenizer_of(m) != tokenizer_of(m0):
            raise UserInputError(
                f"--input: {s0} and {s} were made with different tokenizers ({m0.get('tokenizer_model')}, "
                f"vocab {m0.get('vocab_size')} vs {m.get('tokenizer_model')}, vocab {m.get('vocab_size')}); "
                "merge only shards of one tokenizer")
    dtypes = {shards.read_index(shards.shard_paths(s)[1])[0] for s in sources}
    if len(dtypes) > 1:
        raise UserInputError(f"--input: the shards hold ids of different dtypes ({', '.join(sorted(d.name for d in dtypes))}); "
                             "shards of one tokenizer share a dtype")
    dtype = dtypes.pop()
    ref = with_meta[0][1] if with_meta else {}
    vocab_size = ref.get("vocab_size") or int(np.iinfo(dtype).max) + 1
    writer = shards.ShardWriter(out, vocab_size=vocab_size, tokenizer_model=None, dtype=dtype)
    try:
        for s in sources:
            writer.add_shard(s)
        writer.empty_documents_skipped = sum(m.get("empty_documents_skipped", 0) for _, m in with_meta)
        extra = {"tokenizer_model": ref.get("tokenizer_model"),
                 "tokenizer_model_sha256": ref.get("tokenizer_model_sha256"),
                 "merged_from": [os.path.relpath(s, os.path.dirname(os.path.abspath(out))) for s in sources]}
        meta = writer.commit(extra)
    except BaseException:
        writer.abort()
        raise
    print(f"merged {len(sources)} shard(s): {meta['documents']:,} documents, {meta['tokens']:,} tokens, "
          f"{dtype.name}")
    print(f"--data-path {out}")


if __name__ == "__main__":
    exit_process(run_cli(main))
