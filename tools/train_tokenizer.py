#!/usr/bin/env python
"""Train the project's SentencePiece tokenizer (fixed special ids [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4).

    python tools/train_tokenizer.py --input data/sample/corpus.jsonl --output-prefix data/sample/spm

Inputs are .jsonl / .json / .parquet / .txt (rtd_scale.data.text); every --json-keys field of every
record is one document. Documents are normalised (rtd_scale.data.tokenizer.normalize_text) and cut
into sentences of at most --max-sentence-length bytes, so long lines and space-free runs train
instead of being dropped by SentencePiece. Writes PREFIX.model and PREFIX.vocab atomically.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.cli_errors import UserInputError, run_cli  # noqa: E402
from rtd_scale.data.text import BadLineError, ReadStats, check_inputs, iter_records  # noqa: E402
from rtd_scale.data.tokenizer import DEFAULT_MAX_SENTENCE_BYTES, MODEL_TYPES, train_tokenizer  # noqa: E402


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="corpus files (.jsonl .json .parquet .txt)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY", help="fields holding text (default: text)")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=8000, help="pieces, special pieces included (default 8000)")
    p.add_argument("--model-type", choices=MODEL_TYPES, default="unigram", help="default unigram")
    p.add_argument("--max-sentence-length", type=int, default=DEFAULT_MAX_SENTENCE_BYTES, metavar="BYTES",
                   help=f"longest training sentence in UTF-8 bytes; longer text is split (default {DEFAULT_MAX_SENTENCE_BYTES})")
    p.add_argument("--input-sentence-size", type=int, default=2_000_000, metavar="N",
                   help="train on a seeded uniform sample of at most N sentences; 0 = all (default 2,000,000)")
    p.add_argument("--character-coverage", type=float, default=0.9995, help="default 0.9995")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="trainer threads (default: all CPUs)")
    p.add_argument("--byte-fallback", action="store_true",
                   help="add 256 byte pieces so rare characters become bytes instead of [UNK]")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines instead of stopping")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's own log")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    paths = check_inputs(args.input, args.json_keys)
    stats = ReadStats()

    def documents():
        for record in iter_records(paths, args.json_keys, skip_bad_lines=args.skip_bad_lines, stats=stats):
            yield from record

    try:
        summary = train_tokenizer(
            documents(),
            args.output_prefix,
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            max_sentence_bytes=args.max_sentence_length,
            input_sentence_size=args.input_sentence_size,
            character_coverage=args.character_coverage,
            seed=args.seed,
            num_threads=args.num_threads,
            byte_fallback=args.byte_fallback,
            verbose=args.verbose,
        )
    except BadLineError as e:
        raise UserInputError(f"{e}; pass --skip-bad-lines to skip and count malformed lines") from None
    except ValueError as e:  # invalid settings from train_tokenizer's checks
        raise UserInputError(str(e)) from None
    print(
        f"trained {summary.model_type} tokenizer, vocab {summary.vocab_size:,}, on {summary.documents:,} documents "
        f"({summary.empty_documents:,} empty skipped, {stats.bad_lines_summary()}); "
        f"{summary.sentences_fed:,} of {summary.sentences:,} sentences fed; {summary.seconds:.1f} s -> {summary.model_path}"
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))
