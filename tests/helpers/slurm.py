"""Helpers of the Slurm and script tests: programs installed from Debian's packages where they
can be (shellcheck, chromium) and a bounded wait on a condition."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest


def debian_program(names: tuple[str, ...], package: str) -> str:
    """The path of the first of ``names`` on PATH, installing Debian's ``package`` first where it
    is missing and this process may (root, apt-get): the suite's Slurm, shellcheck and browser
    tests run wherever the README's test command runs as root (CI), and skip elsewhere."""
    def found():
        return next((p for p in map(shutil.which, names) if p), None)

    if found() is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package]
        if subprocess.run(cmd, capture_output=True, env=env, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=300)
            subprocess.run(cmd, capture_output=True, env=env, timeout=600)
    if found() is None:
        pytest.skip(f"{names[0]} is not installed and cannot be installed here "
                    f"(apt-get install {package} as root)")
    return found()


def shellcheck() -> str:
    return debian_program(("shellcheck",), "shellcheck")


def wait_for(what: str, predicate, timeout: float, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
