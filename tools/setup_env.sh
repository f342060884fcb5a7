#!/usr/bin/env bash
# Creates .venv (Python >= 3.10) and installs rtd_scale with its test extra. Idempotent: a stamp
# holding the hash of pyproject.toml skips the install when nothing changed.
# Usage: source tools/setup_env.sh   (or: bash tools/setup_env.sh)
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_python="${PYTHON:-python3}"
if ! "$_python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
  echo "error: rtd_scale needs Python >= 3.10; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
if [ ! -x "$_root/.venv/bin/python" ]; then
  "$_python" -m venv "$_root/.venv"
fi
# shellcheck disable=SC1091
source "$_root/.venv/bin/activate"
_stamp="$_root/.venv/.rtd_scale_installed"
_want="$(sha256sum "$_root/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$_stamp" 2>/dev/null || true)" != "$_want" ]; then
  echo "rtd_scale: installing into $_root/.venv (torch first, so pip keeps the CPU build) ..."
  # torch before anything that depends on it; 2.13.0's CPU build lies on CI-like machines' disk.
  pip install --quiet --disable-pip-version-check "torch==${RTD_SCALE_TORCH_VERSION:-2.13.0}"
  pip install --quiet --disable-pip-version-check -e "$_root[test]"
  echo "$_want" > "$_stamp"
fi
