#!/usr/bin/env bash
# The main job: set up, then trace a small built-in model, print a block's ops, edit, validate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh viz  # viz: pictures (graphviz, plus the dot program), plots, progress bars
.venv/bin/torchlens demo
