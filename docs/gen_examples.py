"""mkdocs hook: the tested examples as a reader sees them, with the output they print.

Every ```python fence whose first line is ``# migration-test: tool=NAME expected=LITERAL`` is
run by ``tests/test_docs.py``, which compares the example's closing ``RESULT`` with the literal.
That scaffolding is for the test suite, not the reader; at build time this hook

- drops the ``# migration-test:`` line;
- drops everything from a line ``# checks`` on (an example may end with reference computations
  that only the test needs), else the ``RESULT = ...`` statement (and a ``with`` / ``if`` block
  that held nothing else);
- runs each example whose shown code prints (``print(``), in its own interpreter as the test
  suite does, and puts what it printed below it in an "Output" block, so the output on the page
  is the output of the current code. An example that fails to run stops a ``--strict`` build.

The page source keeps the full, tested fence. ``tests/test_docs.py`` checks that every shown
example parses and holds no scaffolding; ``tests/test_docs_browser.py`` that no page shows it.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import logging
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

__all__ = ["CHECKS", "FENCE", "HEADER", "example_env", "fences", "run_example", "shown_code", "tool_available"]

HEADER = re.compile(r"^#\s*migration-test:\s*tool=(\S+)\s+expected=(.+)$")
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```[ \t]*\n?", re.S | re.M)
CHECKS = re.compile(r"^# checks\b.*$", re.M)  # this line and the rest of the example: for the tests only
TIMEOUT = 300
ROOT = pathlib.Path(__file__).resolve().parents[1]
ORACLES = ROOT / "tests" / "fixtures" / "oracles"  # stand-ins for tools that only load through one (baukit)

log = logging.getLogger("mkdocs.hooks.gen_examples")


def fences(markdown: str) -> list[tuple[re.Match[str], str, str]]:
    """Each tested fence of a page: ``(match, tool, code)`` (the code with its header line)."""
    found = []
    for match in FENCE.finditer(markdown):
        code = match.group(1)
        head = HEADER.match(code.split("\n", 1)[0])
        if head is not None:
            found.append((match, head.group(1), code))
    return found


def shown_code(code: str) -> str:
    """The example as the site shows it: no header, no ``# checks`` tail, no ``RESULT`` statement.

    Raises:
        ValueError: the example does not parse, or would not parse once stripped.
    """
    body = code.split("\n", 1)[1] if HEADER.match(code.split("\n", 1)[0]) else code
    checks = CHECKS.search(body)
    if checks is not None:
        body = body[:checks.start()]
    else:
        lines = body.split("\n")
        for first, last in sorted(_result_spans(ast.parse(body)), reverse=True):
            del lines[first - 1:last]
        body = "\n".join(lines)
    body = body.rstrip() + "\n"
    ast.parse(body)  # what the reader copies is Python
    return body


def _result_spans(tree: ast.Module) -> list[tuple[int, int]]:
    """Line spans (1-based, inclusive) to drop: each ``RESULT = ...``, and a block it leaves empty."""
    spans = []

    def visit(stmts: list[ast.stmt]) -> bool:
        """Collect the spans in ``stmts``; True when every statement of it is dropped."""
        dropped = 0
        for stmt in stmts:
            if _is_result(stmt) or _empty_block(stmt, visit):
                spans.append((stmt.lineno, stmt.end_lineno))
                dropped += 1
        return dropped == len(stmts)

    visit(tree.body)
    # a block dropped whole also holds the spans of its children: keep the outermost only
    return [s for s in spans if not any(o != s and o[0] <= s[0] and s[1] <= o[1] for o in spans)]


def _is_result(stmt: ast.stmt) -> bool:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] \
        if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else []
    return any(isinstance(t, ast.Name) and t.id == "RESULT" for t in targets)


def _empty_block(stmt: ast.stmt, visit: Any) -> bool:
    """A ``with`` / ``if`` / ``for`` / ``try`` whose every statement is dropped (it only set RESULT)."""
    if not isinstance(stmt, (ast.With, ast.If, ast.For, ast.While, ast.Try)):
        return False
    bodies = [stmt.body] + [b for b in (getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])) if b]
    return all([visit(b) for b in bodies])  # visit every body (a list, not a short-circuit)


def tool_available(tool: str) -> bool:
    """Whether an example's tool can be imported: installed, or (baukit) loadable through its stand-in."""
    stand_in = ORACLES / tool / "__init__.py"
    if stand_in.is_file():
        spec = importlib.util.spec_from_file_location(f"_probe_{tool}", stand_in)
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return True
        except ImportError:  # the oracle is not unpacked (PackageNotFoundError is a ModuleNotFoundError)
            return False
    try:
        return importlib.util.find_spec(tool) is not None
    except (ImportError, ValueError):
        return False


def example_env(tool: str) -> dict[str, str]:
    """The environment an example runs in: offline, one thread, the tool's stand-in on the path."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONHASHSEED="0")
    if (ORACLES / tool).is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ORACLES), env.get("PYTHONPATH")]))
    return env


def run_example(code: str, tool: str) -> subprocess.CompletedProcess[str]:
    """Run an example (the full tested code) in a fresh interpreter, in a temporary directory."""
    with tempfile.TemporaryDirectory() as workdir:
        script = pathlib.Path(workdir) / "example.py"
        script.write_text(code, encoding="utf-8")
        return subprocess.run([sys.executable, str(script)], cwd=workdir, env=example_env(tool),
                              capture_output=True, text=True, timeout=TIMEOUT)


# -- the hook ------------------------------------------------------------------------------------

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_runs: dict[str, concurrent.futures.Future] = {}


def on_pre_build(config: Any, **kwargs: Any) -> None:
    """Start every printing example of every page at once (two at a time); pages wait for theirs."""
    global _pool
    _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1)))
    _runs.clear()
    for path in sorted(pathlib.Path(config["docs_dir"]).rglob("*.md")):
        for _, tool, code in fences(path.read_text(encoding="utf-8")):
            if code not in _runs and "print(" in shown_code(code) and tool_available(tool):
                _runs[code] = _pool.submit(run_example, code, tool)


def on_post_build(config: Any, **kwargs: Any) -> None:
    if _pool is not None:
        _pool.shutdown(wait=True, cancel_futures=True)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any, **kwargs: Any) -> str:
    out, end = [], 0
    for match, tool, code in fences(markdown):
        out.append(markdown[end:match.start()])
        end = match.end()
        opening = match.group(0).split("\n", 1)[0]
        out.append(f"{opening}\n{shown_code(code)}```\n")
        printed = _printed(code, tool, page.file.src_uri)
        if printed:
            out.append(f'\n```text title="Output"\n{printed.rstrip()}\n```\n')
    out.append(markdown[end:])
    return "".join(out)


def _printed(code: str, tool: str, where: str) -> str:
    run = _runs.get(code)
    if run is None:
        if "print(" in shown_code(code):
            log.info("%s: %s is not importable here, so an example's output is not shown", where, tool)
        return ""
    try:
        proc = run.result()
    except subprocess.TimeoutExpired:
        log.warning("%s: an example did not finish within %ss, so its output is not shown", where, TIMEOUT)
        return ""
    if proc.returncode != 0:
        log.warning("%s: an example failed while building the page:\n%s", where, proc.stderr[-2000:])
        return ""
    return proc.stdout
