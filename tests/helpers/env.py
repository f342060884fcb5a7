"""Paths and process environment the tests share."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

# the tests' launches pick their port the way rtd_scale's own single-process fallback does
from rtd_scale.launch_env import free_port  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
# rtd_scale/distributed.py's refusal when rank 0 cannot listen on MASTER_PORT: the launch helpers
# start a run or world again on another port when it says this (tests/helpers/launcher.py, dist.py)
PORT_TAKEN = re.compile(r"MASTER_PORT \d+ is already in use on ")
TEST_DATA = REPO / "tests" / "data"
CASES = TEST_DATA / "cases"  # the bug-report cases the tests replay (kept in the repo)


def case_texts(name: str) -> list[str]:
    """The ``text`` of each line of the case file ``tests/data/cases/<name>`` (jsonl)."""
    import json

    return [json.loads(line)["text"] for line in (CASES / name).read_text(encoding="utf-8").splitlines()]


def standalone_env() -> dict[str, str]:
    """This process's environment without the launcher variables that ``single_process_group``
    sets (its MASTER_PORT is taken by this process): for a child that runs as its own one-process
    job."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in os.environ.items() if k not in launcher}


def readme_test_command() -> list[str]:
    """The pytest arguments of README command 2: README.md names ``tools/run_tests.sh``, whose
    ``python -m pytest …`` line is what a user and CI run."""
    readme = (REPO / "README.md").read_text()
    assert "bash tools/run_tests.sh" in readme.split("\n## ")[0], "README's first screen lost command 2"
    script = (REPO / "tools" / "run_tests.sh").read_text()
    line = next(ln for ln in script.splitlines() if re.match(r"\s*python -m pytest\b", ln))
    return [a for a in shlex.split(line)[3:] if a != '"$@"' and a != "$@"]
