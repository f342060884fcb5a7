"""Preprocessing throughput and peak memory: tools/preprocess_data.py beside the
tokenizer-bound limit and the pipeline a user would write with Hugging Face `datasets`.

Informational, never a test (tests/tools/test_bench_preprocess.py runs it at toy size so that it
keeps working). From the repository root, in the project's venv:

    .venv/bin/python bench/preprocess.py [--corpus ../shared/corpus/bench_corpus.jsonl.xz] \\
        [--workers 2] [--vocab-size 32000] [--out-dir /tmp/rtd_bench_preprocess] [--trials 1]

Steps (every input is cached in --out-dir, keyed by the corpus's SHA-256):

1. The corpus is decompressed once to `<out-dir>/corpus/*.jsonl`, and a 4x concatenation of it
   (`cat` four times) is written beside it.
2. A SentencePiece model is trained once with tools/train_tokenizer.py (unigram, --vocab-size,
   --spm-sentences sampled sentences); its time is printed but is not part of any comparison.
3. (a) tokenizer bound: all texts in memory, one process, `Tokenizer.encode_batch` on batches of
   512 documents (normalisation + SentencePiece: exactly the per-document work of the
   preprocessor), rate x --workers. (a') the same with raw `SentencePieceProcessor.encode` (no
   normalisation), for reference.
4. (b) the plain pipeline: `datasets.load_dataset("json", cache_dir=<fresh dir>)`,
   `.map(lambda b: {"ids": [tok.encode(t) for t in b["text"]]}, batched=True, num_proc=workers)`,
   then megatron-core's `IndexedDatasetBuilder.add_document` per document and `finalize`. Run in a
   child process that imports megatron-core before its clock starts; its wall time is that clock.
5. ours: `python tools/preprocess_data.py --input <jsonl> --workers N ...` as a user runs it; wall
   time is the whole command (interpreter start-up and the ~4 s megatron-core import included),
   the tool's own "MB in s" figure is shown beside it. Also on the 4x file and, when the tool
   accepts it, on the .xz file directly.

CPU s is user + system time of every process of a row (wait4), start-up included for commands: it
barely moves when other jobs share the machine, so compare it when wall times are noisy (the
bound's is its one process's). MB/s is always decompressed JSONL bytes (the whole line, not just
the text) per wall second; every row reads the same bytes (from the page cache).

Peak memory of a command is its whole process tree (main process and workers), polled from a
thread: the RSS sum (/proc/PID/statm) every --poll-ms, and the process list and the PSS sum
(/proc/PID/smaps_rollup) every 8th poll, because PSS costs the kernel a page-table walk (~1-2 ms
for a process that imported torch). PSS counts a page shared by k processes as 1/k in each, so
its sum is the tree's real footprint and is the headline number; the RSS sum counts shared pages
(torch's libraries, the forked parents' pages) once per process and overstates it. Polling can
miss a peak shorter than its interval; `max proc RSS` (wait4's ru_maxrss: the kernel's
high-water mark of the single largest process) bounds it from below.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_CORPUS = REPO.parent / "shared" / "corpus" / "bench_corpus.jsonl.xz"
ENCODE_BATCH_DOCS = 512  # documents per encode_batch call, as tools/preprocess_data.py sends a worker
MEMORY_LIMIT_MB = 1000.0  # target: peak memory under 1 GB whatever the input size
TARGET_OF_BOUND = 0.85  # target: >= 85% of the tokenizer-bound rate
TARGET_OVER_BASELINE = 1.5  # target: >= 1.5x the datasets.map pipeline


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- inputs -------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def open_corpus(path: Path):
    return lzma.open(path, "rb") if path.suffix == ".xz" else open(path, "rb")


def prepare_corpus(corpus: Path, out_dir: Path, digest: str, max_docs: int | None) -> tuple[Path, Path]:
    """Decompressed JSONL (first ``max_docs`` lines) and its 4x concatenation; cached by digest."""
    stem = corpus.name.split(".")[0]
    tag = f"{stem}.{digest[:12]}" + (f".first{max_docs}" if max_docs else "")
    jsonl, x4 = out_dir / "corpus" / f"{tag}.jsonl", out_dir / "corpus" / f"{tag}.x4.jsonl"
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    if not jsonl.exists():
        log(f"decompressing {corpus} -> {jsonl}")
        tmp = jsonl.with_suffix(".tmp")
        with open_corpus(corpus) as src, open(tmp, "wb") as dst:
            for i, line in enumerate(src):
                if max_docs is not None and i >= max_docs:
                    break
                dst.write(line)
        tmp.replace(jsonl)
    if not x4.exists():
        log(f"writing the 4x concatenation {x4}")
        tmp = x4.with_suffix(".tmp")
        with open(tmp, "wb") as dst:
            for _ in range(4):
                with open(jsonl, "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
        tmp.replace(x4)
    return jsonl, x4


def train_spm(jsonl: Path, out_dir: Path, tag: str, vocab_size: int, sentences: int) -> tuple[Path, float | None]:
    """The SentencePiece model (tools/train_tokenizer.py) and its training seconds (None if cached)."""
    prefix = out_dir / f"spm{vocab_size}.{tag}.s{sentences}"
    model = prefix.with_name(prefix.name + ".model")
    if model.exists():
        return model, None
    log(f"training a {vocab_size}-piece SentencePiece model on {sentences:,} sampled sentences")
    start = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "tools" / "train_tokenizer.py"), "--input", str(jsonl),
                    "--vocab-size", str(vocab_size), "--output-prefix", str(prefix),
                    "--input-sentence-size", str(sentences)], cwd=REPO, check=True)
    return model, time.perf_counter() - start


# -- measuring a process tree -------------------------------------------------------------------


_PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def _rss_kb(pid: int) -> int:
    """Resident set of one process in kB from /proc/PID/statm (cheap); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE_KB
    except (OSError, ValueError, IndexError):
        return 0


def _pss_kb(pid: int) -> int:
    """Proportional set of one process in kB from /proc/PID/smaps_rollup; 0 if it is gone.

    Costs ~1-2 ms of CPU for a process that has imported torch (the kernel walks its page tables)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class TreeMemoryPeak:
    """Polls process ``pid`` and its descendants in a thread; keeps the largest RSS and PSS sums.

    RSS (statm, ~15 us a process) is summed every ``interval_s``; the process list is refreshed and
    PSS (smaps_rollup, ~1-2 ms a process) summed every ``pss_every``-th sample, so the poller
    takes a few percent of one core instead of a quarter of it on a 2-core machine."""

    def __init__(self, pid: int, interval_s: float, pss_every: int = 8) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self._interval_s, self._pss_every = interval_s, pss_every
        self._stop = threading.Event()
        self.peak_pss_kb = self.peak_rss_kb = self.samples = self.max_processes = 0
        self.cpu_s = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        pids = [self._root.pid]
        cpu0 = time.thread_time()
        while not self._stop.is_set():
            if self.samples % self._pss_every == 0:
                try:
                    pids = [self._root.pid] + [p.pid for p in self._root.children(recursive=True)]
                except psutil.Error:
                    pass
                self.peak_pss_kb = max(self.peak_pss_kb, sum(map(_pss_kb, pids)))
                self.max_processes = max(self.max_processes, len(pids))
            self.peak_rss_kb = max(self.peak_rss_kb, sum(map(_rss_kb, pids)))
            self.samples += 1
            self._stop.wait(self._interval_s)
        self.cpu_s = time.thread_time() - cpu0

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class Measured:
    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    peak_pss_mb: float
    peak_rss_mb: float
    max_proc_rss_mb: float  # wait4's ru_maxrss: the largest single process of the tree
    cpu_s: float  # user + system CPU seconds of the tree (every descendant that was waited for)
    processes: int
    poll_cpu_pct: float  # the poller's CPU time, % of one core over the run


def run_measured(cmd: list[str], poll_s: float) -> Measured:
    """Run ``cmd`` from the repository root; wall time and peak memory of its whole process tree."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, text=True)
        mem = TreeMemoryPeak(proc.pid, poll_s) if poll_s > 0 else None  # 0: a timing run, no poller
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        if mem is not None:
            mem.stop()
        out.seek(0)
        err.seek(0)
        return Measured(proc.returncode, out.read(), err.read(), wall,
                        mem.peak_pss_kb / 1e3 if mem else float("nan"), mem.peak_rss_kb / 1e3 if mem else float("nan"),
                        usage.ru_maxrss / 1e3, usage.ru_utime + usage.ru_stime, mem.max_processes if mem else 0,
                        100 * mem.cpu_s / wall if mem else 0.0)


# -- the rows -----------------------------------------------------------------------------------


@dataclass
class Row:
    name: str
    input_bytes: int
    tokens: int | None = None
    wall_s: float | None = None  # None: the row did not run (see note)
    tool_mb_s: float | None = None  # the tool's own "MB in s" figure
    peak_pss_mb: float | None = None
    peak_rss_mb: float | None = None
    max_proc_rss_mb: float | None = None
    cpu_s: float | None = None  # CPU seconds (all processes), start-up included: noise-free cost
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def mb_s(self) -> float | None:
        return self.input_bytes / 1e6 / self.wall_s if self.wall_s else None

    @property
    def tokens_s(self) -> float | None:
        return self.tokens / self.wall_s if self.wall_s and self.tokens is not None else None


def read_texts(jsonl: Path) -> list[str]:
    from rtd_scale.data.text import iter_records  # the tools' reader (byte-order marks too)

    return [text for (text,) in iter_records([jsonl], ["text"])]


def measure_bound(jsonl: Path, model: Path, workers: int, trials: int) -> tuple[Row, Row]:
    """(a) normalisation + SentencePiece and (a') raw SentencePiece, one process, x workers.

    Rows report the bound: wall_s is the single-process seconds / workers."""
    import sentencepiece as spm

    from rtd_scale.data.tokenizer import Tokenizer

    texts = read_texts(jsonl)
    nbytes = jsonl.stat().st_size
    tok = Tokenizer(model)
    raw = spm.SentencePieceProcessor(model_file=str(model))
    encoders = (
        (f"(a) bound: normalise + SPM, 1 proc x {workers}", lambda batch: tok.encode_batch(batch, num_threads=1)),
        # num_threads=1: SentencePiece's default (-1) encodes a list on every core
        (f"(a') bound: raw SPM encode, 1 proc x {workers}", lambda batch: raw.encode(batch, num_threads=1)),
    )
    rows = []
    for name, encode in encoders:
        best, cpu = float("inf"), 0.0
        for _ in range(trials):
            tokens = 0
            start, cpu_start = time.perf_counter(), time.process_time()
            for i in range(0, len(texts), ENCODE_BATCH_DOCS):
                tokens += sum(map(len, encode(texts[i:i + ENCODE_BATCH_DOCS])))
            seconds = time.perf_counter() - start
            if seconds < best:
                best, cpu = seconds, time.process_time() - cpu_start
        log(f"{name}: {best:.1f} s single-process ({cpu:.1f} s CPU), {tokens:,} tokens")
        note = f"one process: {best:.2f} s wall, {cpu:.2f} s CPU"
        if best < 0.5:  # too short for the CPU / wall comparison to mean anything
            pass
        elif cpu < 0.8 * best:
            note += " (CPU < wall: the machine was busy, the bound is understated)"
        elif cpu > 1.2 * best:
            note += " (CPU > wall: the encoder used more than one core, the bound is overstated)"
        rows.append(Row(name, nbytes, tokens, best / workers, cpu_s=cpu, note=note,
                        extra={"single_process_s": best}))
    return rows[0], rows[1]


def baseline_child(jsonl: str, model: str, prefix: str, workers: int, cache_dir: str) -> None:
    """(b), in its own process: datasets.map(encode, num_proc) then IndexedDatasetBuilder. Prints JSON."""
    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    import datasets

    from rtd_scale.data.tokenizer import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer(model)
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int32

    start = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=cache_dir)
    ds = ds.map(lambda batch: {"ids": [tok.encode(t) for t in batch["text"]]}, batched=True,
                num_proc=workers, remove_columns=ds.column_names)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    documents = tokens = 0
    for batch in ds.iter(batch_size=1000):
        for ids in batch["ids"]:
            builder.add_document(ids, [len(ids)])
            documents += 1
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "documents": documents, "tokens": tokens}))


def measure_baseline(jsonl: Path, model: Path, out_dir: Path, workers: int, poll_s: float) -> Row:
    work = out_dir / "baseline"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--baseline-child", str(jsonl), str(model),
           str(work / "ids"), str(workers), str(work / "hf_cache")]  # a fresh datasets cache every run
    m = run_measured(cmd, poll_s)
    shutil.rmtree(work, ignore_errors=True)
    name = f"(b) datasets.map(num_proc={workers}) + IndexedDatasetBuilder"
    if m.returncode != 0:
        return Row(name, jsonl.stat().st_size, note=f"failed: {_last_line(m.stderr)}")
    result = json.loads(m.stdout.strip().splitlines()[-1])
    return Row(name, jsonl.stat().st_size, result["tokens"], result["seconds"], None, m.peak_pss_mb, m.peak_rss_mb,
               m.max_proc_rss_mb, m.cpu_s,
               note=f"clock started after imports (CPU s include them); whole child {m.wall_s:.1f} s; "
                    f"{m.processes} processes, memory poller {m.poll_cpu_pct:.1f}% of a core",
               extra={"child_wall_s": m.wall_s, "processes": m.processes})


_DONE_TOKENS_RE = re.compile(r"([\d,]+) tokens")
_DONE_RATE_RE = re.compile(r"([\d.]+) MB in ([\d.]+) s")


def measure_ours(name: str, input_path: Path, input_bytes: int, model: Path, out_dir: Path, workers: int,
                 poll_s: float) -> Row:
    work = out_dir / "ours"
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(input_path),
           "--tokenizer-model", str(model), "--output-prefix", str(work / "corpus"), "--workers", str(workers)]
    m = run_measured(cmd, poll_s)
    if m.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        return Row(name, input_bytes, note=f"failed: {_last_line(m.stderr)}")
    # Tokens from the shard sidecars (one per shard, however many shards the tool writes); the
    # tool's final "done:" line is the fallback and the source of its own MB/s figure.
    metas = sorted(work.rglob("*.meta.json"))
    tokens = sum(json.loads(p.read_text())["tokens"] for p in metas) if metas else None
    done = [line for line in m.stdout.splitlines() if line.startswith("done:")]
    tool_mb_s = None
    if done:
        if tokens is None and (t := _DONE_TOKENS_RE.search(done[-1])):
            tokens = int(t.group(1).replace(",", ""))
        if r := _DONE_RATE_RE.search(done[-1]):
            tool_mb_s = float(r.group(1)) / max(float(r.group(2)), 1e-9)
    shutil.rmtree(work, ignore_errors=True)
    return Row(name, input_bytes, tokens, m.wall_s, tool_mb_s, m.peak_pss_mb, m.peak_rss_mb, m.max_proc_rss_mb, m.cpu_s,
               note=f"{len(metas)} shard(s), {m.processes} processes, memory poller {m.poll_cpu_pct:.1f}% of a core",
               extra={"done_line": done[-1] if done else None, "processes": m.processes})


def best_of(trials: int, measure) -> Row:
    rows = [measure() for _ in range(trials)]
    ran = [r for r in rows if r.wall_s is not None]
    return min(ran, key=lambda r: r.wall_s) if ran else rows[0]


def timed_then_polled(trials: int, measure, poll_s: float) -> Row:
    """Speed from ``trials`` runs without the memory poller (on 2 cores its few percent of a core
    would be charged to the command), then peak memory from one more run with it."""
    row = best_of(trials, lambda: measure(0.0))
    if row.wall_s is not None:
        polled = measure(poll_s)
        row.peak_pss_mb, row.peak_rss_mb, row.max_proc_rss_mb = (polled.peak_pss_mb, polled.peak_rss_mb,
                                                                 polled.max_proc_rss_mb)
        row.note = polled.note
    return row


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else "(no output)"


# -- report ---------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def report(rows: list[Row], bound: Row, baseline: Row, ours: Row, ours_x4: Row) -> str:
    lines = ["| row | MB/s | tokens/s | wall s | CPU s | tool's MB/s | peak PSS MB (RSS sum) | max proc RSS MB "
             "| % of (a) | × (b) | tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pct = 100 * r.mb_s / bound.mb_s if r.mb_s and bound.mb_s else None
        times = r.mb_s / baseline.mb_s if r.mb_s and baseline.mb_s else None
        mem = f"{r.peak_pss_mb:.0f} ({r.peak_rss_mb:.0f})" if r.peak_pss_mb is not None else "—"
        lines.append(f"| {r.name} | {_fmt(r.mb_s, '.2f')} | {_fmt(r.tokens_s, ',.0f')} | {_fmt(r.wall_s, '.1f')} "
                     f"| {_fmt(r.cpu_s, '.1f')} | {_fmt(r.tool_mb_s, '.2f')} | {mem} "
                     f"| {_fmt(r.max_proc_rss_mb, '.0f')} | {_fmt(pct, '.0f')} | {_fmt(times, '.2f')} "
                     f"| {_fmt(r.tokens, ',')} |")
    notes = [f"- {r.name}: {r.note}" for r in rows if r.note]

    def verdict(ok: bool | None, text: str) -> str:
        return f"{'N/A ' if ok is None else 'PASS' if ok else 'FAIL'}  {text}"

    def ratio(a: Row, b: Row) -> float | None:
        return a.mb_s / b.mb_s if a.mb_s and b.mb_s else None

    of_bound, over_base = ratio(ours, bound), ratio(ours, baseline)
    checks = [
        verdict(None if of_bound is None else of_bound >= TARGET_OF_BOUND,
                f"ours 1x at {_fmt(None if of_bound is None else 100 * of_bound, '.0f')}% of (a) "
                f"(target >= {100 * TARGET_OF_BOUND:.0f}%)"),
        verdict(None if over_base is None else over_base >= TARGET_OVER_BASELINE,
                f"ours 1x at {_fmt(over_base, '.2f')}x (b) (target >= {TARGET_OVER_BASELINE}x)"),
    ]
    if ours.tool_mb_s and bound.mb_s and baseline.mb_s:
        checks.append(f"info  ours 1x by the tool's own clock (start-up excluded): "
                      f"{100 * ours.tool_mb_s / bound.mb_s:.0f}% of (a), {ours.tool_mb_s / baseline.mb_s:.2f}x (b)")
    for r in (ours, ours_x4):
        checks.append(verdict(None if r.peak_pss_mb is None else r.peak_pss_mb < MEMORY_LIMIT_MB,
                              f"{r.name}: peak PSS {_fmt(r.peak_pss_mb, '.0f')} MB, RSS sum "
                              f"{_fmt(r.peak_rss_mb, '.0f')} MB (target < {MEMORY_LIMIT_MB:.0f} MB)"))
    if ours.peak_pss_mb is not None and ours_x4.peak_pss_mb is not None:
        checks.append(f"info  peak PSS grows by {ours_x4.peak_pss_mb - ours.peak_pss_mb:+.0f} MB from 1x to 4x input")
    same = {r.name: r.tokens for r in (bound, baseline, ours) if r.tokens is not None}
    if len(set(same.values())) > 1:
        checks.append(f"NOTE  token counts differ between (a), (b) and ours: {same}")
    if ours.tokens is not None and ours_x4.tokens is not None and ours_x4.tokens != 4 * ours.tokens:
        checks.append(f"NOTE  ours 4x wrote {ours_x4.tokens:,} tokens, not 4 x {ours.tokens:,}")
    return "\n".join(lines + [""] + notes + [""] + checks)


# -- main -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="a .jsonl or .jsonl.xz corpus (field 'text')")
    p.add_argument("--workers", type=int, default=2, help="preprocessing processes (default 2)")
    p.add_argument("--vocab-size", type=int, default=32000, help="SentencePiece pieces (default 32000)")
    p.add_argument("--spm-sentences", type=int, default=300_000,
                   help="sentences sampled for tokenizer training (--input-sentence-size; default 300,000)")
    p.add_argument("--out-dir", type=Path, default=Path(tempfile.gettempdir()) / "rtd_bench_preprocess",
                   help="cache and scratch directory (default /tmp/rtd_bench_preprocess)")
    p.add_argument("--max-docs", type=int, default=None, help="use only the first N documents (toy runs)")
    p.add_argument("--trials", type=int, default=1,
                   help="runs of rows (a), (b) and ours 1x; the fastest is shown (default 1)")
    p.add_argument("--poll-ms", type=float, default=25.0,
                   help="RSS sampling interval; PSS every 8th (default 25 ms)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    p.add_argument("--baseline-child", nargs=5, default=None, help=argparse.SUPPRESS)  # internal: row (b)
    args = p.parse_args(argv)
    for name in ("workers", "vocab_size", "spm_sentences", "trials"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_docs is not None and args.max_docs < 1:
        p.error("--max-docs must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline_child:
        jsonl, model, prefix, workers, cache_dir = args.baseline_child
        baseline_child(jsonl, model, prefix, int(workers), cache_dir)
        return
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    corpus = args.corpus.resolve()
    if not corpus.is_file():
        sys.exit(f"corpus not found: {corpus} (pass --corpus)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    digest = sha256_file(corpus)
    jsonl, jsonl_x4 = prepare_corpus(corpus, args.out_dir, digest, args.max_docs)
    tag = digest[:12] + (f".first{args.max_docs}" if args.max_docs else "")
    model, train_s = train_spm(jsonl, args.out_dir, tag, args.vocab_size, args.spm_sentences)
    poll_s = args.poll_ms / 1e3
    nbytes = jsonl.stat().st_size
    n = args.workers

    bound, raw_bound = measure_bound(jsonl, model, n, args.trials)
    log("(b) datasets.map baseline")
    baseline = timed_then_polled(args.trials, lambda p: measure_baseline(jsonl, model, args.out_dir, n, p), poll_s)
    log("ours 1x")
    ours = timed_then_polled(args.trials, lambda p: measure_ours(
        f"ours: preprocess_data.py --workers {n}, 1x", jsonl, nbytes, model, args.out_dir, n, p), poll_s)
    rows = [bound, raw_bound, baseline, ours]
    if corpus.suffix == ".xz" and args.max_docs is None:
        log("ours on the .xz file")
        rows.append(timed_then_polled(1, lambda p: measure_ours(
            f"ours: preprocess_data.py --workers {n}, 1x read from .xz", corpus, nbytes, model, args.out_dir, n, p),
            poll_s))
    log("ours 4x")
    ours_x4 = timed_then_polled(1, lambda p: measure_ours(
        f"ours: preprocess_data.py --workers {n}, 4x concatenation", jsonl_x4, jsonl_x4.stat().st_size, model,
        args.out_dir, n, p), poll_s)
    rows.append(ours_x4)

    table = report(rows, bound, baseline, ours, ours_x4)
    total_s = time.perf_counter() - t0
    print(f"## Preprocessing: {corpus.name}{f' (first {args.max_docs} docs)' if args.max_docs else ''}, "
          f"{nbytes / 1e6:.1f} MB JSONL, {args.workers} workers, {args.vocab_size}-piece SentencePiece "
          f"({os.cpu_count()} CPUs)\n")
    print(table)
    print(f"\ntokenizer training: {'cached' if train_s is None else f'{train_s:.0f} s'} ({model.name}); "
          f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; whole bench {total_s:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({
            "corpus": str(corpus), "jsonl_bytes": nbytes, "workers": n, "vocab_size": args.vocab_size,
            "tokenizer_training_s": train_s, "total_s": total_s,
            "rows": [{**asdict(r), "mb_s": r.mb_s, "tokens_s": r.tokens_s} for r in rows],
            "report": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
