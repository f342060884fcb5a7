#!/usr/bin/env bash
# README command 2: set-up, then the whole test suite (unit, multi-process, end-to-end).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC1091
source tools/setup_env.sh
python -m pytest -q --durations=30 tests "$@"
