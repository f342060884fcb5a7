#!/usr/bin/env python
"""Tokenize a corpus into megatron-core .bin/.idx shards (Megatron-LM's flag names and output names).

    python tools/preprocess_data.py --input data/sample/corpus.jsonl \\
        --tokenizer-model data/sample/spm.model --output-prefix data/sample/corpus --workers 2

For each --json-keys KEY this writes {output_prefix}_{KEY}_document.{bin,idx} (Megatron-LM's naming,
one document per entry, no [CLS]/[SEP] added) plus a .meta.json sidecar naming the tokenizer, and
prints the prefix to pass as --data-path. Documents empty after normalisation are skipped and
counted. Outputs appear only when complete: on any error nothing is written and existing shards at
the prefix are left as they were.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from rtd_scale.cli_errors import UserInputError, run_cli  # noqa: E402
from rtd_scale.data.text import BadLineError, ReadStats, check_inputs, iter_records  # noqa: E402
from rtd_scale.data.tokenizer import Tokenizer  # noqa: E402

_BATCH_RECORDS = 512  # records per task sent to a worker
_BATCH_CHARS = 4 << 20  # ... or fewer if they hold this many characters


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE", help="corpus files (.jsonl .json .parquet .txt)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="fields to tokenize, one shard per key (default: text)")
    p.add_argument("--tokenizer-model", required=True, help="SentencePiece .model from tools/train_tokenizer.py")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{KEY}_document.{bin,idx,meta.json}")
    p.add_argument("--workers", type=int, default=1, help="encoding processes (default 1)")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines instead of stopping")
    p.add_argument("--log-interval", type=int, default=10000, metavar="DOCS",
                   help="progress line every DOCS documents when stderr is not a terminal (default 10000)")
    return p.parse_args(argv)


# -- encoding, in this process or in spawned workers ------------------------------------------

_worker_tokenizer: Tokenizer | None = None  # set once per worker process by _init_worker


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _encode_batch_in_worker(batch: list[tuple[str, ...]]) -> list[tuple[np.ndarray, ...]]:
    assert _worker_tokenizer is not None
    return _encode_batch(_worker_tokenizer, batch)


def _encode_batch(tokenizer: Tokenizer, batch: list[tuple[str, ...]]) -> list[tuple[np.ndarray, ...]]:
    """[records][keys] texts -> [records][keys] int32 id arrays (empty for an empty document)."""
    width = len(batch[0])
    flat = tokenizer.encode_batch([text for record in batch for text in record])
    arrays = [np.asarray(ids, dtype=np.int32) for ids in flat]
    return [tuple(arrays[i : i + width]) for i in range(0, len(arrays), width)]


def _batches(records: Iterable[tuple[str, ...]]) -> Iterator[list[tuple[str, ...]]]:
    batch: list[tuple[str, ...]] = []
    chars = 0
    for record in records:
        batch.append(record)
        chars += sum(len(t) for t in record)
        if len(batch) >= _BATCH_RECORDS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded(
    batches: Iterator[list[tuple[str, ...]]], tokenizer: Tokenizer, pool, workers: int
) -> Iterator[list[tuple[np.ndarray, ...]]]:
    """Encoded batches in input order. With a pool, at most 2 x workers batches are in flight,
    so memory stays bounded however large the input (Pool.imap would read ahead without limit)."""
    if pool is None:
        for batch in batches:
            yield _encode_batch(tokenizer, batch)
        return
    pending: collections.deque = collections.deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_batch_in_worker, (batch,)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# -- main ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.workers < 1:
        raise UserInputError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        raise UserInputError(f"--log-interval must be >= 1, got {args.log_interval}")
    paths = check_inputs(args.input, args.json_keys)
    tokenizer = Tokenizer(args.tokenizer_model)
    keys = list(dict.fromkeys(args.json_keys))
    prefixes = {key: f"{args.output_prefix}_{key}_document" for key in keys}
    out_dir = Path(prefixes[keys[0]]).resolve().parent
    out_dir_existed = out_dir.exists()
    total_bytes = sum(p.stat().st_size for p in paths)

    # Workers are spawned before megatron-core (and torch) is imported by ShardWriter.
    pool = (
        multiprocessing.get_context("spawn").Pool(args.workers, initializer=_init_worker, initargs=(tokenizer,))
        if args.workers > 1
        else None
    )
    from rtd_scale.data.shards import ShardWriter

    from tqdm import tqdm

    stats = ReadStats()
    writers: dict[str, ShardWriter] = {}
    try:
        for key, prefix in prefixes.items():
            writers[key] = ShardWriter(prefix, vocab_size=tokenizer.vocab_size, tokenizer_model=args.tokenizer_model)
        start = time.perf_counter()
        records = iter_records(paths, keys, skip_bad_lines=args.skip_bad_lines, stats=stats)
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr,
                   disable=not sys.stderr.isatty())
        shown_bytes, next_log = 0, args.log_interval
        with bar:
            for encoded in _encoded(_batches(records), tokenizer, pool, args.workers):
                for record_ids in encoded:
                    for key, ids in zip(keys, record_ids):
                        writers[key].add_document(ids)
                bar.update(stats.bytes_read - shown_bytes)
                shown_bytes = stats.bytes_read
                if bar.disable and stats.records >= next_log:
                    next_log = (stats.records // args.log_interval + 1) * args.log_interval
                    print(f"processed {stats.records:,} records, {_rate(stats.bytes_read, start)}", file=sys.stderr)
        if all(w.documents == 0 for w in writers.values()):
            raise UserInputError(
                f"no non-empty documents in {', '.join(map(str, paths))} (read {stats.records:,} records, "
                f"{stats.bad_lines_summary()}); nothing written"
            )
        for w in writers.values():
            w.commit()
        seconds = time.perf_counter() - start
    except BadLineError as e:
        _abort(writers, out_dir, out_dir_existed)
        raise UserInputError(f"{e}; pass --skip-bad-lines to skip and count malformed lines; nothing written") from None
    except BaseException:
        _abort(writers, out_dir, out_dir_existed)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    documents = sum(w.documents for w in writers.values())
    empty = sum(w.empty_documents_skipped for w in writers.values())
    tokens = sum(w.tokens for w in writers.values())
    print(
        f"done: {documents:,} documents written, {empty:,} empty documents skipped, "
        f"{stats.bad_lines_summary()}, {tokens:,} tokens; "
        f"{stats.bytes_read / 1e6:.2f} MB in {seconds:.2f} s ({stats.bytes_read / 1e6 / max(seconds, 1e-9):.2f} MB/s)"
    )
    for key, w in writers.items():
        print(f"--data-path {w.prefix}    # {key}: {w.documents:,} documents, {w.tokens:,} tokens, {w.dtype.name}")


def _rate(nbytes: int, start: float) -> str:
    seconds = time.perf_counter() - start
    return f"{nbytes / 1e6:.1f} MB in {seconds:.1f} s ({nbytes / 1e6 / max(seconds, 1e-9):.2f} MB/s)"


def _abort(writers: dict, out_dir: Path, out_dir_existed: bool) -> None:
    for w in writers.values():
        w.abort()
    if not out_dir_existed:
        try:
            out_dir.rmdir()  # only if we created it and it is still empty
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(run_cli(main))
