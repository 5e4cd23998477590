#!/usr/bin/env bash
# Create .venv (if missing) and install TorchLens with the given extras.
# torch is installed first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
# Graphviz's dot lays out trace.draw() pictures; it is a system package, installed here when we can.
if ! command -v dot >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz >/dev/null) \
      || echo "setup_env: could not install graphviz; trace.draw() will say how (trace.to_dot() still works)" >&2
  else
    echo "setup_env: Graphviz's dot is missing; install it (apt-get install graphviz / brew install graphviz)" \
      "to draw graphs" >&2
  fi
fi
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
