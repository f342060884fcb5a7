"""Helpers of the Slurm tests: shellcheck (installed from Debian's packages where it can be) and a
bounded wait on a condition."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest


def shellcheck() -> str:
    found = shutil.which("shellcheck")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "shellcheck"]
        if subprocess.run(cmd, capture_output=True, env=env, timeout=300).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, timeout=300)
            subprocess.run(cmd, capture_output=True, env=env, timeout=300)
        found = shutil.which("shellcheck")
    if found is None:
        pytest.skip("shellcheck is not installed and cannot be installed here (apt-get as root)")
    return found


def wait_for(what: str, predicate, timeout: float, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
