#!/usr/bin/env bash
# README command 2: set-up, then the whole test suite (unit, multi-process, end-to-end).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
source tools/setup_env.sh
# every launch's ranks and tools import the package: compile it once (``__pycache__``, ignored by
# git) rather than in every process, where the environment says not to write bytecode
unset PYTHONDONTWRITEBYTECODE
# three workers (pytest-xdist) on CI's two cores: with two, a quarter of the cores sat idle while
# tests waited on daemons, signals and timeouts (user + system time 2,560 s of 2 × 1,748 s; with
# three, 1,600 s); a module's tests stay on one worker with its shared runs, and the
# modules that take machine-wide resources (apt, Slurm daemons, port 29500) share one worker
# (their xdist_group "machine-wide"; tests/conftest.py), handed out longest first in the order
# tests/conftest.py gives (--no-loadscope-reorder: not xdist's most-tests-first)
python -m pytest -q --durations=30 -n 3 --dist loadgroup --no-loadscope-reorder tests "$@"
