"""Import every module of an installed TorchLens from its environment's site-packages (scripts/install_check.sh).

Run it with the environment's interpreter in isolated mode (``python -I``: no script directory, working
directory or PYTHONPATH on the path) and the repository as the argument: the source tree names the modules
the installation must hold, and the installation must hold no module the source tree lacks. Exit code 1,
with each problem listed, when a module is missing, extra, fails to import or imports from elsewhere.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
import traceback
from pathlib import Path

__all__ = ["main"]

# import name -> its directory in the repository
LAYOUT = {"torchlens": "torchlens", "torchlens_adapters": "adapters", "torchlens_shims": "shims/torchlens_shims"}
# modules not imported, with the reason
NOT_IMPORTED = {"torchlens.__main__": "runs the command line when imported; install_check.sh runs python -m torchlens"}


def modules_under(where: Path, name: str) -> set[str]:
    """Every module and package in the directory ``where`` of package ``name``, by import name."""
    names = set()
    for path in where.rglob("*.py"):
        parts = path.relative_to(where).with_suffix("").parts
        if "__pycache__" not in parts:
            names.add(".".join((name, *parts[:-1]) if parts[-1] == "__init__" else (name, *parts)))
    return names


def main(argv: list[str]) -> int:
    repo = Path(argv[1]).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    expected = set().union(*(modules_under(repo / where, name) for name, where in LAYOUT.items()))
    installed = set().union(*(modules_under(site / name, name) for name in LAYOUT))
    problems = [f"missing from the installation: {name}" for name in sorted(expected - installed)]
    problems += [f"installed but not in the source tree: {name}" for name in sorted(installed - expected)]
    failed: set[str] = set()
    imported = 0
    for name in sorted(expected & installed):  # parents before their modules
        if name in NOT_IMPORTED:
            print(f"install_check: not imported: {name} ({NOT_IMPORTED[name]})")
            continue
        broken_parent = next((p for p in failed if name.startswith(p + ".")), None)
        if broken_parent is not None:
            problems.append(f"{name} not imported: its package {broken_parent} does not import")
            continue
        try:
            module = importlib.import_module(name)
        except Exception:  # any import failure is a finding, reported with its traceback
            failed.add(name)
            problems.append(f"{name} does not import:\n{traceback.format_exc()}")
            continue
        where = Path(module.__file__).resolve()
        if site not in where.parents:
            problems.append(f"{name} imports from {where}, not from {site}")
        imported += 1
    for problem in problems:
        print(f"install_check: {problem}", file=sys.stderr)
    print(f"install_check: {imported} modules imported from {site}"
          + (f"; {len(problems)} problem(s)" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
