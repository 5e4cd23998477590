#!/usr/bin/env bash
# Create .venv (if missing) and install TorchLens with the given extras.
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[$extras]"
else
  .venv/bin/python -m pip install -q --disable-pip-version-check -e .
fi
