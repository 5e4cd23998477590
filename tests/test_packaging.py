"""The built wheel holds every package and module of the source tree, and nothing else (issue 28).

The wheel is built by pip, as ``pip wheel .`` builds it, from a copy of the checkout (an in-tree
``build/`` keeps files deleted from the tree and would ship them), without build isolation (this
environment's setuptools: no index needed). Its file list is compared with the source tree, whose
layout is spelled out here independently of setup.py. scripts/install_check.sh (run by
scripts/test.sh) installs the wheel and the sdist into fresh environments and imports every module.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> its directory in the repository
LAYOUT = {"torchlens": ROOT / "torchlens", "torchlens_adapters": ROOT / "adapters",
          "torchlens_shims": ROOT / "shims" / "torchlens_shims"}
NOT_COPIED = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", "site", ".*_cache", ".hypothesis")


def source_files() -> set[str]:
    """Every .py file under the import roots, as the path it has inside a wheel."""
    return {str(PurePosixPath(name, *path.relative_to(where).parts))
            for name, where in LAYOUT.items() for path in where.rglob("*.py") if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Iterator[zipfile.ZipFile]:
    src, out = tmp_path_factory.mktemp("checkout"), tmp_path_factory.mktemp("wheelhouse")
    shutil.copytree(ROOT, src, dirs_exist_ok=True, symlinks=True, ignore=shutil.ignore_patterns(*NOT_COPIED))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                           "--no-build-isolation", "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("torchlens-*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def test_the_wheel_holds_every_package_on_disk(wheel):
    on_disk = {PurePosixPath(name, *init.parent.relative_to(where).parts).as_posix()
               for name, where in LAYOUT.items() for init in where.rglob("__init__.py")}
    in_wheel = {str(PurePosixPath(f).parent) for f in wheel.namelist() if f.endswith("/__init__.py")}
    assert "torchlens_shims/nnsight/modeling/mixins" in on_disk  # the package the hand-written list missed
    assert sorted(on_disk - in_wheel) == []
    assert sorted(source_files() - set(wheel.namelist())) == []


def test_the_wheel_holds_nothing_else(wheel):
    shipped = {f for f in wheel.namelist() if ".dist-info/" not in f}
    assert sorted(shipped - source_files()) == []  # no test, fixture, bench or stale module
    tops = {f.split("/")[0] for f in wheel.namelist()}
    dist_info = {top for top in tops if top.endswith(".dist-info")}
    assert len(dist_info) == 1 and tops - dist_info == set(LAYOUT)


def test_the_wheel_installs_the_torchlens_command(wheel):
    (entry_points,) = [f for f in wheel.namelist() if f.endswith(".dist-info/entry_points.txt")]
    lines = wheel.read(entry_points).decode().splitlines()
    assert lines[lines.index("[console_scripts]") + 1] == "torchlens = torchlens.cli:main"
