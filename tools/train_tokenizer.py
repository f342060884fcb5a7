#!/usr/bin/env python
"""Train the project's SentencePiece tokenizer (fixed special ids [PAD]=0 [CLS]=1 [SEP]=2 [UNK]=3 [MASK]=4).

    python tools/train_tokenizer.py --input data/sample/corpus.jsonl --output-prefix data/sample/spm

Inputs are .jsonl / .json / .parquet / .txt (rtd_scale.data.text); every --json-keys field of every
record is one document. Documents are normalised (rtd_scale.data.normalize_text.normalize_text) and cut
into sentences of at most --max-sentence-length bytes, so long lines and space-free runs train
instead of being dropped by SentencePiece. Writes PREFIX.model and PREFIX.vocab atomically.

Progress goes to stderr: on a terminal one status line redrawn every second; otherwise (a log
file) a line every --progress-interval seconds. It covers both phases: reading the corpus
(records, input bytes) and SentencePiece's training, whose own log (C++ writing to stderr) is
read through a pipe and condensed to its milestones (sentences preprocessed, seed pieces, each
unigram EM round's piece count, BPE merges); --verbose shows that log whole instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import IO, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.cli_errors import (OneLineArgumentParser, UserInputError,  # noqa: E402
                                  exit_process, run_cli)
from rtd_scale.data.text import (BadLineError, ReadStats, check_inputs, input_bytes, is_compressed,  # noqa: E402
                                 iter_records)
from rtd_scale.data.tokenizer_training import (DEFAULT_MAX_SENTENCE_BYTES, MODEL_TYPES,  # noqa: E402
                                               train_tokenizer)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--progress-interval", type=float, default=30.0, metavar="SECONDS",
                   help="a progress line every SECONDS when stderr is not a terminal (default 30; "
                        "0: at every change); on a terminal one line is redrawn every second")
    return p.parse_args(argv)


class Progress:
    """One status line for a long run, on its own duplicate of stderr (so it still reaches the
    terminal or log while SentencePiece's log is redirected).

    On a terminal the line is redrawn in place every second (or ``interval``, if shorter);
    otherwise it is printed as a new line every ``interval`` seconds. At ``interval`` 0 it is
    written at every change. A run shorter than the interval prints nothing.
    """

    def __init__(self, interval: float, out: Optional[IO[str]] = None):
        self.out = out or os.fdopen(os.dup(sys.stderr.fileno()), "w", buffering=1)
        self.tty = self.out.isatty()
        self.interval = min(interval, 1.0) if self.tty else interval
        self._owned = out is None
        self.start = time.monotonic()
        self.text = ""
        self._drawn = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker: Optional[threading.Thread] = None

    def __enter__(self) -> "Progress":
        if self.interval > 0:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._ticker:
            self._ticker.join()
        if self._drawn and self.tty:
            self.out.write("\n")
        self.out.flush()
        if self._owned:
            self.out.close()

    def set(self, text: str) -> None:
        """Replace the status; printed now when ``interval`` is 0, else at the next tick."""
        self.text = text
        if self.interval == 0:
            self._write()

    def _tick(self) -> None:
        while not self._stop.wait(self.interval):
            self._write()

    def _write(self) -> None:
        with self._lock:
            if not self.text:
                return
            line = f"train_tokenizer: {self.text} ({time.monotonic() - self.start:.0f} s)"
            if self.tty:
                self.out.write("\r\x1b[K" + line)
            else:
                self.out.write(line + "\n")
            self.out.flush()
            self._drawn = True


# A SentencePiece log record: absl's "I0000 00:00:1796048481.179591   25869 file.cc:461] msg"
# or the older "trainer_interface.cc(409) LOG(INFO) msg"; group 1 is the level's first letter.
_SPM_RECORD = re.compile(r"^(?:([IWEF])\d{4} [\d:. ]+\s+\d+ [\w.]+:\d+\] |"
                         r"[\w.]+\(\d+\) LOG\(([A-Z])[A-Z]*\) )(.*)$")
_SPM_MILESTONES = (
    (re.compile(r"Done! preprocessed (\d+) sentences"), "SentencePiece: {:,} sentences preprocessed"),
    (re.compile(r"Extracting seed sentencepieces"), "SentencePiece: extracting seed pieces"),
    (re.compile(r"Initialized (\d+) seed pieces"), "SentencePiece: {:,} seed pieces"),
    (re.compile(r"EM sub_iter=\d+ size=(\d+)"), "SentencePiece unigram EM: {:,} pieces (target {vocab:,})"),
    (re.compile(r"Merged: freq=\d+ merges=(\d+)"), "SentencePiece BPE: {:,} merges (vocab {vocab:,})"),
    (re.compile(r"Added: freq=\d+ size=(\d+)"), "SentencePiece BPE: {:,} pieces (target {vocab:,})"),
)


class SentencePieceLog:
    """While SentencePiece trains, read what it writes to file descriptor 2 through a pipe:
    its milestones become ``progress`` statuses, its info and warning records are dropped (as
    without --verbose), and its error records and any other text pass through unchanged."""

    def __init__(self, progress: Progress, vocab_size: int):
        self.progress, self.vocab_size = progress, vocab_size

    def __enter__(self) -> "SentencePieceLog":
        sys.stderr.flush()
        self.saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        self.reader = threading.Thread(target=self._read, args=(read_end,), daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)  # closes the pipe's last write end: the reader sees its end
        os.close(self.saved)
        self.reader.join()

    def _read(self, fd: int) -> None:
        passthrough = True  # text outside a SentencePiece record, or inside an error record
        with os.fdopen(fd, "r", errors="replace") as pipe:
            for line in pipe:
                m = _SPM_RECORD.match(line.rstrip("\n"))
                if m:
                    passthrough = (m.group(1) or m.group(2)) in ("E", "F")
                    self._milestone(m.group(3))
                elif line.startswith("WARNING: All log messages before absl::InitializeLog()"):
                    passthrough = False
                if passthrough:
                    self.progress.out.write(line)
                    self.progress.out.flush()

    def _milestone(self, message: str) -> None:
        for pattern, text in _SPM_MILESTONES:
            m = pattern.search(message)
            if m:
                self.progress.set(text.format(*map(int, m.groups()), vocab=self.vocab_size))
                return


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    paths = check_inputs(args.input, args.json_keys)
    if args.progress_interval < 0:
        raise UserInputError(f"--progress-interval must be >= 0 seconds, got {args.progress_interval}")
    stats = ReadStats()
    total = sum(map(input_bytes, paths))  # a save_to_disk directory: its Arrow files
    compressed = any(map(is_compressed, paths))  # then the decompressed size is unknown

    def read_so_far() -> str:
        mb = f"{stats.bytes_read / 1e6:,.1f}"
        return f"{mb} MB" if compressed or not total else \
            f"{mb} of {total / 1e6:,.1f} MB ({100 * stats.bytes_read / total:.0f}%)"

    def documents():
        for record in iter_records(paths, args.json_keys, skip_bad_lines=args.skip_bad_lines, stats=stats):
            yield from record
            progress.set(f"reading: {stats.records:,} records, {read_so_far()}")
        progress.set(f"read {stats.records:,} records; SentencePiece is loading the sentences")

    progress = Progress(args.progress_interval)
    try:
        log = contextlib.nullcontext() if args.verbose else SentencePieceLog(progress, args.vocab_size)
        with progress, log:
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
                verbose=True,  # SentencePiece logs its milestones; SentencePieceLog condenses them
            )
    except BadLineError as e:
        raise UserInputError(f"{e}; pass --skip-bad-lines to skip and count malformed lines") from None
    except ValueError as e:  # invalid settings from train_tokenizer's checks
        raise UserInputError(str(e)) from None
    if stats.bom_note():
        print(stats.bom_note())
    print(
        f"trained {summary.model_type} tokenizer, vocab {summary.vocab_size:,}, on {summary.documents:,} documents "
        f"({summary.empty_documents:,} empty skipped, {stats.bad_lines_summary()}); "
        f"{summary.sentences_fed:,} of {summary.sentences:,} sentences fed; {summary.seconds:.1f} s -> {summary.model_path}"
    )


if __name__ == "__main__":
    exit_process(run_cli(main))
