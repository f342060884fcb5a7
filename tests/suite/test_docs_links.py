"""Every relative link and anchor in README.md and docs/*.md resolves: the file or folder exists and
the anchor is one GitHub gives a heading of the target page (``tests/helpers/markdown.py``). The
README lists every page of docs/, and each page opens with a summary of a few lines."""
from __future__ import annotations

from tests.helpers.env import REPO
from tests.helpers.markdown import (anchors, github_slug, headings, links, pages, prose,
                                    resolve)


def test_github_slugs_of_known_headings():
    # github.com's anchors for these headings (punctuation and symbols dropped, not collapsed)
    assert github_slug("Which checkpoint --load takes") == "which-checkpoint---load-takes"
    assert github_slug("Weights & Biases and the profiler") == "weights--biases-and-the-profiler"
    assert github_slug("Long context: 8,192 tokens and the context extension") == \
        "long-context-8192-tokens-and-the-context-extension"
    assert github_slug("`sharing_ablation.py` and `pos_probe.py`") == \
        "sharing_ablationpy-and-pos_probepy"
    assert github_slug("Is it learning?") == "is-it-learning"
    assert github_slug("Export to Hugging Face (ModernBERT)") == "export-to-hugging-face-modernbert"
    assert github_slug("What works — TP × PP") == "what-works--tp--pp"


def test_a_repeated_heading_is_numbered_and_code_is_not_a_heading(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n\n## Notes\n\n```bash\n# not a heading\n```\n\n## Notes\n")
    assert headings(page) == ["A", "Notes", "Notes"]
    assert anchors(page) == {"a", "notes", "notes-1"}
    assert "not a heading" not in prose(page.read_text())


def test_every_relative_link_and_anchor_resolves():
    broken, checked = [], 0
    for page in pages():
        for line, target in links(page):
            checked += 1
            why = resolve(page, target)
            if why:
                broken.append(f"{page.relative_to(REPO)}:{line}: {why}")
    assert not broken, "\n".join(broken)
    assert checked > 60, checked  # the pages and their cross-links were read


def test_a_broken_link_or_anchor_is_found():
    readme = REPO / "README.md"
    assert resolve(readme, "docs/main-job.md#what-the-main-job-shows") is None
    assert resolve(readme, "docs/main-job.md#what-300-cpu-steps-can-and-cannot-show") == (
        "docs/main-job.md#what-300-cpu-steps-can-and-cannot-show: docs/main-job.md has no "
        "heading with the anchor #what-300-cpu-steps-can-and-cannot-show")
    assert resolve(readme, "docs/no-such-page.md") == "docs/no-such-page.md: no such file"
    assert resolve(REPO / "docs" / "flags.md", "#presets") is None
    assert resolve(REPO / "docs" / "flags.md", "#slurm") is not None  # another page's heading


def test_the_readme_lists_every_page_and_each_opens_with_a_summary():
    linked = {target.split("#")[0] for _, target in links(REPO / "README.md")}
    docs = sorted(p for p in pages() if p.parent.name == "docs")
    assert len(docs) >= 11
    assert [p.name for p in docs if f"docs/{p.name}" not in linked] == []
    for page in docs:
        text = page.read_text(encoding="utf-8")
        title, _, rest = text.partition("\n\n")
        summary = rest.split("\n\n", 1)[0].splitlines()
        assert title.startswith("# ") and "\n" not in title, page.name
        assert 2 <= len(summary) <= 8 and not summary[0].startswith(("#", "|", "```", "-", "!")), \
            (page.name, summary[:2])
