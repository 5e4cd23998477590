#!/usr/bin/env bash
# The whole test suite: set up (test + docs extras), lint, check the installed package, then pytest (docs build
# and fences included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh "test,docs,viz,pandas,ray,datasets"
# The docs browser test opens the built site in headless Chromium (Debian package chromium); it skips
# with the reason when Chromium cannot be installed here.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
    fonts-liberation >/dev/null) || echo "test.sh: could not install chromium; the browser test will skip" >&2
fi
# Test oracle: the real baukit is not on PyPI; its wheel sits in ../shared/oracles beside the repository.
# It is unpacked into .venv/oracles, not site-packages (--no-deps: its metadata asks for torchvision, and
# its package __init__ cannot import without it); tests load its nethook.py from there
# (tests/fixtures/oracles/baukit). Without the wheel the baukit cross-checks skip, saying so.
for wheel in ../shared/oracles/baukit-*.whl; do
  if [ -f "$wheel" ]; then
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --upgrade --target .venv/oracles "$wheel"
  fi
done
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check torchlens adapters shims tests bench scripts setup.py
# The installed package (wheel and sdist, each in a fresh virtual environment, not editable): skipped when
# arguments select tests, as in `bash scripts/test.sh tests/test_cli.py`.
if [ "$#" -eq 0 ]; then
  bash scripts/install_check.sh
fi
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
