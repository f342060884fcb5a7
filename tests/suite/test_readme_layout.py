"""The manual's Layout page (docs/layout.md) names every file of the product, its tools, test
oracles, Slurm scripts and benchmarks, and every folder of tests/, and names nothing that is not
there: a new module appears in the list with its job, and a moved one moves there too."""
from __future__ import annotations

import re
import subprocess

from tests.helpers.env import REPO

TOPS = ("rtd_scale", "tools", "verify", "slurm", "bench")


def layout_tree() -> dict[str, str]:
    """Path → its description, from the Layout page's code block (two spaces a level; an entry
    ending in ``/`` is a folder)."""
    page = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    block = page.split("```\n", 1)[1].split("```", 1)[0]
    entries, stack = {}, []
    for line in block.splitlines():
        m = re.match(r"( *)(\S+)\s*(.*)", line)
        assert m and len(m.group(1)) % 2 == 0, f"Layout line {line!r}"
        depth = len(m.group(1)) // 2
        stack = stack[:depth]
        path = "/".join([*stack, m.group(2).rstrip("/")])
        entries[path] = m.group(3)
        if m.group(2).endswith("/"):
            stack.append(m.group(2).rstrip("/"))
    return entries


def tracked(*tops: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", *tops], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    return [p for p in out if p.endswith((".py", ".sh")) and not p.endswith("__init__.py")]


def test_every_file_is_named_with_its_job():
    tree = layout_tree()
    files = tracked(*TOPS)
    assert len(files) > 100, files  # the product is there to check

    def named(path: str) -> bool:
        folder, _, name = path.rpartition("/")
        # a folder's line may name its pieces by stem ("gpu/  its pieces: workloads, …")
        return path in tree or (folder in tree and re.search(
            rf"\b{re.escape(name.rsplit('.', 1)[0])}\b", tree[folder]) is not None)

    missing = [p for p in files if not named(p)]
    assert not missing, f"files docs/layout.md does not name: {missing}"
    assert all(tree[p] for p in files if p in tree), "every file's line says its job"


def test_everything_named_exists_and_every_test_folder_is_named():
    tree = layout_tree()
    gone = [p for p in tree if not (REPO / p).exists()]
    assert not gone, f"docs/layout.md names what is not in the tree: {gone}"
    folders = {p.name for p in (REPO / "tests").iterdir()
               if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders and folders <= {p.split("/", 1)[1] for p in tree if p.startswith("tests/")}
