#!/usr/bin/env bash
# The whole test suite: set up (test + docs extras), lint, then pytest (docs build and fences included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "test,docs"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check torchlens adapters shims tests bench
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
