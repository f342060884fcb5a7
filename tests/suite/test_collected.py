"""The README's test command collects every ``tests/**/test_*.py`` (STYLE rule 11): pytest's default
``norecursedirs`` skips folders named ``dist``, ``build``, ``venv`` and dot-folders silently, which
once kept the whole multi-process tier out of CI."""
from __future__ import annotations

import ast
import re
import subprocess
import sys

from tests.helpers.env import REPO, readme_test_command


def test_readme_test_command_collects_every_test_file():
    args = readme_test_command()
    assert "tests" in args, args
    # collected in this process's way, not by xdist's workers (whose collection is not printed)
    for flag in ("-n", "--dist"):  # xdist's: a flag and its value
        if flag in args:
            del args[args.index(flag):args.index(flag) + 2]
    args = [a for a in args if a != "--no-loadscope-reorder"]  # xdist's, without a value
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "-p", "no:xdist", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # -q prints node ids (``file::test``), -qq one ``file: count`` line per file
    collected = {re.split(r"::|: \d+$", ln)[0] for ln in out.stdout.splitlines()
                 if "::" in ln or re.search(r"\.py: \d+$", ln)}
    on_disk = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    assert on_disk, "no test files found"
    missing = sorted(on_disk - collected)
    assert not missing, f"test files the README's test command never collects: {missing}"
    assert any(f.startswith("tests/multiproc/") for f in collected)


def imported_modules(path) -> list[str]:
    """The absolute names of the modules a ``tests/`` file imports, and of each name a ``from``
    import takes (``from tests.x import y`` gives ``tests.x`` and ``tests.x.y``): relative
    imports resolved against the file's package."""
    package = list(path.relative_to(REPO).parent.parts)
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names += [module, *(f"{module}.{a.name}" for a in node.names)]
    return names


def test_no_test_module_imports_another():
    """Shared test code lives in ``tests/helpers/`` (STYLE rule 11): a test module imported by
    another runs its module-level set-up twice and ties the two files' fixtures together, and a
    helper kept anywhere else in ``tests/`` is one a test module would import. So a file under
    ``tests/`` imports from the ``tests`` package only ``tests.helpers…`` and ``tests.conftest``."""
    bad = [f"{path.relative_to(REPO)}: {name}"
           for path in sorted((REPO / "tests").rglob("*.py"))
           for name in imported_modules(path)
           if re.match(r"tests\.(?!(helpers|conftest)(\.|$))", name)]
    assert not bad, bad
