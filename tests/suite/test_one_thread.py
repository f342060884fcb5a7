"""Every process of the suite runs one intra-op thread unless the caller set OMP_NUM_THREADS
(tests/conftest.py): two pytest-xdist workers share the cores, and a thread per core in each
process makes their OpenMP threads spin against each other."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from tests.helpers.env import REPO

# loads tests/conftest.py as pytest does, before torch (whose OpenMP runtime reads the variable
# when it loads), then reports what torch and a child process see
PROBE = ("import os, subprocess, sys, runpy; runpy.run_path('tests/conftest.py'); import torch; "
         "child = subprocess.run([sys.executable, '-c', 'import torch; "
         "print(torch.get_num_threads())'], capture_output=True, text=True, check=True); "
         "print(os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), child.stdout.strip())")


def _probe(omp: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.split()


def test_this_worker_runs_the_threads_its_environment_names():
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_unset_it_is_one_thread_in_the_process_and_its_children():
    assert _probe(None) == ["1", "1", "1"]


def test_an_empty_value_counts_as_unset():
    assert _probe("") == ["1", "1", "1"]


def test_a_value_the_caller_set_is_kept():
    assert _probe("2") == ["2", "2", "2"]
