"""README.md and the manual in docs/ as the suite reads them: the pages, their headings and the
anchors GitHub gives them, their relative links, and a section's text by its heading."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path

from tests.helpers.env import REPO

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
# [text](target) and ![alt](target); the text may wrap onto the next line
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line count kept), so that a ``#`` comment in a
    shell block is not a heading and code is not a link."""
    out, fenced = [], False
    for line in text.split("\n"):
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text lower-cased, every character that is
    not a letter, mark, decimal or letter number, connector punctuation, ``-`` or a space removed
    (Ruby's ``[^\\p{Word}\\- ]``, as github.com's renderer does), spaces turned into ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    keep = []
    for ch in text.strip().lower():
        cat = unicodedata.category(ch)
        if ch in "- " or cat[0] in "LM" or cat in ("Nd", "Nl", "Pc"):
            keep.append(ch)
    return "".join(keep).replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The ATX headings of a page, in order, outside code blocks."""
    return [m.group(2) for line in prose(path.read_text(encoding="utf-8")).split("\n")
            if (m := HEADING.match(line))]


def anchors(path: Path) -> set[str]:
    """Every anchor of a page: each heading's slug, a repeated slug numbered ``-1``, ``-2``, …"""
    seen: dict[str, int] = {}
    out = set()
    for title in headings(path):
        slug = github_slug(title)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image of a page outside code (fenced or inline)."""
    text = prose(path.read_text(encoding="utf-8"))
    text = INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in LINK.finditer(text)]


def resolve(source: Path, target: str) -> str | None:
    """Why the relative link ``target`` written in ``source`` does not resolve, or None when it
    does: the file or folder must exist, and an anchor must be one of the target page's."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: — not checked here
        return None
    path, _, anchor = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    if not dest.exists():
        return f"{path}: no such file"
    if anchor:
        if dest.suffix != ".md":
            return f"{target}: an anchor into a file that is not a Markdown page"
        if anchor not in anchors(dest):
            return f"{target}: {dest.relative_to(REPO)} has no heading with the anchor #{anchor}"
    return None


def section(path: Path, heading: str) -> str:
    """The text under ``heading`` (its exact title, any level) up to the next heading of the same
    or a higher level."""
    lines = path.read_text(encoding="utf-8").split("\n")
    clean = prose("\n".join(lines)).split("\n")
    for i, line in enumerate(clean):
        m = HEADING.match(line)
        if m and m.group(2) == heading:
            level = len(m.group(1))
            end = next((j for j in range(i + 1, len(lines))
                        if (h := HEADING.match(clean[j])) and len(h.group(1)) <= level), len(lines))
            return "\n".join(lines[i + 1:end])
    raise AssertionError(f"{path.relative_to(REPO)} has no heading {heading!r}")
