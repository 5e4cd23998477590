"""Which packages the wheel and the sdist hold: every package under each import root, found on disk.

Everything else about the build is declared in pyproject.toml. The roots live here because setuptools'
declarative ``packages.find`` names a package after its directory, and ``torchlens_adapters`` lives in
``adapters/``. tests/test_packaging.py builds the wheel and checks that it holds every package.
"""

from setuptools import find_packages, setup

__all__: list[str] = []

# import name -> its directory in the repository
ROOTS = {"torchlens": "torchlens", "torchlens_adapters": "adapters", "torchlens_shims": "shims/torchlens_shims"}
# never shipped, should one appear under a root
NOT_SHIPPED = ["tests", "tests.*", "*.tests", "*.tests.*", "fixtures", "*.fixtures", "*.fixtures.*", "bench", "bench.*"]

packages = [sub for name, where in ROOTS.items()
            for sub in [name] + [f"{name}.{found}" for found in find_packages(where, exclude=NOT_SHIPPED)]]

setup(package_dir=ROOTS, packages=packages)
