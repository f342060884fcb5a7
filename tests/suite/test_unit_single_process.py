"""The guard that keeps tests/unit/ single-process (tests/helpers/no_processes.py, wired in by
tests/unit/conftest.py): every way of starting a process fails with the rule's message, torch
inductor's own compiler runs pass, the patches are undone, and a tests/unit/ conftest makes a test
(or a session fixture) that starts a process fail."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.env import REPO
from tests.helpers.no_processes import RULE, ProcessStartError, guarded

PY = [sys.executable, "-c", "pass"]


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(PY),
    lambda: subprocess.check_output(PY),
    lambda: subprocess.Popen(PY),
    lambda: subprocess.run("true", shell=True),
    lambda: os.system("true"),
    lambda: os.fork(),
    lambda: os.posix_spawn(shutil.which("true"), ["true"], dict(os.environ)),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: multiprocessing.get_context("fork").Pool(1),
], ids=["run", "check_output", "Popen", "shell", "os.system", "os.fork", "posix_spawn",
        "mp-fork", "mp-spawn", "mp-pool"])
def test_every_process_start_fails_naming_the_rule(start):
    with pytest.raises(ProcessStartError) as e:
        with guarded():
            start()
    assert str(e.value).startswith(RULE + " (it ") or str(e.value).startswith(RULE + "; ")
    assert RULE == "tests/unit/ is single-process: move this test to tests/tools/ or tests/e2e/"
    # undone on the way out: the same start works again
    assert subprocess.run(PY).returncode == 0 and os.system("true") == 0


def test_a_swallowed_refusal_still_fails():
    with pytest.raises(ProcessStartError, match="its error was caught inside the test"):
        with guarded():
            try:
                subprocess.run(PY)
            except Exception:
                pass
    with pytest.raises(ProcessStartError, match=r"\(then: RuntimeError: no compiler\)"):
        with guarded():
            try:
                subprocess.run(PY)
            except Exception:
                raise RuntimeError("no compiler")


def _started_from(path: str) -> int:
    """subprocess.run(PY) called from code whose file is ``path`` (as a frame of that library)."""
    scope: dict = {"subprocess": subprocess, "PY": PY}
    exec(compile("rc = subprocess.run(PY).returncode", path, "exec"), scope)
    return scope["rc"]


def test_inductors_own_children_pass_but_not_its_worker_pool():
    import torch

    inductor = os.path.join(os.path.dirname(torch.__file__), "_inductor")
    from torch._inductor import config

    before = config.compile_threads
    with guarded():
        assert config.compile_threads == 1  # inductor compiles in this process
        assert _started_from(os.path.join(inductor, "cpp_builder.py")) == 0
    assert config.compile_threads == before
    for path in (os.path.join(inductor, "compile_worker", "subproc_pool.py"),
                 str(REPO / "rtd_scale" / "x.py")):  # our own code is no exception
        with pytest.raises(ProcessStartError, match="tests/unit/ is single-process"):
            with guarded():
                _started_from(path)


def test_the_unit_conftest_fails_a_test_or_fixture_that_starts_a_process(tmp_path):
    unit = tmp_path / "unit"
    unit.mkdir()
    shutil.copy(REPO / "tests" / "unit" / "conftest.py", unit / "conftest.py")
    (unit / "test_x.py").write_text(
        "import subprocess, sys\n"
        "import pytest\n\n"
        "@pytest.fixture(scope='session')\n"
        "def made_by_a_process():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n\n"
        "def test_in_process():\n"
        "    assert sum(range(4)) == 6\n\n"
        "def test_starts_a_process():\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n\n"
        "def test_uses_a_fixture_that_starts_one(made_by_a_process):\n"
        "    pass\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                        str(unit)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="1000"))
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 failed, 1 passed, 1 error" in r.stdout, r.stdout[-3000:]
    assert f"FAILED unit/test_x.py::test_starts_a_process - tests.helpers.no_processes.ProcessStartError: {RULE}" in r.stdout
    assert f"ERROR unit/test_x.py::test_uses_a_fixture_that_starts_one - tests.helpers.no_processes.ProcessStartError: {RULE}" in r.stdout
