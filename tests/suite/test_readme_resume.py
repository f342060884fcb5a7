"""The README and the manual in docs/ say one thing about continuing a run at another size:
`--load` does it, exactly, at another TP, PP or DP size or ZeRO stage (docs/resume.md's "Resume
at another size" section, pinned by tests/e2e/test_resume_layout.py); no part sends a TP or PP
change through an export and `--pretrained-checkpoint`, as the README once did."""
from __future__ import annotations

import re

from tests.helpers.env import REPO
from tests.helpers.markdown import pages, section

# a change of the tensor- or pipeline-parallel size, in the README's words
SIZE_CHANGE = re.compile(r"\b(?:another|other|a new|a different)\s+(?:TP|PP|tensor-parallel|"
                         r"pipeline-parallel|tensor|pipeline)\b")
# the route of weights only
EXPORT_ROUTE = re.compile(r"\bexport it\b|--pretrained-checkpoint|tools/export_hf\.py")


def _clauses(text: str) -> list[str]:
    """The sentences and semicolon clauses of the README's prose (code blocks left out), each
    on one line."""
    prose = re.sub(r"```.*?```", "\n\n", text, flags=re.S)
    return [" ".join(c.split()) for c in re.split(r"(?<=[.;])\s|\n\s*\n", prose) if c.strip()]


def offending_clauses(text: str) -> list[str]:
    return [c for c in _clauses(text) if SIZE_CHANGE.search(c) and EXPORT_ROUTE.search(c)]


def test_resume_at_another_size_is_load():
    resume = section(REPO / "docs" / "resume.md", "Resume at another size")
    first = " ".join(resume.split()).split(": ", 1)[0]
    assert first.startswith("`--load` continues a checkpoint saved at another tensor-parallel, "
                            "pipeline-parallel or data-parallel size, another ZeRO stage (0–3)")
    assert first.endswith(", exactly")
    starting = section(REPO / "docs" / "hf.md", "Starting from weights").strip().split("\n\n")[0]
    assert "To continue a run at another TP, PP or DP size or ZeRO stage, `--load` does it, " \
           "exactly" in " ".join(starting.split())


def test_no_part_sends_a_tp_or_pp_change_through_an_export():
    for page in pages():
        assert offending_clauses(page.read_text(encoding="utf-8")) == [], page.name
    # what the README said before (the control: the check finds it)
    before = ("To continue a run at another data-parallel size or ZeRO stage, `--load` does it "
              "with\nthe optimizer state (see \"Resume at another size\"); at another TP or PP "
              "size, export it, then\nstart a new run with `--pretrained-checkpoint hf/base "
              "--save runs/next`.")
    assert offending_clauses(before) == [
        "at another TP or PP size, export it, then start a new run with `--pretrained-checkpoint "
        "hf/base --save runs/next`."]
