#!/usr/bin/env bash
# The installed package, as a user gets it: build the wheel and the sdist from a clean copy of the checkout,
# install each (not editable; extras shims and viz) into its own fresh virtual environment after torch==2.13.0,
# then, from outside the source tree: import every module of torchlens, torchlens_adapters and torchlens_shims
# from that environment's site-packages (scripts/install_check.py), run `torchlens --version` (it must name this
# project and that environment), `torchlens demo` and a smoke subset of the tests. Exits non-zero on any failure.
# Run by scripts/test.sh; needs .venv (pip and build, the test extra) and python3 with venv. Pip's cache is reused.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
builder="$repo/.venv/bin/python"
smoke_tests=(test_cli.py test_capture.py test_shim_nnsight_modeling.py)  # tests/conftest.py comes along
start=$SECONDS
work="$(mktemp -d "${TMPDIR:-/tmp}/torchlens-install-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
pip_quiet=(-q --disable-pip-version-check)
say() { echo "install_check: $*"; }

# A clean copy of the checkout: an in-tree build/ keeps files deleted from the tree and would ship them.
mkdir "$work/src" "$work/dist"
tar -C "$repo" --exclude=./.venv --exclude=./.git --exclude=build --exclude=dist --exclude='*.egg-info' \
  --exclude=__pycache__ --exclude=./site -cf - . | tar -C "$work/src" -xf -
# Both built with .venv's setuptools (no build isolation: quicker); installing the sdist builds its wheel
# in an isolated environment, which checks pyproject.toml's build requirements.
"$builder" -m pip wheel "${pip_quiet[@]}" --no-deps --no-build-isolation -w "$work/dist" "$work/src"
"$builder" -m build --sdist --no-isolation --outdir "$work/dist" "$work/src" >"$work/build-sdist.log" 2>&1 \
  || { cat "$work/build-sdist.log"; exit 1; }
wheel=("$work"/dist/torchlens-*.whl) sdist=("$work"/dist/torchlens-*.tar.gz)
say "built $(basename "${wheel[0]}") and $(basename "${sdist[0]}") in $((SECONDS - start)) s"

unset PYTHONPATH  # from here on, nothing but the environment under test on the path

# The smoke tests run from a directory holding only copies of them: the source tree is not importable there.
mkdir -p "$work/smoke/tests"
for f in conftest.py "${smoke_tests[@]}"; do cp "$repo/tests/$f" "$work/smoke/tests/"; done
cat >"$work/smoke/tests/test_installed.py" <<'PY'
import sysconfig
from pathlib import Path

import torchlens
import torchlens_adapters
import torchlens_shims


def test_the_packages_under_test_are_the_installed_ones():
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for package in (torchlens, torchlens_adapters, torchlens_shims):
        assert site in Path(package.__file__).resolve().parents, package.__file__
PY

check() {  # $1: wheel or sdist, $2: the built file
  local t0=$SECONDS env="$work/venv-$1" smoke="$work/smoke-$1"
  python3 -m venv "$env"
  # --no-compile: no .pyc for all of torch up front (most of the install time); imports compile what they use
  "$env/bin/python" -m pip install "${pip_quiet[@]}" --no-compile "torch==2.13.0"
  "$env/bin/python" -m pip install "${pip_quiet[@]}" --no-compile "torchlens[shims,viz] @ file://$2" pytest
  local t_install=$((SECONDS - t0)) version
  (cd "$work" && "$env/bin/python" -I "$repo/scripts/install_check.py" "$repo")
  version="$(cd "$work" && "$env/bin/torchlens" --version)"
  say "$version"
  case "$version" in
    "torchlens "*"(TorchLens"*"imported from $env/"*) ;;
    *) say "torchlens --version does not name this project installed in $env"; exit 1 ;;
  esac
  [ "$(cd "$work" && "$env/bin/python" -m torchlens --version)" = "$version" ] \
    || { say "python -m torchlens --version differs from torchlens --version"; exit 1; }
  (cd "$work" && "$env/bin/torchlens" demo >"$work/demo-$1.log" 2>&1) || { cat "$work/demo-$1.log"; exit 1; }
  cp -r "$work/smoke" "$smoke"
  (cd "$smoke" && "$env/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$smoke" tests)
  rm -rf "$env"
  say "$1 OK: installed in $t_install s, checked in $((SECONDS - t0 - t_install)) s"
}

# The two environments side by side (two cores; each step is mostly one process), each logging to its file.
check wheel "${wheel[0]}" >"$work/check-wheel.log" 2>&1 &
wheel_pid=$!
check sdist "${sdist[0]}" >"$work/check-sdist.log" 2>&1 &
sdist_pid=$!
failed=()
wait "$wheel_pid" || failed+=(wheel)
wait "$sdist_pid" || failed+=(sdist)
cat "$work/check-wheel.log" "$work/check-sdist.log"
if [ "${#failed[@]}" -gt 0 ]; then
  say "FAILED: ${failed[*]} (after $((SECONDS - start)) s)"
  exit 1
fi
say "all checks passed in $((SECONDS - start)) s"
