"""Reading raw text corpora: one reader for the tokenizer trainer and the preprocessor.

Formats, chosen by file suffix:

| suffix     | one record is                      | read by                                  |
|------------|------------------------------------|------------------------------------------|
| `.jsonl`   | one JSON object per line           | this module, line by line (exact `file:line` errors) |
| `.json`    | JSON lines (Megatron-LM's "loose json"), or one top-level array of objects | this module |
| `.parquet` | one row                            | Hugging Face `datasets` (streaming)      |
| `.txt`     | one line (HF `datasets` "text" convention) | this module, line by line        |
| `.arrow`   | one row of an Arrow IPC stream (what `datasets` writes) or file | `datasets` (memory-mapped) |
| a directory | one row of a dataset saved by `datasets`' `save_to_disk` (`state.json` + `.arrow` files) | `datasets.load_from_disk` (memory-mapped) |

Arrow inputs are memory-mapped and read in slices of rows, so memory does not grow with them; a
saved ``DatasetDict`` (``dataset_dict.json``, one directory per split) is refused with the fix:
pass the split's directory, e.g. ``corpus/train``. Each of `.jsonl`, `.json` and `.txt` may also be compressed: `.gz`, `.xz`, `.bz2` (e.g.
`corpus.jsonl.xz`), decompressed while streaming.

Every record comes with its :class:`Position` — where the input continues after it — so a reader
can be restarted exactly there (``tools/preprocess_data.py --resume``).

JSON lines and text are read here rather than through `datasets` because its loaders fail on a
malformed file as a whole (e.g. a bare ``UnicodeDecodeError`` with no line number); reading them
here gives an error naming the file and line, and lets ``skip_bad_lines`` skip exactly the bad ones.

A *bad line* is: invalid JSON, not a JSON object, a missing key, a value that is not a string
(``null`` included), or bytes that are not UTF-8. Blank lines in JSON lines files are not records
and are passed over silently. Empty texts are returned as they are; callers count and skip them.

A UTF-8 byte-order mark (``EF BB BF``, U+FEFF; Windows editors and some exports write one) at the
start of a file or of a line is read as nothing, as Python's ``utf-8-sig`` codec and HF
``datasets`` read it; the start of a line covers files concatenated with ``cat``, whose every part
starts with its own mark. They are counted (``ReadStats.boms``), and the tools say so in one line
(:meth:`ReadStats.bom_note`).
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import hashlib
import json
import lzma
import os
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Sequence

from rtd_scale.cli_errors import UserInputError

__all__ = [
    "BadLineError",
    "InputFormat",
    "Position",
    "ReadStats",
    "check_inputs",
    "input_fingerprint",
    "input_bytes",
    "input_format",
    "LineBlock",
    "ParsedRecords",
    "iter_line_blocks",
    "iter_positioned_records",
    "iter_record_batches",
    "iter_records",
    "line_format",
    "parse_line_block",
    "read_line_range",
]

InputFormat = Literal["jsonl", "json", "parquet", "text", "arrow"]
_SUFFIX_TO_FORMAT: dict[str, InputFormat] = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".arrow": "arrow",
}
_ARROW_SLICE_ROWS = 256  # rows converted to Python at a time (a few MB of text)
_COMPRESSION = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}
_TEXT_KEY = "text"  # the one field a .txt record has
_MAX_EXAMPLES = 3  # bad lines remembered for the summary
_BOM = b"\xef\xbb\xbf"  # U+FEFF in UTF-8
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # little-, big-endian


class BadLineError(UserInputError):
    """A malformed record: ``<path>:<line>: <reason>``.

    ``line`` is 1-based; for parquet and Arrow it is the row number and for a JSON array the element number,
    and ``unit`` says which ("row", "element"), giving ``<path>: row <n>: <reason>``.
    """

    def __init__(self, path: str, line: int, reason: str, unit: str = "line") -> None:
        super().__init__(path, line, reason, unit)
        self.path, self.line, self.reason, self.unit = path, line, reason, unit

    def __str__(self) -> str:
        if self.unit == "line":
            return f"{self.path}:{self.line}: {self.reason}"
        return f"{self.path}: {self.unit} {self.line}: {self.reason}"


@dataclass
class ReadStats:
    """Counters a reader fills in while it runs.

    ``bytes_read``: input bytes consumed so far (decompressed bytes; for parquet the file size once
    read; on a resumed read, counted from the resume point).
    ``records``: records returned. ``bad_lines``: malformed records skipped (only with
    ``skip_bad_lines``); ``bad_examples``: the first few of them. ``boms``: UTF-8 byte-order
    marks read as nothing at the start of a file or line; ``first_bom``: ``file:line`` of the
    first.
    """

    bytes_read: int = 0
    records: int = 0
    bad_lines: int = 0
    bad_examples: list[BadLineError] = field(default_factory=list)
    boms: int = 0
    first_bom: str = ""

    def add_boms(self, count: int, path: str | Path, line: int) -> None:
        """Count ``count`` byte-order marks, the first of them at ``path``:``line``."""
        if count and not self.boms:
            self.first_bom = f"{path}:{line}"
        self.boms += count

    def bom_note(self) -> str | None:
        """The one line that says byte-order marks were read as nothing, or None."""
        if not self.boms:
            return None
        return (f"note: read {self.boms:,} UTF-8 byte-order mark(s) (U+FEFF) at the start of a "
                f"file or line as nothing (first: {self.first_bom})")

    def bad_lines_summary(self) -> str:
        """'N bad lines skipped (first: file:line: reason)' or '0 bad lines skipped'."""
        if not self.bad_lines:
            return "0 bad lines skipped"
        return f"{self.bad_lines:,} bad lines skipped (first: {self.bad_examples[0]})"


def _split_suffix(path: str | Path) -> tuple[str, str | None]:
    """(format suffix, compression suffix or None): ``a.jsonl.xz`` → (".jsonl", ".xz")."""
    suffixes = [x.lower() for x in Path(path).suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        return (suffixes[-2] if len(suffixes) > 1 else ""), suffixes[-1]
    return (suffixes[-1] if suffixes else ""), None


def input_format(path: str | Path) -> InputFormat:
    """The format of ``path`` from its suffix (a compression suffix .gz/.xz/.bz2 is looked
    through; a directory is a saved ``datasets`` dataset, "arrow"); raises UserInputError for an
    unknown suffix or compressed parquet or Arrow."""
    if Path(path).is_dir():
        return "arrow"
    suffix, compression = _split_suffix(path)
    fmt = _SUFFIX_TO_FORMAT.get(suffix)
    if fmt is None:
        raise UserInputError(
            f"{path}: unsupported input suffix {''.join(Path(path).suffixes[-2:])!r}; use one of "
            f"{', '.join(_SUFFIX_TO_FORMAT)}, optionally compressed ({', '.join(_COMPRESSION)})"
        )
    if fmt in ("parquet", "arrow") and compression:
        raise UserInputError(f"{path}: {fmt} is not read through a decompressor; give the "
                             f".{fmt} file itself")
    return fmt


def is_compressed(path: str | Path) -> bool:
    """Whether ``path`` is read through a decompressor (.gz, .xz, .bz2)."""
    return _split_suffix(path)[1] is not None


def input_fingerprint(path: str | Path) -> dict:
    """``{"path", "bytes", "mtime_ns", "sha256_head_tail"}`` of an input file: its real path (so
    any spelling of it matches), size, modification time and the SHA-256 of its first and last MiB
    — cheap at any size, and enough to notice that a resumed run is reading another or an edited
    file (an edit changes the modification time). For a saved dataset directory: its real path,
    and over its files (``state.json`` and the data files, in order) the total size, the newest
    modification time and the SHA-256 of their names and first and last MiB."""
    path = Path(path)
    files = [path / "state.json", *_saved_dataset_files(path)] if path.is_dir() else [path]
    h = hashlib.sha256()
    size = mtime = 0
    for file in files:
        st = file.stat()
        size, mtime = size + st.st_size, max(mtime, st.st_mtime_ns)
        if path.is_dir():
            h.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            h.update(f.read(1 << 20))
            if st.st_size > 2 << 20:
                f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return {"path": os.path.realpath(path), "bytes": size, "mtime_ns": mtime,
            "sha256_head_tail": h.hexdigest()}


def input_bytes(path: str | Path) -> int:
    """Size of an input in bytes (a saved dataset directory: its data files together)."""
    path = Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in _saved_dataset_files(path))
    return path.stat().st_size


def _saved_dataset_files(path: Path) -> list[Path]:
    """The data files of a directory written by ``datasets``' ``Dataset.save_to_disk``, in row
    order (its ``state.json``); UserInputError naming the directory and the fix otherwise."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        first = splits[0] if splits else "train"
        raise UserInputError(
            f"{path}: a DatasetDict saved by datasets (splits: {', '.join(splits) or 'none'}); pass "
            f"one split's directory as --input, e.g. {path / first}")
    state = path / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        names = None
    if not names or not all(isinstance(n, str) and (path / n).is_file() for n in names):
        raise UserInputError(
            f"input {path} is a directory but not a dataset saved by datasets' save_to_disk "
            f"({'no readable state.json listing its .arrow files' if names is None else 'its state.json lists missing files'}); "
            "pass such a directory, or the input files themselves")
    return [path / n for n in names]


def check_inputs(paths: Sequence[str | Path], json_keys: Sequence[str]) -> list[Path]:
    """Check before reading anything that every input exists, is a file, has a known suffix,
    and that ``.txt`` inputs are only asked for the key ``text``.

    Returns the paths as ``Path`` objects. Raises UserInputError naming the first bad path.
    """
    if not paths:
        raise UserInputError("no input files given; pass --input FILE [FILE ...]")
    if not json_keys:
        raise UserInputError("no keys given; pass --json-keys KEY [KEY ...]")
    checked = []
    for p in map(Path, paths):
        if not p.exists():
            raise UserInputError(f"input file not found: {p}")
        if p.is_dir():
            _saved_dataset_files(p)  # a saved dataset, or one line saying what to pass
        elif not p.is_file():
            raise UserInputError(f"input is not a file: {p}")
        if input_format(p) == "text" and list(json_keys) != [_TEXT_KEY]:
            raise UserInputError(
                f"{p}: a .txt file has one field, 'text' (one record per line); "
                f"--json-keys {' '.join(json_keys)} applies only to json/jsonl/parquet"
            )
        checked.append(p)
    return checked


@dataclass(frozen=True)
class Position:
    """Where a read continues: after the record it is attached to.

    ``file``: index into the list of inputs. ``offset``: for JSON lines and text, decompressed
    bytes of that file consumed; for a JSON array, elements consumed; for parquet and Arrow inputs
    (a saved dataset directory is one input), rows consumed.
    ``line``: lines (elements, rows) consumed in that file. ``bad_lines``: malformed records
    skipped so far over all files (with ``skip_bad_lines``).
    """

    file: int = 0
    offset: int = 0
    line: int = 0
    bad_lines: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Position":
        return cls(**{k: int(d[k]) for k in ("file", "offset", "line", "bad_lines")})


def iter_records(
    paths: Sequence[str | Path],
    json_keys: Sequence[str],
    *,
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[tuple[str, ...]]:
    """Stream the records of ``paths`` in order: one tuple of texts (one per key in ``json_keys``).

    Texts are returned raw (not normalised). Raises BadLineError on the first malformed record
    unless ``skip_bad_lines``, in which case it is counted in ``stats.bad_lines`` and skipped.
    Call :func:`check_inputs` first for clean errors about missing files.
    """
    for _, record in iter_positioned_records(paths, json_keys, skip_bad_lines=skip_bad_lines, stats=stats):
        yield record


def iter_positioned_records(
    paths: Sequence[str | Path],
    json_keys: Sequence[str],
    *,
    start: Position | None = None,
    skip_bad_lines: bool = False,
    stats: ReadStats | None = None,
) -> Iterator[tuple[Position, tuple[str, ...]]]:
    """:func:`iter_records` with the :class:`Position` after each record, starting at ``start``
    (default: the beginning). Reading from a record's position gives exactly the records after it,
    so a stopped reader resumes where it was (bad lines after it are read and counted again).
    """
    stats = stats if stats is not None else ReadStats()
    start = start or Position()
    bad = start.bad_lines
    stats.bad_lines = bad
    keys = tuple(json_keys)
    for index, path in enumerate(map(Path, paths)):
        if index < start.file:
            continue
        offset, line = (start.offset, start.line) if index == start.file else (0, 0)
        if line_format(path) is None:
            records = _record_reader(path)(path, keys, stats, line)
        else:
            records = _line_records(path, index, keys, stats, offset, line)
        for offset, line, rec in records:
            if isinstance(rec, BadLineError):
                if not skip_bad_lines:
                    raise rec
                bad += 1
                stats.bad_lines = bad
                if len(stats.bad_examples) < _MAX_EXAMPLES:
                    stats.bad_examples.append(rec)
                continue
            stats.records += 1
            yield Position(index, offset, line, bad), rec


def _line_records(path: Path, index: int, keys: tuple[str, ...], stats: ReadStats, offset: int, line: int):
    """(offset after, line, record or BadLineError) in file order, through the block reader and
    parser the preprocessor's workers use (one implementation of line parsing)."""
    fmt = line_format(path)
    for block in iter_line_blocks(path, index, offset, line):
        stats.bytes_read += len(block.data)
        parsed = parse_line_block(block, path, fmt, keys)
        stats.add_boms(parsed.boms, path, parsed.first_bom_line)
        bad = iter(parsed.bad)
        done = 0
        for i, (text, end, lineno) in enumerate(zip(parsed.texts, parsed.ends, parsed.lines)):
            while done < parsed.bad_before[i]:  # bad lines before this record
                e = next(bad)
                yield e.line, e.line, e
                done += 1
            yield end, lineno, text
        for e in bad:
            yield e.line, e.line, e


def _open_binary(path: Path):
    opener = _COMPRESSION.get(_split_suffix(path)[1] or "")
    return opener(path, "rb") if opener else open(path, "rb", buffering=1 << 20)


@contextlib.contextmanager
def _decompressing(path: Path):
    """Turn a decompressor's failure (truncated file, not that format, corrupt data) into one
    line naming the file and the fix."""
    try:
        yield
    except (EOFError, lzma.LZMAError, zlib.error, gzip.BadGzipFile, OSError) as e:
        compression = _split_suffix(path)[1]
        if compression is None or isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        reason = " ".join(str(e).split()) or type(e).__name__
        raise UserInputError(
            f"{path}: cannot decompress it as {compression} ({reason}): the file is truncated, "
            f"corrupt or not {compression} data; re-create it, or rename it to its real format") from None


def _decode_utf8(raw: bytes, path: Path, lineno: int) -> str | BadLineError:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if raw.startswith(_UTF16_BOMS):
            return BadLineError(str(path), lineno, "UTF-16 text (its byte-order mark "
                                f"0x{raw[0]:02x} 0x{raw[1]:02x}), not UTF-8; save the file as UTF-8")
        return BadLineError(
            str(path), lineno, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)"
        )


def _fields(obj: object, keys: tuple[str, ...], path: Path, where: int) -> tuple[str, ...] | BadLineError:
    if not isinstance(obj, dict):
        return BadLineError(str(path), where, f"expected a JSON object, got {type(obj).__name__}")
    out = []
    for key in keys:
        if key not in obj:
            present = ", ".join(sorted(map(str, obj)))[:120] or "none"
            return BadLineError(
                str(path), where, f"missing key {key!r} (keys present: {present}); choose the field with --json-keys"
            )
        value = obj[key]
        if not isinstance(value, str):
            kind = "null" if value is None else type(value).__name__
            return BadLineError(str(path), where, f"key {key!r} is {kind}, expected a string")
        out.append(value)
    return tuple(out)


def _starts_with_array(path: Path) -> bool:
    with _decompressing(path), _open_binary(path) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _iter_json_array(path: Path, keys: tuple[str, ...], stats: ReadStats, skip: int):
    # A top-level array is parsed whole (it cannot be streamed with the stdlib); errors name the
    # line of the syntax error, or the 1-based element number for a bad element.
    with _decompressing(path), _open_binary(path) as f:
        raw = f.read()
    stats.bytes_read += len(raw)
    whole = "; a top-level JSON array is parsed as a whole: fix the file, or write it as JSON lines"
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
        stats.add_boms(1, path, 1)
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:  # not skippable: there are no records to skip yet
        lineno = raw.count(b"\n", 0, e.start) + 1
        raise UserInputError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x}){whole}") from None
    except json.JSONDecodeError as e:
        raise UserInputError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno}){whole}") from None
    del raw
    for i in range(skip, len(data)):
        rec = _fields(data[i], keys, path, i + 1)
        if isinstance(rec, BadLineError):
            rec.unit = "element"
        yield i + 1, i + 1, rec


def _iter_parquet(path: Path, keys: tuple[str, ...], stats: ReadStats, skip: int):
    import datasets  # lazy: ~0.4 s to import, needed only for parquet

    import pyarrow

    def unreadable(e: Exception) -> UserInputError:
        reason = " ".join(str(e).split())[:200]
        return UserInputError(f"{path}: not a readable parquet file ({reason}); check the file "
                              "or give it the suffix of its real format")

    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
        columns = ds.column_names
    except (pyarrow.ArrowException, datasets.exceptions.DatasetGenerationError, OSError) as e:
        raise unreadable(e) from None
    if columns is not None:
        missing = [k for k in keys if k not in columns]
        if missing:
            raise UserInputError(
                f"{path}: missing column {missing[0]!r} (columns: {', '.join(columns)}); choose it with --json-keys"
            )
    if skip:
        ds = ds.skip(skip)
    rows = iter(ds)
    row_no = skip
    while True:
        try:
            row = next(rows)
        except StopIteration:
            break
        except (pyarrow.ArrowException, datasets.exceptions.DatasetGenerationError) as e:
            raise unreadable(e) from None
        row_no += 1
        rec = _fields(row, keys, path, row_no)
        if isinstance(rec, BadLineError):
            rec.unit = "row"
        yield row_no, row_no, rec
    stats.bytes_read += path.stat().st_size


def _record_reader(path: Path):
    """The reader of an input that is not read by lines."""
    fmt = input_format(path)
    return {"parquet": _iter_parquet, "arrow": _iter_arrow}.get(fmt, _iter_json_array)


def _open_arrow(path: Path):
    """A memory-mapped ``datasets.Dataset`` over a saved dataset directory or an ``.arrow`` file
    (an Arrow IPC stream, as ``datasets`` writes, or an IPC file); one-line UserInputError when
    it cannot be read."""
    import datasets  # lazy: ~0.4 s to import, needed only for Arrow and parquet inputs
    import pyarrow

    def unreadable(e: Exception, what: str) -> UserInputError:
        reason = " ".join(str(e).split())[:200]
        return UserInputError(f"{path}: not a readable {what} ({reason}); check it, or pass the "
                              "files in another supported format")

    if path.is_dir():
        _saved_dataset_files(path)
        try:
            return datasets.load_from_disk(str(path))
        except (pyarrow.ArrowException, OSError, ValueError) as e:
            raise unreadable(e, "dataset directory") from None
    try:
        return datasets.Dataset.from_file(str(path))  # an IPC stream
    except (pyarrow.ArrowException, OSError) as stream_error:
        try:  # an IPC file (Feather v2): zero-copy over the memory map as well
            table = pyarrow.ipc.open_file(pyarrow.memory_map(str(path))).read_all()
        except (pyarrow.ArrowException, OSError):
            raise unreadable(stream_error, "Arrow IPC stream or file") from None
        return datasets.Dataset(table)


def _iter_arrow(path: Path, keys: tuple[str, ...], stats: ReadStats, skip: int):
    """(rows consumed, row number, record or BadLineError) from row ``skip`` on, converting
    ``_ARROW_SLICE_ROWS`` rows of the key columns at a time. ``stats.bytes_read`` grows with the
    share of rows read, reaching ``input_bytes(path)`` at the end."""
    ds = _open_arrow(path)
    missing = [k for k in keys if k not in ds.column_names]
    if missing:
        raise UserInputError(f"{path}: missing column {missing[0]!r} (columns: "
                             f"{', '.join(ds.column_names)}); choose it with --json-keys")
    rows, total = ds.num_rows, input_bytes(path)
    view = ds.select_columns(list(dict.fromkeys(keys))).with_format("arrow")
    for start in range(skip, rows, _ARROW_SLICE_ROWS):
        table = view[start:start + _ARROW_SLICE_ROWS]
        columns = {k: table.column(k).to_pylist() for k in dict.fromkeys(keys)}
        for i in range(table.num_rows):
            rec = _fields({k: c[i] for k, c in columns.items()}, keys, path, start + i + 1)
            if isinstance(rec, BadLineError):
                rec.unit = "row"
            yield start + i + 1, start + i + 1, rec
        end = start + table.num_rows
        stats.bytes_read += total * end // rows - total * start // rows


# -- line-based inputs in blocks, parsed where the work is (tools/preprocess_data.py's workers) ---


@dataclass(frozen=True)
class LineBlock:
    """Whole lines of one input: ``data`` (bytes, ending in a newline unless it is the end of the
    file) starting ``offset`` decompressed bytes and ``line`` lines into file ``file``."""

    file: int
    offset: int
    line: int
    data: bytes


@dataclass
class ParsedRecords:
    """Records of a block in order: ``texts`` [records][keys]; for record i, ``ends[i]`` /
    ``lines[i]`` are the position after it (offset, line) and ``bad_before[i]`` the bad lines
    skipped in this block before it; ``bad`` every bad line of the block, in order; ``boms``
    the UTF-8 byte-order marks read as nothing at the start of its lines, the first on line
    ``first_bom_line``."""

    texts: list[tuple[str, ...]] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    bad_before: list[int] = field(default_factory=list)
    bad: list[BadLineError] = field(default_factory=list)
    line_count: int = 0  # lines the block held (blank and bad ones included)
    boms: int = 0
    first_bom_line: int = 0

    def add(self, record: tuple[str, ...] | BadLineError, end: int, line: int) -> bool:
        """Append a record (True) or a bad line (False) read up to (``end``, ``line``)."""
        if isinstance(record, BadLineError):
            self.bad.append(record)
            return False
        self.texts.append(record)
        self.ends.append(end)
        self.lines.append(line)
        self.bad_before.append(len(self.bad))
        return True

    def shift_lines(self, base: int) -> None:
        """Make line numbers counted from the block's start (see :func:`read_line_range`)
        absolute: add ``base``, the lines of the file before the block."""
        self.lines = [n + base for n in self.lines]
        for e in self.bad:
            e.line += base
        if self.boms:
            self.first_bom_line += base


def line_format(path: str | Path) -> InputFormat | None:
    """"jsonl" or "text" when ``path`` is read line by line (JSON lines, loose-JSON .json, text),
    else None (parquet, a .json top-level array)."""
    fmt = input_format(path)
    if fmt in ("parquet", "arrow") or (fmt == "json" and _starts_with_array(Path(path))):
        return None
    return "text" if fmt == "text" else "jsonl"


def iter_line_blocks(path: str | Path, file: int, offset: int = 0, line: int = 0,
                     block_bytes: int = 1 << 20) -> Iterator[LineBlock]:
    """Blocks of about ``block_bytes`` whole lines from (``offset``, ``line``) of ``path``
    (decompressed while streaming). Only cheap byte operations: the lines are parsed by
    :func:`parse_line_block`, in whichever process gets the block. A line longer than a block
    makes a longer block."""
    path = Path(path)
    with _decompressing(path), _open_binary(path) as f:
        if offset:
            f.seek(offset)
        pending: list[bytes] = []
        while True:
            chunk = f.read(block_bytes)
            if not chunk:
                if pending:
                    yield LineBlock(file, offset, line, b"".join(pending))
                return
            cut = chunk.rfind(b"\n") + 1
            if cut == 0:
                pending.append(chunk)
                continue
            data = b"".join([*pending, chunk[:cut]]) if pending else chunk[:cut]
            pending = [chunk[cut:]] if cut < len(chunk) else []
            yield LineBlock(file, offset, line, data)
            offset += len(data)
            line += data.count(b"\n")


def read_line_range(path: str | Path, file: int, start: int, end: int, at_line_start: bool) -> LineBlock:
    """The lines of an uncompressed file that *start* in bytes [start, end): read by the worker
    that parses them, so the reading process ships only offsets. ``at_line_start``: ``start`` is
    known to begin a line (the file's start or a resume point); otherwise the line running through
    byte ``start`` belongs to the previous range. Lines are numbered from the block's first line
    (``line`` 0): the caller adds the lines before it (:meth:`ParsedRecords.shift_lines`)."""
    with open(path, "rb") as f:
        pos = start
        if not at_line_start:
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())  # after the newline at or past byte start - 1
        if pos >= end:
            return LineBlock(file, pos, 0, b"")
        f.seek(pos)
        data = f.read(end - pos)
        if data and not data.endswith(b"\n"):
            data += f.readline()  # the last line may run past end
    return LineBlock(file, pos, 0, data)


def parse_line_block(block: LineBlock, path: str | Path, fmt: InputFormat,
                     keys: Sequence[str]) -> ParsedRecords:
    """The records of ``block`` exactly as :func:`iter_positioned_records` reads them (same
    records, positions, bad lines and messages)."""
    path = Path(path)
    keys = tuple(keys)
    out = ParsedRecords()
    pieces = block.data.split(b"\n")
    if pieces[-1] == b"":
        pieces.pop()  # the block ends with a newline
    out.line_count = len(pieces)
    offset, lineno = block.offset, block.line
    last = len(pieces) - 1
    for i, raw in enumerate(pieces):
        offset += len(raw) + (1 if i < last or block.data.endswith(b"\n") else 0)
        lineno += 1
        if raw.startswith(_BOM):  # read as nothing (module docstring)
            raw = raw[len(_BOM):]
            out.boms += 1
            out.first_bom_line = out.first_bom_line or lineno
        rec = _decode_utf8(raw, path, lineno)
        if not isinstance(rec, BadLineError):
            if fmt == "text":
                rec = (rec.rstrip("\r"),)
            elif not rec or rec.isspace():
                continue
            else:
                try:
                    rec = _fields(json.loads(rec), keys, path, lineno)
                except json.JSONDecodeError as e:
                    rec = BadLineError(str(path), lineno, f"invalid JSON: {e.msg} (column {e.colno})")
        out.add(rec, offset, lineno)
    return out


def iter_record_batches(path: str | Path, keys: Sequence[str], offset: int = 0, line: int = 0,
                        max_records: int = 512, max_chars: int = 1 << 20
                        ) -> Iterator[tuple[ParsedRecords, int]]:
    """(records, input bytes consumed) batches of a file that is not read by lines (parquet,
    Arrow, a saved dataset directory, a .json top-level array), parsed here, from element/row
    ``line`` on (``offset`` is the same count for these formats)."""
    path = Path(path)
    stats = ReadStats()
    source = _record_reader(path)(path, tuple(keys), stats, line)
    batch, chars, reported = ParsedRecords(), 0, 0

    def done(batch: ParsedRecords) -> ParsedRecords:
        if stats.boms:  # a JSON array's byte-order mark, counted with the first batch
            batch.boms, batch.first_bom_line, stats.boms = stats.boms, 1, 0
        return batch

    for end, where, rec in source:
        if not batch.add(rec, end, where):
            continue
        chars += sum(map(len, rec))
        if len(batch.texts) >= max_records or chars >= max_chars:
            yield done(batch), stats.bytes_read - reported
            reported = stats.bytes_read
            batch, chars = ParsedRecords(), 0
    yield done(batch), stats.bytes_read - reported
