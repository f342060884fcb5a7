"""Downstream tasks as plain lists, read from local files, a ``datasets`` name or the Brown
corpus.

A :class:`Task` holds the training and evaluation examples and the label names:
- ``classification`` / ``regression``: examples ``(texts, label)``, ``texts`` one sentence or a
  pair; files in GLUE's layout — a header row naming the columns, a sentence column or a
  sentence pair, a label column — as ``.tsv`` (GLUE's own files: tab-separated, no quoting),
  ``.csv`` or ``.jsonl`` / ``.json`` (one object a line);
- ``token-classification``: examples ``(words, tags)``; ``word/tag`` files (one sentence a line,
  Brown's layout) or CoNLL files (a word a line, whitespace-separated columns, the tag last,
  sentences separated by a blank line, ``-DOCSTART-`` lines skipped);
- ``brown-pos`` / ``brown-genre``: the offline tasks on the Brown corpus (``brown.py``).
"""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path
from typing import Literal, Optional, Sequence

from rtd_scale.cli_errors import UserInputError
from rtd_scale.finetune import brown

Kind = Literal["classification", "regression", "token-classification"]
TASKS = ("classification", "regression", "token-classification", "brown-pos", "brown-genre")
TABLE_SUFFIXES = (".tsv", ".csv", ".jsonl", ".json")
TAGGED_SUFFIXES = (".txt", ".conll", ".tsv", ".iob", ".bio", "")
# what GLUE's files (and the `datasets` copies of them) name their text columns, in the order
# tried when --text-columns is not given
TEXT_COLUMNS = (("sentence1", "sentence2"), ("question1", "question2"), ("question", "sentence"),
                ("premise", "hypothesis"), ("sentence",), ("text",))


@dataclasses.dataclass(kw_only=True)
class Task:
    """One task's data. ``train`` / ``eval``: ``(texts tuple, label)`` for classification and
    regression (label a class name or a float), ``(words, tags)`` for token classification;
    ``labels``: the class or tag names in id order (empty for regression); ``source``: where the
    data came from, for the report."""

    name: str
    kind: Kind
    train: list
    eval: list
    labels: list[str]
    source: str


# --------------------------------------------------------------------------------------------
# tables: classification and regression


def read_table(path: Path) -> list[dict]:
    """The rows of a ``.tsv`` / ``.csv`` / ``.jsonl`` / ``.json`` file as dicts by column name.

    Raises:
        UserInputError: an unknown suffix, a row that is not valid JSON, or no rows."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TABLE_SUFFIXES:
        raise UserInputError(f"{path}: unknown file type {suffix or '(none)'!r}; use one of "
                             f"{', '.join(TABLE_SUFFIXES)} with a header row (GLUE's layout)")
    text = path.read_text(encoding="utf-8")
    if suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserInputError(f"{path}:{lineno}: not a JSON object ({e.msg}); write one "
                                     "object a line") from None
            if not isinstance(row, dict):
                raise UserInputError(f"{path}:{lineno}: not a JSON object; write one object a line")
            rows.append(row)
    else:
        quoting = csv.QUOTE_NONE if suffix == ".tsv" else csv.QUOTE_MINIMAL
        rows = list(csv.DictReader(text.splitlines(), delimiter="\t" if suffix == ".tsv" else ",",
                                   quoting=quoting))
    if not rows:
        raise UserInputError(f"{path}: no rows (a header row, then one example a line)")
    return rows


def _text_columns(path: Path, columns: Sequence[str], wanted: Optional[Sequence[str]]):
    if wanted:
        missing = [c for c in wanted if c not in columns]
        if missing:
            raise UserInputError(f"{path}: no column {missing[0]!r} (columns: {', '.join(columns)}); "
                                 "fix --text-columns")
        return tuple(wanted)
    for names in TEXT_COLUMNS:
        if all(c in columns for c in names):
            return names
    raise UserInputError(f"{path}: no sentence column found (columns: {', '.join(columns)}); "
                         "name one or two with --text-columns")


def _examples(path: Path, rows: list[dict], text_cols, label_col: str, kind: Kind) -> list:
    columns = list(rows[0])
    if label_col not in columns:
        raise UserInputError(f"{path}: no label column {label_col!r} (columns: "
                             f"{', '.join(columns)}); pass --label-column")
    out = []
    for i, row in enumerate(rows):
        label = row.get(label_col)
        where = f"{path}: row {i + 1}"
        if label is None or str(label).strip() == "":
            raise UserInputError(f"{where}: empty {label_col!r}; every training and evaluation "
                                 "row needs a label")
        if kind == "regression":
            try:
                label = float(label)
            except (TypeError, ValueError):
                raise UserInputError(f"{where}: label {label!r} is not a number (--task "
                                     "regression); use --task classification for classes") from None
        else:
            label = str(label).strip()
        texts = tuple("" if row.get(c) is None else str(row[c]) for c in text_cols)
        out.append((texts, label))
    return out


def _label_names(train: list, eval_: list) -> list[str]:
    """Class names in id order: sorted numerically when every one is an integer, else as text."""
    names = {label for _, label in train} | {label for _, label in eval_}
    try:
        return sorted(names, key=int)
    except ValueError:
        return sorted(names)


def table_task(kind: Kind, train_file: Path, eval_file: Path, *,
               text_columns: Optional[Sequence[str]] = None, label_column: str = "label") -> Task:
    """A classification or regression task from a training and an evaluation file."""
    parts = []
    cols = None
    for path in (train_file, eval_file):
        rows = read_table(path)
        cols = _text_columns(path, list(rows[0]), text_columns or cols)
        parts.append(_examples(path, rows, cols, label_column, kind))
    labels = [] if kind == "regression" else _label_names(*parts)
    return Task(name=kind, kind=kind, train=parts[0], eval=parts[1], labels=labels,
                source=f"{train_file} / {eval_file} ({' + '.join(cols)} → {label_column})")


def dataset_task(kind: Kind, name: str, config: Optional[str], *,
                 text_columns: Optional[Sequence[str]] = None, label_column: str = "label",
                 eval_split: str = "validation") -> Task:
    """A classification or regression task from ``datasets.load_dataset(name, config)``: its
    ``train`` and ``eval_split`` splits (needs the Hugging Face hub, or the dataset in the
    local ``datasets`` cache).

    Raises:
        UserInputError: the dataset cannot be loaded (offline, unknown name), or lacks a split."""
    try:
        import datasets

        ds = datasets.load_dataset(name, config)
    except Exception as e:  # offline, unknown name, missing config: datasets' own message
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserInputError(f"--dataset-name {name}: cannot load it ({type(e).__name__}: "
                             f"{first}); where the machine is offline, pass --train-file and "
                             "--validation-file instead") from None
    parts = []
    for split in ("train", eval_split):
        if split not in ds:
            raise UserInputError(f"--dataset-name {name}: no {split!r} split (splits: "
                                 f"{', '.join(ds)}); pick one with --validation-split")
        rows = [dict(r) for r in ds[split]]
        where = Path(f"{name}[{split}]")
        cols = _text_columns(where, list(rows[0]), text_columns)
        if kind == "classification" and hasattr(ds[split].features.get(label_column), "names"):
            names = ds[split].features[label_column].names
            rows = [{**r, label_column: names[r[label_column]] if r[label_column] >= 0 else ""}
                    for r in rows]
        parts.append(_examples(where, rows, cols, label_column, kind))
    labels = [] if kind == "regression" else _label_names(*parts)
    return Task(name=f"{name}{'/' + config if config else ''}", kind=kind, train=parts[0],
                eval=parts[1], labels=labels, source=f"datasets {name} {config or ''}".strip())


# --------------------------------------------------------------------------------------------
# tagged files: token classification


def _is_word_tag(token: str) -> bool:
    word, sep, tag = token.rpartition("/")
    return bool(sep and word and tag)


def read_tagged(path: Path) -> list[tuple[list[str], list[str]]]:
    """(words, tags) sentences of a ``word/tag`` file (every token of every line has a ``/``)
    or a CoNLL file (module docstring), told apart by their first non-empty line.

    Raises:
        UserInputError: a token without ``/`` in a word/tag file, a CoNLL line with one column,
        or no sentences."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    first = next((l for l in lines if l.strip() and not l.startswith("-DOCSTART-")), "")
    word_tag = bool(first) and all(_is_word_tag(t) for t in first.split())
    sents: list[tuple[list[str], list[str]]] = []
    if word_tag:
        for lineno, line in enumerate(lines, 1):
            words, tags = [], []
            for t in line.split():
                if not _is_word_tag(t):
                    raise UserInputError(f"{path}:{lineno}: token {t!r} is not word/tag (a "
                                         "word/tag file: one sentence a line)")
                word, _, tag = t.rpartition("/")
                words.append(word)
                tags.append(tag)
            if words:
                sents.append((words, tags))
    else:
        words, tags = [], []
        for lineno, line in enumerate(lines + [""], 1):
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                if words:
                    sents.append((words, tags))
                words, tags = [], []
                continue
            if len(fields) < 2:
                raise UserInputError(f"{path}:{lineno}: {line.strip()!r} has one column; a CoNLL "
                                     "line is 'word … tag' (a blank line between sentences)")
            words.append(fields[0])
            tags.append(fields[-1])
    if not sents:
        raise UserInputError(f"{path}: no sentences (word/tag lines or CoNLL 'word … tag' lines)")
    return sents


def tagged_task(train_file: Path, eval_file: Path) -> Task:
    train, eval_ = read_tagged(train_file), read_tagged(eval_file)
    tags = sorted({t for _, ts in train + eval_ for t in ts})
    return Task(name="token-classification", kind="token-classification", train=train,
                eval=eval_, labels=tags, source=f"{train_file} / {eval_file}")


# --------------------------------------------------------------------------------------------
# the Brown corpus


def brown_pos_task(brown_dir: Path, train_n: Optional[int], eval_n: Optional[int]) -> Task:
    """Part-of-speech tagging (coarsened Brown tags), split by file (``brown.split_brown``)."""
    train, test = brown.split_brown(brown.read_brown(brown_dir), train_n, eval_n)
    as_pairs = [([w for w, _ in s], [t for _, t in s]) for s in train], \
        [([w for w, _ in s], [t for _, t in s]) for s in test]
    tags = sorted({t for _, ts in as_pairs[0] + as_pairs[1] for t in ts})
    return Task(name="brown-pos", kind="token-classification", train=as_pairs[0],
                eval=as_pairs[1], labels=tags, source=f"Brown corpus {brown_dir}")


def brown_genre_task(brown_dir: Path, train_n: Optional[int], eval_n: Optional[int],
                     passage_words: int = 64) -> Task:
    """Genre classification (15 categories) of passages, split by file (``brown.genre_split``)."""
    train, test = brown.genre_split(brown.read_brown(brown_dir), train_n, eval_n, passage_words)
    train = [((p,), g) for p, g in train]
    test = [((p,), g) for p, g in test]
    return Task(name="brown-genre", kind="classification", train=train, eval=test,
                labels=sorted({g for _, g in train + test}),
                source=f"Brown corpus {brown_dir}, passages of ≥ {passage_words} words")


def find_split_files(data_dir: Path, suffixes: Sequence[str]) -> tuple[Path, Path]:
    """GLUE's layout: ``train.*`` and ``dev.*`` (or ``validation.*``) in ``data_dir``.

    Raises:
        UserInputError: either is missing."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserInputError(f"--data-dir {data_dir}: no such directory")
    found = []
    for stems in (("train",), ("dev", "validation", "dev_matched")):
        hits = [data_dir / f"{s}{x}" for s in stems for x in suffixes if (data_dir / f"{s}{x}").is_file()]
        if not hits:
            raise UserInputError(f"--data-dir {data_dir}: no {stems[0]} file ({stems[0]}"
                                 f"{'|'.join(x for x in suffixes if x)}); pass --train-file and "
                                 "--validation-file")
        found.append(hits[0])
    return found[0], found[1]
