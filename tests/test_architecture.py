"""Architecture rules for ``torchlens`` and ``torchlens_shims``, checked statically on the AST.

Every import counts, lazy (in-function) ones included; relative imports are resolved, and
``from pkg import name`` counts as importing ``pkg.name`` when that is a submodule, else ``pkg``.
Importing a package means importing its ``__init__.py``. Imports under ``if TYPE_CHECKING:``
never run, so they are left out of the cycle check but count for the layering rules.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import deque
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"torchlens": REPO / "torchlens", "torchlens_shims": REPO / "shims" / "torchlens_shims"}
# Files allowed to name the built-in engines: the module defining the engine plugins.
ENGINE_MODULES = ("torchlens/capture/engines.py", "torchlens/capture/_engines.py")
BUILTIN_ENGINES = frozenset({"hooks", "function_mode"})
CORE_MAY_IMPORT = frozenset({"torchlens.errors"})
SHIMS_MAY_IMPORT = frozenset({"torchlens", "torchlens.errors", "torchlens.capture.hooks", "torchlens.core.names"})
LAZY_REASON = re.compile(r"cycle|optional|heavy|lazy", re.IGNORECASE)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


class Import(NamedTuple):
    module: str  # the module whose code the statement runs
    lineno: int
    in_function: bool
    name: str  # the fully qualified name imported, e.g. ``torchlens.core.records.Op``
    type_only: bool  # under ``if TYPE_CHECKING:``
    end_lineno: int


def module_files(root: Path, package: str) -> dict[str, Path]:
    """``{module name: file}`` for every ``.py`` file under ``root`` (``pkg/__init__.py`` is ``pkg``)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join([package, *parts])] = path
    return files


MODULES = {pkg: module_files(root, pkg) for pkg, root in ROOTS.items()}
FILES = {name: path for files in MODULES.values() for name, path in files.items()}


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.Module):
    """Yield ``(Import/ImportFrom node, in_function, type_only)`` anywhere in ``tree``."""
    stack = [(tree, False, False)]
    while stack:
        node, in_function, type_only = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, in_function, type_only
        guarded = isinstance(node, ast.If) and _is_type_checking(node.test)
        inner = in_function or isinstance(node, FUNCTIONS)
        for child in ast.iter_child_nodes(node):
            stack.append((child, inner, type_only or (guarded and child in node.body)))


def import_graph(root: Path, package: str, known=frozenset(FILES)) -> dict[str, list[Import]]:
    """``{module: [Import(imported_module, lineno, in_function, ...)]}`` for the package under ``root``."""
    graph = {}
    for module, path in module_files(root, package).items():
        here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        imports = []
        for node, in_fn, typ in _import_nodes(ast.parse(path.read_text(), str(path))):
            pos = (node.lineno, in_fn)
            if isinstance(node, ast.Import):
                imports += [Import(a.name, *pos, a.name, typ, node.end_lineno) for a in node.names]
                continue
            base = here[: len(here) - node.level + 1] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                imports.append(Import(full if full in known else base, *pos, full, typ, node.end_lineno))
        graph[module] = sorted(imports, key=lambda i: i.lineno)
    return graph


GRAPH = {name: imps for pkg, root in ROOTS.items() for name, imps in import_graph(root, pkg).items()}


def strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def shortest_cycle(edges: dict[str, set[str]], component: set[str]) -> list[str]:
    """``[a, b, ..., a]``: breadth-first from the component's first module back to itself."""
    start = min(component)
    parent: dict[str, str] = {}
    queue = deque([start])
    while start not in parent:
        v = queue.popleft()
        for w in sorted(edges[v] & component):
            if w not in parent:
                parent[w] = v
                queue.append(w)
    path = [start]
    while len(path) == 1 or path[-1] != start:
        path.append(parent[path[-1]])
    return path[::-1]


def _where(imp: Import, module: str) -> str:
    return f"{FILES[module].relative_to(REPO)}:{imp.lineno}"


@pytest.mark.parametrize("package", ROOTS)
def test_no_import_cycle(package):
    """No import cycle among the package's modules, counting lazy imports and ``__init__`` re-exports."""
    graph = {m: imps for m, imps in GRAPH.items() if _in_package(m, package)}
    edges = {m: {i.module for i in imps if i.module in graph and i.module != m and not i.type_only}
             for m, imps in graph.items()}
    lines = []
    for component in strongly_connected(edges):
        cycle, hops = shortest_cycle(edges, component), []
        for a, b in zip(cycle, cycle[1:]):
            imp = next(i for i in graph[a] if i.module == b and not i.type_only)
            hops.append(f"{a} ({_where(imp, a)}{' lazy' if imp.in_function else ''})")
        lines.append(" -> ".join([*hops, cycle[-1]]))
        if len(component) > len(hops):
            lines.append(f"  (same cycle group: {', '.join(sorted(component - set(cycle)))})")
    assert not lines, "import cycles (one per strongly connected group):\n  " + "\n  ".join(lines)


def test_core_imports_nothing_above_core():
    """``torchlens.core`` imports no ``torchlens`` module outside ``torchlens.core`` but ``torchlens.errors``."""
    bad = [f"{_where(i, m)} imports {i.module}" for m, imps in GRAPH.items() if _in_package(m, "torchlens.core")
           for i in imps if _in_package(i.module, "torchlens") and not _in_package(i.module, "torchlens.core")
           and i.module not in CORE_MAY_IMPORT]
    assert not bad, "core imports from above core:\n  " + "\n  ".join(bad)


def _names_engine(node: ast.AST) -> bool:
    def is_engine(value: ast.AST | None) -> bool:
        if isinstance(value, ast.Tuple | ast.List | ast.Set):
            return any(is_engine(e) for e in value.elts)
        return isinstance(value, ast.Constant) and value.value in BUILTIN_ENGINES

    def about_engine(name: str) -> bool:
        return "engine" in name.lower() or "backend" in name.lower()

    def target_name(target: ast.expr) -> str:
        return target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")

    if isinstance(node, ast.Compare):
        return any(is_engine(v) for v in [node.left, *node.comparators])
    if isinstance(node, ast.Assign | ast.AnnAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return is_engine(node.value) and any(about_engine(target_name(t)) for t in targets)
    if isinstance(node, ast.keyword):
        return is_engine(node.value) and about_engine(node.arg or "")
    if isinstance(node, ast.arguments):
        pos = [*node.posonlyargs, *node.args]
        pairs = [*zip(pos[len(pos) - len(node.defaults):], node.defaults), *zip(node.kwonlyargs, node.kw_defaults)]
        return any(is_engine(d) and about_engine(a.arg) for a, d in pairs)
    return False


def test_generic_code_names_no_builtin_engine():
    """Only the engine-plugin module names "hooks"/"function_mode" in comparisons, engine/backend assignments,
    defaults or keyword arguments; everything else must treat engines generically."""
    bad = []
    for path in MODULES["torchlens"].values():
        if path.relative_to(REPO).as_posix() in ENGINE_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _names_engine(node):
                line = getattr(node, "lineno", None) or [*node.posonlyargs, *node.args, *node.kwonlyargs][0].lineno
                bad.append(f"{path.relative_to(REPO)}:{line}: {ast.unparse(node)[:80]}")
    assert not bad, "generic code names a built-in engine:\n  " + "\n  ".join(sorted(bad))


@pytest.mark.parametrize("package", ROOTS)
def test_every_module_declares_all(package):
    """Every module, ``__init__.py`` and ``__main__.py`` included, assigns ``__all__`` at module level."""
    def declares(tree: ast.Module) -> bool:
        targets = [t for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
        targets += [n.target for n in tree.body if isinstance(n, ast.AnnAssign)]
        return any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)

    bad = [str(p.relative_to(REPO)) for p in MODULES[package].values() if not declares(ast.parse(p.read_text()))]
    assert not bad, "modules without __all__:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("package", ROOTS)
def test_in_function_imports_say_why(package):
    """An in-function import has a comment on its line(s) or the line above naming its reason:
    "cycle", "optional", "heavy" or "lazy"."""
    bad = []
    for module, path in MODULES[package].items():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        comments = {t.start[0]: t.string for t in tokens if t.type == tokenize.COMMENT}
        for imp in GRAPH[module]:
            lines = range(imp.lineno - 1, imp.end_lineno + 1)
            if imp.in_function and not any(LAZY_REASON.search(comments.get(n, "")) for n in lines):
                bad.append(f"{_where(imp, module)} imports {imp.name}")
    assert not bad, "in-function imports without a reason comment:\n  " + "\n  ".join(sorted(set(bad)))


@pytest.mark.parametrize("package", ROOTS)
def test_no_reimport_inside_functions(package):
    """A function does not import a name its file already imports at module level."""
    bad = []
    for module in MODULES[package]:
        top = {i.name for i in GRAPH[module] if not i.in_function and not i.type_only}
        bad += [f"{_where(i, module)} re-imports {i.name}" for i in GRAPH[module] if i.in_function and i.name in top]
    assert not bad, "in-function re-imports of module-level imports:\n  " + "\n  ".join(bad)


def test_shims_import_only_public_torchlens():
    """Shim modules import only ``torchlens``, ``torchlens.errors``, ``torchlens.capture.hooks`` and
    ``torchlens.core.names`` from torchlens."""
    bad = [f"{_where(i, m)} imports {i.module}" for m in MODULES["torchlens_shims"] for i in GRAPH[m]
           if _in_package(i.module, "torchlens") and i.module not in SHIMS_MAY_IMPORT]
    assert not bad, "shims import non-public torchlens modules:\n  " + "\n  ".join(bad)


BROAD = frozenset({"Exception", "BaseException"})


def _broad(handler: ast.ExceptHandler) -> bool:
    """Whether ``handler`` catches every exception (bare, ``Exception``, ``BaseException``, or a tuple holding one)."""
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(k is None or isinstance(k, ast.Name) and k.id in BROAD for k in kinds)


# A call handing a caught exception back as a fork's error: the engine's ``fail(run, exc)``.
HAND_BACK = frozenset({"fail"})


def _hands_on(handler: ast.ExceptHandler) -> bool:
    """Whether ``handler`` lets the error go on, and does nothing else with it: it re-raises (a bare
    ``raise``), raises a new error ``from`` it (the cause kept), returns it, or hands it to ``fail``
    (a fork's error, handed back as data to the caller). Logging it, storing it somewhere, turning it
    into a value or raising another error without its cause is a fallback: refused."""
    name = handler.name
    nodes = [n for stmt in handler.body for n in ast.walk(stmt)]
    for n in nodes:
        if isinstance(n, ast.Raise):
            if n.exc is None or name is not None and isinstance(n.cause, ast.Name) and n.cause.id == name:
                continue
            return False  # a new error that drops the one caught
    raises = any(isinstance(n, ast.Raise) for n in nodes)
    if name is None:
        return raises
    uses = [n for n in nodes if isinstance(n, ast.Name) and n.id == name]
    handed = set()
    for n in nodes:
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Name) and n.value.id == name:
            handed.add(id(n.value))
        if isinstance(n, ast.Raise) and isinstance(n.cause, ast.Name) and n.cause.id == name:
            handed.add(id(n.cause))
        if isinstance(n, ast.Call) and _called(n) in HAND_BACK:
            handed.update(id(a) for a in n.args if isinstance(a, ast.Name) and a.id == name)
    # every use of the exception hands it on (a message built from it for a raise ``from`` it is fine)
    return (raises or bool(handed)) and all(id(u) in handed or raises for u in uses)


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def test_edit_has_no_broad_except_fallback():
    """In ``torchlens/edit/`` no handler catches every exception to take a fallback: a strategy that
    cannot do something declares it before it runs (``edit/_engine``: its reason in the fork's
    replay record), so an error it does not expect propagates. A broad handler may only re-raise
    (after restoring state), wrap the error with its cause, or hand it back as some fork's error
    (``return exc`` or ``fail(run, exc)``)."""
    bad = []
    for module, path in MODULES["torchlens"].items():
        if not _in_package(module, "torchlens.edit"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ExceptHandler) and _broad(node) and not _hands_on(node):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not bad, "broad except fallbacks in edit/ (declare the fallback instead):\n  " + "\n  ".join(bad)


def _handler(body: str, caught: str = "Exception as exc") -> ast.ExceptHandler:
    return ast.parse(f"try:\n    f()\nexcept {caught}:\n    {body}\n").body[0].handlers[0]


@pytest.mark.parametrize(("caught", "body", "handed_on"), [
    ("Exception", "return_value = None", False),  # swallowed
    ("(ValueError, BaseException) as exc", "pass", False),
    ("Exception as exc", "log.append(str(exc))", False),  # kept as a message: a fallback that hides it
    ("Exception as exc", "errors[i] = exc", False),  # stored where no caller is told
    ("Exception as exc", "raise ValueError('other')", False),  # the caught error's cause dropped
    ("Exception as exc", "self.fail(run, exc)", True),  # a fork's error, handed back
    ("Exception as exc", "return exc", True),
    ("Exception as exc", "raise ReplayError(f'op failed: {exc}') from exc", True),  # wrapped, cause kept
    ("BaseException", "restore()\n    raise", True),  # cleaned up, re-raised
])
def test_the_broad_except_rule_sees_a_handler_that_does_not_hand_the_error_on(caught, body, handed_on):
    handler = _handler(body, caught)
    assert _broad(handler) and _hands_on(handler) == handed_on
    assert not _broad(_handler("pass", "ValueError"))
