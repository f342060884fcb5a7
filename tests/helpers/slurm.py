"""Helpers of the Slurm and script tests: programs installed from Debian's packages where they
can be (shellcheck, chromium), Slurm's client commands and a bounded wait on a condition."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
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


@dataclass
class SlurmClient:
    """Slurm's client commands (sbatch, srun, squeue, scontrol, scancel) for one cluster, run with
    ``env`` (which names the cluster's SLURM_CONF) behind ``prefix`` (e.g. the two-node cluster's
    ``in-ns <controller>``, which enters the controller's network namespace)."""

    env: dict[str, str]
    prefix: tuple[str, ...] = ()

    def run(self, *cmd: str, cwd=None, timeout: int = 60, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``cmd`` behind the prefix, with ``env`` (default the client's); ``check``: a non-zero
        status fails the test."""
        r = subprocess.run([*self.prefix, *cmd], cwd=cwd, env=env or self.env,
                           capture_output=True, text=True, timeout=timeout)
        if check:
            assert r.returncode == 0, f"{cmd}: {r.stdout[-3000:]}{r.stderr[-3000:]}"
        return r

    def sbatch(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit ``sbatch args`` from ``cwd``; the job inherits ``env`` (default the client's).
        Returns the job id."""
        out = self.run("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout.strip()
        assert re.fullmatch(r"\d+(;\S+)?", out), f"sbatch --parsable printed {out!r}"
        return int(out.split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (finished jobs stay visible for MinJobAge = 600 s)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in text.split() if "=" in kv)

    def queued(self, job_id: int) -> str:
        """'STATE REASON' while the job is pending or running, '' once it has left the queue.
        (`sbatch --wait` polls at 2, 8, then every 32 s: too slow for a test.)"""
        return self.run("squeue", "-h", "-j", str(job_id), "-o", "%T %r").stdout.strip()


def wait_for(what: str, predicate, timeout: float, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
