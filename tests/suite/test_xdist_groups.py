"""The README's test command keeps a module's tests on one pytest-xdist worker (so a module's
shared runs, module-scoped fixtures that launch training once for several tests, happen once),
and the modules marked ``xdist_group("machine-wide")`` (apt, Slurm daemons, port 29500) on one
worker together (tests/conftest.py). Both rest on pytest-xdist's ``--dist loadgroup`` seeing the
markers, which it silently stops doing with some pytest releases (pyproject.toml's pin)."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers.env import REPO, readme_test_command

PLAIN = "def test_{i}():\n    pass\n"
MACHINE_WIDE = "import pytest\npytestmark = pytest.mark.xdist_group('machine-wide')\n"


def _workers(tmp_path, plugin: bool) -> dict[str, set[str]]:
    """Module → the workers its tests ran on, for two plain modules of eight tests and two
    machine-wide modules of two, run with the README command's xdist flags (and
    tests/conftest.py's grouping hook when ``plugin``)."""
    for name, head, n in (("plain_a", "", 8), ("plain_b", "", 8),
                          ("wide_a", MACHINE_WIDE, 2), ("wide_b", MACHINE_WIDE, 2)):
        (tmp_path / f"test_{name}.py").write_text(
            head + "".join(PLAIN.format(i=i) for i in range(n)))
    args = [a for a in readme_test_command()
            if a not in ("tests", "-q") and not a.startswith("--durations")]
    assert "loadgroup" in args, args
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                        *(["-p", "tests.conftest"] if plugin else []), *args, str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran: dict[str, set[str]] = {}
    for worker, module in re.findall(r"\[(gw\d+)\].*? PASSED (?:\S*/)?test_(\w+)\.py::", r.stdout):
        ran.setdefault(module, set()).add(worker)
    assert sorted(ran) == ["plain_a", "plain_b", "wide_a", "wide_b"], r.stdout[-3000:]
    return ran


def test_a_module_runs_on_one_worker_and_the_machine_wide_ones_on_the_same(tmp_path):
    ran = _workers(tmp_path, plugin=True)
    assert all(len(workers) == 1 for workers in ran.values()), ran
    assert ran["wide_a"] == ran["wide_b"], ran


def test_without_the_grouping_a_module_spreads_over_the_workers(tmp_path):
    """The control: the same modules without tests/conftest.py's hook are split, so the test
    above can fail."""
    ran = _workers(tmp_path, plugin=False)
    assert len(ran["plain_a"]) > 1, ran


def _collected(tmp_path, plugin: bool) -> list[str]:
    """The modules in the order the README command hands them out (collection order, which
    ``--no-loadscope-reorder`` keeps): a plain module of eight tests, a machine-wide one of two."""
    for name, head, n in (("plain_a", "", 8), ("wide_a", MACHINE_WIDE, 2)):
        (tmp_path / f"test_{name}.py").write_text(
            head + "".join(PLAIN.format(i=i) for i in range(n)))
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                        "no:cacheprovider", *(["-p", "tests.conftest"] if plugin else []),
                        str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return re.findall(r"test_(\w+)\.py::", r.stdout)


def test_the_long_groups_are_handed_out_first(tmp_path):
    """Longest first (tests/conftest.py's TIERS): the machine-wide module, fewer tests but
    launches, before the plain one that collects first; xdist's own reorder (most tests
    first) is off in the README command. The control: without the hook, collection order."""
    assert "--no-loadscope-reorder" in readme_test_command()
    assert _collected(tmp_path, plugin=True) == ["wide_a"] * 2 + ["plain_a"] * 8
    assert _collected(tmp_path, plugin=False) == ["plain_a"] * 8 + ["wide_a"] * 2
