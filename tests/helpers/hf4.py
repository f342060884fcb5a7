"""A transformers 4.x environment beside the project's (transformers 5.x), for tests that load an
export under both majors (``pyproject.toml`` declares ``transformers>=4.46,<6``).

:func:`hf4_python` builds, once, a plain virtual environment under
``~/.cache/rtd_scale/hf4-venv-<version>-<key>`` (``RTD_SCALE_HF4_VENV`` overrides the place)
with ``transformers==HF4_VERSION``, borrowing the project's own torch installation (the key names
it), and returns its interpreter. It is built in a temporary sibling directory and renamed into
place when complete, under a file lock, so an interrupted build is never taken for a finished one
and concurrent test runs build once.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HF4_VERSION = "4.57.3"  # the last 4.x release
PACKAGES = (f"transformers=={HF4_VERSION}", "safetensors", "tokenizers", "sentencepiece", "numpy")


class Unreachable(Exception):
    """The package index cannot be reached: the environment cannot be built here."""


def _torch_home() -> Path:
    """The directory holding the project's torch package (its site-packages)."""
    import torch

    return Path(torch.__file__).resolve().parent.parent


def venv_dir() -> Path:
    """One environment per project torch installation it borrows (a hash of its directory)."""
    key = hashlib.sha256(str(_torch_home()).encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "rtd_scale" / f"hf4-venv-{HF4_VERSION}-{key}"
    return Path(os.environ.get("RTD_SCALE_HF4_VENV", default))


def _pip(python: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "pip", "install", "--no-input", *args],
                          capture_output=True, text=True, timeout=timeout)


def hf4_python(timeout_s: float = 1800.0) -> tuple[Path, float]:
    """(the 4.x environment's python, seconds spent building it now: 0.0 when cached).

    Raises:
        Unreachable: pip cannot reach the index for transformers (the first download).
        RuntimeError: any other build failure, with pip's output.
    """
    import torch

    target = venv_dir()
    python = target / "bin" / "python"
    done = target / "BUILT"
    if done.is_file():
        return python, 0.0
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.is_file():  # another run built it while this one waited
            return python, 0.0
        start = time.monotonic()
        tmp = Path(f"{target}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True,
                           capture_output=True, timeout=300)
            tmp_python = tmp / "bin" / "python"
            r = _pip(tmp_python, *PACKAGES, timeout=timeout_s)
            if r.returncode != 0:
                out = (r.stdout + r.stderr).strip()
                unreachable = ("NewConnectionError", "Network is unreachable",
                               "Temporary failure in name resolution", "Max retries exceeded",
                               "ConnectTimeout", "Name or service not known")
                if any(s in out for s in unreachable):
                    raise Unreachable(out.splitlines()[-1])
                raise RuntimeError(f"building the transformers {HF4_VERSION} environment "
                                   f"failed:\n{out[-4000:]}")
            # torch: the project's own installation, not a second copy of it (transformers does
            # not require torch, so pip installed none; unpacking its wheel was most of the
            # build's minute). A .pth line appends the directory holding it to the environment's
            # path, after the environment's own packages, so that transformers 4.x and its
            # dependencies shadow the project's 5.x. pip ran before the line exists: it never
            # saw the project's packages.
            site = subprocess.run([str(tmp_python), "-c", "import sysconfig; "
                                   "print(sysconfig.get_paths()['purelib'])"], check=True,
                                  capture_output=True, text=True, timeout=60).stdout.strip()
            torch_home = _torch_home()
            (Path(site) / "rtd_scale_project_torch.pth").write_text(f"{torch_home}\n")
            (tmp / "BUILT").write_text(f"{' '.join(PACKAGES)}; torch {torch.__version__} from "
                                       f"{torch_home}\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return python, time.monotonic() - start
