"""Paths and process environment the tests share."""
from __future__ import annotations

import os
from pathlib import Path

# the tests' launches pick their port the way rtd_scale's own single-process fallback does
from rtd_scale.launch_env import free_port  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
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
