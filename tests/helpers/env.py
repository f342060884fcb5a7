"""Paths and process environment the tests share."""
from __future__ import annotations

import os
import socket
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
