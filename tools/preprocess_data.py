#!/usr/bin/env python
"""Tokenize a corpus into megatron-core .bin/.idx shards, streaming, resumable (Megatron-LM's flag names).

    python tools/preprocess_data.py --input data/sample/corpus.jsonl \\
        --tokenizer-model data/sample/spm.model --output-prefix data/sample/corpus --workers 2

For each --json-keys KEY this writes the dataset D = {output_prefix}_{KEY}_document (Megatron-LM's
naming; one document per entry, no [CLS]/[SEP] added):

- shards D_00000, D_00001, … (.bin, .idx and a .meta.json sidecar each), a new one started when
  the current one's token data reaches --shard-size-mb; every shard is written under a temporary
  name and renamed when complete;
- D.manifest.json, written last: the shard list and totals. Its presence means D is complete;
  pass D as --data-path.

Inputs are read as a stream (.jsonl / .json / .txt, optionally .gz/.xz/.bz2; .parquet; .arrow and
directories written by Hugging Face datasets' save_to_disk, memory-mapped), at
most 2 x --workers batches in flight, so memory does not grow with the corpus. Documents empty
after normalisation are skipped and counted.

After a crash or a cancelled job, the same command with --resume keeps the complete shards, reads
the input from where the last of them ended (recorded in its sidecar) and writes the rest; the
output is byte-identical to an uninterrupted run. Without --resume an existing dataset at the
prefix is an error (pass --overwrite to replace it). On any error, complete shards stay, nothing
half-written is left, and a previous complete dataset is untouched unless --overwrite was given.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from rtd_scale.cli_errors import (OneLineArgumentParser, UserInputError,  # noqa: E402
                                  exit_process, run_cli)
from rtd_scale.data.encode_workers import init_worker, work, work_in_worker  # noqa: E402
from rtd_scale.data.text import (  # noqa: E402
    BadLineError, Position, ReadStats, check_inputs, input_bytes, input_fingerprint, is_compressed,
    iter_line_blocks, iter_record_batches, line_format)
from rtd_scale.data.tokenizer import Tokenizer  # noqa: E402

_BLOCK_BYTES = 1 << 20  # input bytes per task sent to a worker (memory: 2 x workers in flight)
_BATCH_RECORDS = 512  # ... or, for parquet, Arrow and JSON arrays, this many records
_SHARD_DIGITS = 5


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="corpus files (.jsonl .json .txt, optionally .gz/.xz/.bz2; .parquet; .arrow; a "
                        "directory from datasets' save_to_disk), read in order")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="fields to tokenize, one dataset per key (default: text)")
    p.add_argument("--tokenizer-model", required=True,
                   help="a SentencePiece .model (e.g. from tools/train_tokenizer.py), a Hugging Face "
                        "tokenizer.json or a WordPiece vocab.txt; special pieces are found by name")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{KEY}_document_NNNNN.{bin,idx,meta.json} "
                   "and PREFIX_{KEY}_document.manifest.json")
    p.add_argument("--workers", type=int, default=1, help="encoding processes (default 1)")
    p.add_argument("--shard-size-mb", type=float, default=1024.0, metavar="MB",
                   help="start a new shard once a shard's token data reaches MB megabytes (default 1024)")
    p.add_argument("--resume", action="store_true",
                   help="finish an interrupted run: keep its complete shards and continue after them")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset at the prefix")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip and count malformed lines instead of stopping")
    p.add_argument("--log-interval", type=int, default=10000, metavar="DOCS",
                   help="progress line every DOCS documents when stderr is not a terminal (default 10000)")
    return p.parse_args(argv)


# -- the work: read blocks here, parse and encode them in the workers ---------------------------
#
# The main process hands out work and writes: byte ranges of uncompressed JSON lines / text files
# (each worker reads its own range), whole-line blocks of compressed ones (decompressed here), or
# parsed record batches of parquet / Arrow / JSON-array inputs. Workers read and parse the lines, normalise
# and encode, so the main process stays far below one core however many workers run.

def _tasks(paths: Sequence[Path], keys: Sequence[str], start: Position | None) -> Iterator[tuple]:
    start = start or Position()
    for index, path in enumerate(paths):
        if index < start.file:
            continue
        offset, line = (start.offset, start.line) if index == start.file else (0, 0)
        fmt = line_format(path)
        if fmt is not None and not is_compressed(path):  # workers read their own byte ranges
            size = path.stat().st_size
            for first in range(offset, size, _BLOCK_BYTES):
                yield "range", str(path), fmt, index, first, min(first + _BLOCK_BYTES, size), first == offset
        elif fmt is not None:  # decompressed here, shipped as whole-line blocks
            for block in iter_line_blocks(path, index, offset, line, _BLOCK_BYTES):
                yield block, str(path), fmt
        else:
            for parsed, nbytes in iter_record_batches(path, keys, offset, line, _BATCH_RECORDS, _BLOCK_BYTES):
                yield index, parsed, nbytes


def _results(tasks: Iterator[tuple], state: tuple, pool, workers: int) -> Iterator[tuple]:
    """Worked tasks in input order. With a pool, at most 2 x workers tasks are in flight, so
    memory stays bounded however large the input (Pool.imap would read ahead without limit)."""
    if pool is None:
        for task in tasks:
            yield work(*state, task)
        return
    pending: collections.deque = collections.deque()
    for task in tasks:
        pending.append(pool.apply_async(work_in_worker, (task,)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


class _Positions:
    """Position after record i of a worked task (bad-line counts made absolute)."""

    def __init__(self, file: int, parsed, bad_so_far: int):
        self.file, self.parsed, self.bad_so_far = file, parsed, bad_so_far

    def __len__(self) -> int:
        return len(self.parsed.ends)

    def __getitem__(self, i: int) -> Position:
        p = self.parsed
        return Position(self.file, p.ends[i], p.lines[i], self.bad_so_far + p.bad_before[i])


# -- the datasets being written: shards, sidecars, resume ------------------------------------


def shard_prefix(dataset: str, index: int) -> str:
    """The prefix of shard ``index`` of ``dataset``: ``D_00003``."""
    return f"{dataset}_{index:0{_SHARD_DIGITS}d}"


def _shard_indices(dataset: str) -> list[int]:
    """Indices of the shards of ``dataset`` that exist complete (their .idx is renamed last)."""
    directory, name = os.path.split(os.path.abspath(dataset))
    pattern = re.compile(re.escape(name) + rf"_(\d{{{_SHARD_DIGITS}}})\.idx")
    if not os.path.isdir(directory):
        return []
    return sorted(int(m.group(1)) for n in os.listdir(directory) if (m := pattern.fullmatch(n)))


def _remove_dataset(dataset: str, shards_from: int = 0) -> None:
    """Delete the manifest (and a single shard named ``dataset`` itself, e.g. from an older run)
    and shards ``shards_from`` onwards of ``dataset``, and temporaries left by a killed writer.
    Each .idx goes first so no half-deleted shard looks complete."""
    from rtd_scale.data import shards

    for path in (dataset + shards.MANIFEST_SUFFIX, *shards.shard_paths(dataset)):
        if os.path.lexists(path):  # the manifest, and a single shard at the dataset's own prefix
            os.remove(path)
    for i in _shard_indices(dataset):
        if i >= shards_from:
            bin_path, idx_path, meta_path = shards.shard_paths(shard_prefix(dataset, i))
            for path in (idx_path, bin_path, meta_path):
                if os.path.lexists(path):
                    os.remove(path)
    directory, name = os.path.split(os.path.abspath(dataset))
    temp = re.compile(r"\." + re.escape(name) + r"_\d+\..*\.tmp")
    if os.path.isdir(directory):
        for n in os.listdir(directory):
            if temp.fullmatch(n):
                os.remove(os.path.join(directory, n))


@dataclass
class Totals:
    """Counts over every shard written so far, for one dataset (resumed from a sidecar)."""

    documents: int = 0
    tokens: int = 0
    empty_documents_skipped: int = 0
    shards: int = 0

    def add(self, writer) -> None:
        self.documents += writer.documents
        self.tokens += writer.tokens
        self.empty_documents_skipped += writer.empty_documents_skipped


@dataclass
class Plan:
    """Where writing starts: the next shard index, the input position and each dataset's totals."""

    next_shard: int = 0
    position: Position | None = None
    totals: dict[str, Totals] = field(default_factory=dict)
    complete: bool = False
    replaced: bool = False  # --overwrite removed an existing dataset


def _run_signature(paths: Sequence[Path], keys: Sequence[str], tokenizer: Tokenizer,
                   shard_size_bytes: int) -> dict:
    """What must not change between a run and its --resume (stored in every sidecar).
    --skip-bad-lines may be added on resume: the shards kept were written before any bad line."""
    return {"inputs": [input_fingerprint(p) for p in paths], "json_keys": list(keys),
            "tokenizer_model_sha256": tokenizer.sha256, "shard_size_bytes": shard_size_bytes}


def _signature_difference(expected: dict, found: dict | None) -> str | None:
    if not isinstance(found, dict):
        return "its sidecar has no run record (not written by this tool's resumable mode)"
    for name in ("inputs", "json_keys", "tokenizer_model_sha256", "shard_size_bytes"):
        if found.get(name) != expected[name]:
            flag = {"inputs": "--input", "json_keys": "--json-keys", "tokenizer_model_sha256": "--tokenizer-model",
                    "shard_size_bytes": "--shard-size-mb"}[name]
            return f"{flag} differs ({name}: was {found.get(name)!r}, now {expected[name]!r})"
    return None


def plan_output(datasets: dict[str, str], signature: dict, *, resume: bool, overwrite: bool) -> Plan:
    """Decide where to start, after checking what already exists at the output prefixes.

    Raises UserInputError when a dataset or an unfinished run exists and neither --resume nor
    --overwrite was given, or when --resume finds shards written with other arguments.
    """
    from rtd_scale.data import shards

    existing = {key: _shard_indices(d) for key, d in datasets.items()}
    manifests = {key: os.path.exists(d + shards.MANIFEST_SUFFIX) for key, d in datasets.items()}
    if overwrite:
        replaced = any(manifests.values()) or any(existing.values()) or any(
            os.path.exists(d + ".idx") for d in datasets.values())
        for d in datasets.values():
            _remove_dataset(d)
        return Plan(totals={key: Totals() for key in datasets}, replaced=replaced)
    if not resume:
        for key, d in datasets.items():
            single = os.path.exists(d + ".idx")
            if manifests[key] or existing[key] or single:
                what = ("a dataset" if manifests[key] else "a shard" if single
                        else "an unfinished run's shards")
                raise UserInputError(
                    f"--output-prefix: {d} already holds {what} ({len(existing[key])} shard(s)); pass "
                    f"--resume to finish or keep it, --overwrite to replace it, or choose another --output-prefix")
        for d in datasets.values():
            _remove_dataset(d)  # stale temporaries only
        return Plan(totals={key: Totals() for key in datasets})

    # --resume: the complete shards 0..k-1 present for every key, written with these arguments
    for d in datasets.values():
        if os.path.exists(d + ".idx"):
            raise UserInputError(f"--resume: {d} is a single shard ({d}.idx), not a run of this tool "
                                 "to resume; pass --overwrite to replace it, or choose another --output-prefix")
    k = min(len(v) for v in existing.values())
    for key, d in datasets.items():
        run = 0
        while run < len(existing[key]) and existing[key][run] == run:
            run += 1
        k = min(k, run)
    last_meta = {}
    for key, d in datasets.items():
        for i in range(k):
            meta = shards.read_shard_meta(shard_prefix(d, i))
            diff = _signature_difference(signature, (meta or {}).get("run"))
            if diff:
                raise UserInputError(
                    f"--resume: shard {shard_prefix(d, i)} was written with other arguments: {diff}; "
                    "rerun with the original arguments, or pass --overwrite to start again")
            if i == k - 1:
                last_meta[key] = meta
    if k and all(manifests.values()) and all(len(v) == k for v in existing.values()):
        return Plan(next_shard=k, complete=True)
    for d in datasets.values():
        _remove_dataset(d, shards_from=k)  # incomplete tails, old manifests and temporaries
    if k == 0:
        return Plan(totals={key: Totals() for key in datasets})
    positions = {tuple(sorted(m["resume"]["position"].items())) for m in last_meta.values()}
    assert len(positions) == 1, f"shards {k - 1} of the datasets end at different input positions"
    totals = {key: Totals(m["resume"]["documents_total"], m["resume"]["tokens_total"],
                          m["resume"]["empty_documents_skipped_total"], k)
              for key, m in last_meta.items()}
    return Plan(next_shard=k, position=Position.from_dict(last_meta[next(iter(datasets))]["resume"]["position"]),
                totals=totals)


# -- main ---------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.workers < 1:
        raise UserInputError(f"--workers must be >= 1, got {args.workers}")
    if args.log_interval < 1:
        raise UserInputError(f"--log-interval must be >= 1, got {args.log_interval}")
    if not 0 < args.shard_size_mb < float("inf"):
        raise UserInputError(f"--shard-size-mb must be a positive number of megabytes, got {args.shard_size_mb}")
    if args.output_prefix.endswith(("/", os.sep)) or os.path.isdir(args.output_prefix):
        raise UserInputError(f"--output-prefix {args.output_prefix} names a directory; give a file-name "
                             f"prefix inside it, e.g. {os.path.join(args.output_prefix, 'corpus')}")
    if args.resume and args.overwrite:
        raise UserInputError("--resume and --overwrite contradict each other; pass one of them")
    paths = check_inputs(args.input, args.json_keys)
    tokenizer = Tokenizer(args.tokenizer_model)
    keys = list(dict.fromkeys(args.json_keys))
    datasets = {key: f"{args.output_prefix}_{key}_document" for key in keys}
    shard_size_bytes = max(1, int(args.shard_size_mb * 1e6))
    signature = _run_signature(paths, keys, tokenizer, shard_size_bytes)
    out_dir = Path(datasets[keys[0]]).resolve().parent
    out_dir_existed = out_dir.exists()
    plan = plan_output(datasets, signature, resume=args.resume, overwrite=args.overwrite)
    if plan.complete:
        print(f"nothing to do: {', '.join(datasets.values())} complete ({plan.next_shard} shard(s) each)")
        for key, d in datasets.items():
            print(f"--data-path {d}    # {key}")
        return
    if plan.position is not None:
        where = (f"reading {paths[plan.position.file]} from line {plan.position.line + 1:,}"
                 if plan.position.file < len(paths) else "the input was all read: writing the manifest")
        print(f"resuming after shard {plan.next_shard - 1}: {plan.totals[keys[0]].documents:,} documents "
              f"already written; {where}")

    from rtd_scale.data import shards

    dtype = shards.dtype_for_vocab(tokenizer.vocab_size)
    # fork: workers start at once with the loaded tokenizer. This tool never imports torch (whose
    # threads make fork unsafe); if a caller has, spawn instead.
    start_method = "spawn" if "torch" in sys.modules or not hasattr(os, "fork") else "fork"
    state = (tokenizer, dtype, tuple(keys))
    pool = (multiprocessing.get_context(start_method).Pool(args.workers, initializer=init_worker,
                                                           initargs=state)
            if args.workers > 1 else None)

    stats = ReadStats()
    writers: dict[str, shards.ShardWriter] = {}
    next_shard = plan.next_shard
    totals = plan.totals

    def open_writers() -> None:
        for key, d in datasets.items():
            try:
                writers[key] = shards.ShardWriter(shard_prefix(d, next_shard), vocab_size=tokenizer.vocab_size,
                                                  tokenizer_model=args.tokenizer_model, dtype=dtype)
            except OSError as e:
                raise UserInputError(f"--output-prefix {args.output_prefix}: cannot write in "
                                     f"{os.path.dirname(os.path.abspath(d))} ({e.strerror}); pass a "
                                     "writable location") from None

    def commit_writers(position: Position) -> None:
        nonlocal next_shard
        for key, w in writers.items():
            totals[key].add(w)
            totals[key].shards += 1
            w.commit({"shard_index": next_shard, "run": signature, "resume": {
                "position": position.to_dict(), "documents_total": totals[key].documents,
                "tokens_total": totals[key].tokens,
                "empty_documents_skipped_total": totals[key].empty_documents_skipped}})
        writers.clear()
        next_shard += 1

    try:
        open_writers()
        start = time.perf_counter()
        stats.bad_lines = plan.position.bad_lines if plan.position else 0
        compressed = any(map(is_compressed, paths))
        bar = _progress_bar(None if compressed else sum(map(input_bytes, paths)))
        next_log = args.log_interval
        with bar:
            line_base = {plan.position.file: plan.position.line} if plan.position else {}
            for file, parsed, encoded, nbytes, ranged in _results(_tasks(paths, keys, plan.position), state,
                                                                  pool, args.workers):
                if ranged:  # line numbers were counted from the range's first line
                    parsed.shift_lines(line_base.get(file, 0))
                    line_base[file] = line_base.get(file, 0) + parsed.line_count
                stats.add_boms(parsed.boms, paths[file], parsed.first_bom_line)
                if parsed.bad and not args.skip_bad_lines:  # write what precedes it, then stop
                    ok = parsed.bad_before.index(1) if 1 in parsed.bad_before else len(parsed.ends)
                    del parsed.ends[ok:], parsed.lines[ok:], parsed.bad_before[ok:]
                    encoded = [(ids[: int(lengths[:ok].sum())], lengths[:ok]) for ids, lengths in encoded]
                    _write_batch(_Positions(file, parsed, stats.bad_lines), encoded, keys, writers,
                                 shard_size_bytes, open_writers, commit_writers)
                    raise parsed.bad[0]
                _write_batch(_Positions(file, parsed, stats.bad_lines), encoded, keys, writers,
                             shard_size_bytes, open_writers, commit_writers)
                stats.bad_lines += len(parsed.bad)
                stats.bad_examples.extend(parsed.bad[: max(0, 3 - len(stats.bad_examples))])
                stats.records += len(parsed.ends)
                stats.bytes_read += nbytes
                bar.update(nbytes)
                if bar.disable and stats.records >= next_log:
                    next_log = (stats.records // args.log_interval + 1) * args.log_interval
                    print(f"processed {stats.records:,} records, {_rate(stats.bytes_read, start)}", file=sys.stderr)
        last = any(w.documents for w in writers.values()) or next_shard == 0
        if not last:  # nothing after the last full shard but empty documents: count, don't write
            for key, w in writers.items():
                totals[key].add(w)
                w.abort()
            writers.clear()
        if sum(t.documents for t in totals.values()) + sum(w.documents for w in writers.values()) == 0:
            raise UserInputError(
                f"no non-empty documents in {', '.join(map(str, paths))} (read {stats.records:,} records, "
                f"{stats.bad_lines_summary()}); nothing written")
        if last:
            commit_writers(_end_position(paths, stats))
        seconds = time.perf_counter() - start
        for key, d in datasets.items():
            t = totals[key]
            shards.write_manifest(
                d, [shard_prefix(d, i) for i in range(next_shard)], documents=t.documents, tokens=t.tokens,
                empty_documents_skipped=t.empty_documents_skipped, bad_lines_skipped=stats.bad_lines,
                vocab_size=tokenizer.vocab_size, tokenizer_model=args.tokenizer_model,
                tokenizer_model_sha256=tokenizer.sha256, dtype=dtype.name, run=signature)
    except BadLineError as e:
        _abort(writers, out_dir, out_dir_existed)
        replaced = "; --overwrite had removed the previous dataset" if plan.replaced else ""
        raise UserInputError(f"{e}; pass --skip-bad-lines to skip and count malformed lines "
                             f"({_kept(next_shard)}{replaced})") from None
    except BaseException:
        _abort(writers, out_dir, out_dir_existed)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    if stats.bom_note():
        print(stats.bom_note())
    t0 = totals[keys[0]]
    documents = sum(t.documents for t in totals.values())
    empty = sum(t.empty_documents_skipped for t in totals.values())
    tokens = sum(t.tokens for t in totals.values())
    print(
        f"done: {documents:,} documents written, {empty:,} empty documents skipped, "
        f"{stats.bad_lines_summary()}, {tokens:,} tokens in {t0.shards} shard(s) per key; "
        f"{stats.bytes_read / 1e6:.2f} MB in {seconds:.2f} s ({stats.bytes_read / 1e6 / max(seconds, 1e-9):.2f} MB/s)"
    )
    for key, d in datasets.items():
        t = totals[key]
        print(f"--data-path {d}    # {key}: {t.documents:,} documents, {t.tokens:,} tokens, "
              f"{t.shards} shard(s), {dtype.name}")


def _write_batch(positions, encoded, keys, writers, shard_size_bytes, open_writers, commit_writers) -> None:
    """Add one encoded batch record by record in bulk, committing the open shards after the first
    record that brings any key's shard to ``shard_size_bytes`` (so cuts depend only on the
    input, never on batching or worker count)."""
    n = len(positions)
    starts = [np.concatenate([[0], np.cumsum(lengths)]) for _, lengths in encoded]
    i = 0
    while i < n:
        cut = n
        for k, key in enumerate(keys):
            itemsize = writers[key].dtype.itemsize
            filled = writers[key].bin_bytes + (starts[k][i + 1:] - starts[k][i]) * itemsize
            over = np.flatnonzero(filled >= shard_size_bytes)
            if over.size:
                cut = min(cut, i + int(over[0]) + 1)
        for k, key in enumerate(keys):
            ids, lengths = encoded[k]
            writers[key].add_documents(ids[starts[k][i]:starts[k][cut]], lengths[i:cut])
        if cut < n or any(w.bin_bytes >= shard_size_bytes for w in writers.values()):
            commit_writers(positions[cut - 1])
            open_writers()
        i = cut


class _NoBar:
    """What the loop needs of a tqdm bar when stderr is not a terminal (log lines instead)."""

    disable = True

    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _progress_bar(total: int | None):
    if not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm  # only for a terminal: ~20 ms of start-up otherwise

    return tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr)


def _end_position(paths: Sequence[Path], stats: ReadStats) -> Position:
    return Position(file=len(paths), offset=0, line=0, bad_lines=stats.bad_lines)


def _kept(next_shard: int) -> str:
    return (f"the {next_shard} complete shard(s) before it are kept: add --skip-bad-lines --resume "
            "to continue after them" if next_shard else "nothing written")


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
    exit_process(run_cli(main))
