"""Every place the product sends a user to names a page and a section that exist: a
``docs/<page>.md#<anchor>`` (or ``README.md#…``, ``bench/README.md#…``) in rtd_scale/, tools/,
slurm/ or bench/ names a page that is there and one of its headings' anchors, and a quoted name
after "README" (``see the README, "X"``, the form used before the manual moved to docs/) is a
heading or a bold lead-in of README.md itself. The run summary's plateau verdict once named a
section that had been renamed."""
from __future__ import annotations

import functools
import re
from pathlib import Path

from tests.helpers.env import REPO
from tests.helpers.markdown import resolve

SEARCHED = ("rtd_scale", "tools", "slurm", "bench")
# a page of the manual, with an optional anchor: docs/slurm.md, ../docs/resume.md#resume-at-…
PAGE = re.compile(r"(?<![\w/.-])((?:\.\./)?(?:docs/[\w-]+\.md|(?:bench/)?README\.md))(#[\w-]+)?")
# the older form: README, "Section" / README "Section" / the README's "Section"
QUOTED = re.compile(r"README(?:'s|,)?\s+\\?\"([^\"\\]+)\\?\"")


@functools.cache
def _texts() -> dict[Path, str]:
    """The product's sources, scripts and pages under ``SEARCHED``, by path."""
    files = [p for top in SEARCHED for ext in ("py", "sh", "md")
             for p in sorted((REPO / top).rglob(f"*.{ext}")) if "__pycache__" not in p.parts]
    return {p: p.read_text(encoding="utf-8") for p in files}


def page_references(text: str) -> set[str]:
    """The ``page.md#anchor`` references of ``text``, relative to the repository root."""
    return {path.removeprefix("../") + anchor for path, anchor in PAGE.findall(text)}


def quoted_sections(text: str) -> set[str]:
    """The quoted section names after "README" in ``text``, read across the line breaks of a
    comment (``# … see README,`` / ``# "Section"``)."""
    return set(QUOTED.findall(" ".join(re.sub(r"\n\s*#\s*", " ", text).split())))


def readme_titles() -> set[str]:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    titles = {m.strip() for m in re.findall(r"^#+ (.+)$", readme, flags=re.M)}
    return titles | {m.rstrip(".").strip() for m in re.findall(r"\*\*([^*]+)\*\*", readme)}


def test_every_page_and_section_the_product_names_exists():
    refs: dict[str, set[str]] = {}
    for path, text in _texts().items():
        for ref in page_references(text):
            refs.setdefault(ref, set()).add(str(path.relative_to(REPO)))
    # the summary's plateau verdicts (training/summary.py), and the comments that cite a page
    assert "docs/main-job.md#what-the-main-job-shows" in refs
    assert "docs/resume.md#resume-at-another-size" in refs
    broken = {ref: (files, why) for ref, files in refs.items()
              if (why := resolve(REPO / "README.md", ref))}
    assert not broken, broken


def test_every_readme_section_a_message_quotes_is_in_the_readme():
    titles = readme_titles()
    missing = {}
    for path, text in _texts().items():
        for name in quoted_sections(text):
            if name not in titles:
                missing.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not missing, (f"{missing}: these sections moved to docs/; name the page and its "
                         "anchor instead (docs/<page>.md#<anchor>)")


def test_the_checks_find_a_wrong_reference():
    """The controls: the messages before the manual moved to docs/ (a section that stayed in the
    README passes; one that moved, or was renamed, does not), and a page or anchor that is not
    there."""
    before = ('"0.5); train longer (see the README, \\"What the main job shows\\")")\n'
              '(README, "Resume at another size").\n'
              '"train longer (see the README, \\"What 300 CPU steps can and cannot show\\")")')
    assert quoted_sections(before) == {"What the main job shows", "Resume at another size",
                                       "What 300 CPU steps can and cannot show"}
    assert quoted_sections(before) - readme_titles() == {"Resume at another size",
                                                          "What 300 CPU steps can and cannot show"}
    text = ("(see docs/main-job.md#what-300-cpu-steps-can-and-cannot-show) and "
            "[x](../docs/resume.md#resume-at-another-size); docs/no-such-page.md")
    refs = page_references(text)
    assert refs == {"docs/main-job.md#what-300-cpu-steps-can-and-cannot-show",
                    "docs/resume.md#resume-at-another-size", "docs/no-such-page.md"}
    assert [r for r in sorted(refs) if resolve(REPO / "README.md", r)] == [
        "docs/main-job.md#what-300-cpu-steps-can-and-cannot-show", "docs/no-such-page.md"]
