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


# -- a Trace that reads ------------------------------------------------------------------------

# What capture engines and the loader call to build a graph, and what replay calls to change a
# fork: none of it is on a Trace (TraceBuilder builds, a fork's ``changes`` takes replay's writes).
GRAPH_BUILDING = ("add_op", "add_call", "add_input", "add_recorded_op", "add_recorded_tensor_ops", "add_transient_op",
                  "relabel", "link_args", "register_tensor", "spill", "keep_value", "store_grad", "live_value",
                  "note_held", "record_data_read", "record_edit", "set_output", "finish", "restore", "take_records",
                  "refs_for_value", "set_tokenizer")
FORK_WRITES = ("set_value", "set_recomputed", "substitute", "set_module_output", "add_step", "drop_last_step",
               "restore_fork")
# 69: 40 methods (reading, selecting, fork/forks/sweep/do, run, validate, save, table/draw/summary),
# 27 properties (the records it reads: ops, calls, output ...) and the two settings name and tokenizer.
# It was 96 (67 methods) while the graph-building mutators and replay's internal helpers lived on it.
TRACE_PUBLIC_MAX = 69


def _tiny_trace():
    import torch

    import torchlens as tl

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2)).eval()
    x = torch.randn(2, 3)
    return model, x, tl.trace(model, x)


def test_trace_public_surface_is_bounded():
    _, _, trace = _tiny_trace()
    public = sorted(name for name in dir(trace) if not name.startswith("_"))
    assert len(public) <= TRACE_PUBLIC_MAX, (
        f"Trace has {len(public)} public names, more than {TRACE_PUBLIC_MAX}: a trace reads; graph building "
        f"belongs on TraceBuilder, a fork's writes on fork.changes. Names: {public}")


def test_trace_exposes_no_graph_building_mutator():
    import torch

    import torchlens as tl

    model, x, trace = _tiny_trace()
    fork = trace.fork()
    for obj in (trace, fork):
        found = [name for name in (*GRAPH_BUILDING, *FORK_WRITES) if hasattr(obj, name)]
        assert not found, f"{type(obj).__name__} exposes writes: {found}"
    build = tl.TraceBuilder(model, (x,), {})
    assert all(callable(getattr(build, name)) for name in GRAPH_BUILDING if name not in
               ("set_output", "take_records", "refs_for_value", "set_tokenizer"))
    assert all(callable(getattr(fork.changes, name)) for name in FORK_WRITES)
    for name in ("ops", "calls", "model", "steps", "output_layers", "data_reads"):  # the records are read-only
        with pytest.raises(AttributeError):
            setattr(trace, name, [])
    assert torch.equal(trace.output, model(x)) and len(trace.ops) == 4  # unchanged by the refused writes


def test_a_fork_holds_its_parents_records_through_one_shared_object():
    import torch

    import torchlens as tl

    model, x, trace = _tiny_trace()
    fork = trace.fork().do("0", tl.zero_ablate())
    grandchild = fork.fork().do("2", tl.scale(2.0))
    assert fork._graph is trace._graph and grandchild._graph is trace._graph  # one Graph, not copies
    # a fork's own attributes: the shared records, its name and tokenizer, its parent, its changes
    assert set(vars(fork)) == set(vars(grandchild)) == {"_graph", "name", "tokenizer", "parent", "_deferred",
                                                        "changes"}
    assert fork.changes is not grandchild.changes and len(grandchild.recipe) == 2 and len(fork.recipe) == 1
    with torch.no_grad():
        want = model[2](torch.relu(torch.zeros(2, 3)))  # module 0 zeroed, then ReLU and module 2 as the model does
    assert torch.allclose(fork.output, want) and torch.allclose(grandchild.output, 2 * want)
    assert torch.equal(trace.output, model(x))  # the parent never changes


def test_trace_fork_makes_the_fork_class_of_core_fork():
    """``trace.fork()`` makes ``core.fork.Fork``, which names itself the branch class
    (``class Fork(Trace, branch=True)``): ``core.trace`` does not import ``core.fork``."""
    from torchlens.core.fork import Fork
    from torchlens.core.trace import Trace

    _, _, trace = _tiny_trace()
    fork = trace.fork()
    assert type(fork) is Fork and type(fork.fork()) is Fork and Trace._branch is Fork
    assert fork.parent is trace and fork.fork().parent is fork
    assert not [i for i in GRAPH["torchlens.core.trace"] if i.module == "torchlens.core.fork" and not i.type_only]


def _dict_copies(tree: ast.AST) -> list[int]:
    """Lines that copy one object's attributes into another wholesale: ``a.__dict__.update(...)``,
    ``vars(a).update(...)``, ``a.__dict__ = ...``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            target = node.func.value
            if (isinstance(target, ast.Attribute) and target.attr == "__dict__") or (
                    isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "vars"):
                found.append(node.lineno)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "__dict__"
                                                  for t in node.targets):
            found.append(node.lineno)
    return found


def test_no_dict_copying():
    """No object of ``torchlens`` takes another's state by copying its ``__dict__``: a fork holds its
    parent's records through one explicit shared object (``Graph``), and anything else names what it
    shares. (The shims mirror nnsight, whose envoys are shallow copies, and copy a function's attributes
    as ``functools.update_wrapper`` does: not checked there.)"""
    bad = [f"{path.relative_to(REPO)}:{line}" for path in MODULES["torchlens"].values()
           for line in _dict_copies(ast.parse(path.read_text(), str(path)))]
    assert not bad, "__dict__ copying (share one explicit object instead):\n  " + "\n  ".join(bad)


def test_the_dict_copying_rule_sees_each_spelling():
    assert _dict_copies(ast.parse("self.__dict__.update(other.__dict__)")) == [1]
    assert _dict_copies(ast.parse("vars(self).update(vars(other))")) == [1]
    assert _dict_copies(ast.parse("self.__dict__ = dict(other.__dict__)")) == [1]
    assert _dict_copies(ast.parse("module.__dict__['forward'] = f\nstate = dict(self.__dict__)")) == []
# The order of torchlens' packages, lowest first (derived from their imports). A module may import
# modules of its own unit and of units in lower layers, never of a unit in its own layer or above:
# units of one layer are independent of each other. A module's unit is the longest entry naming it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("torchlens.errors",),
    ("torchlens.hookspecs", "torchlens._interrupts", "torchlens._collector", "torchlens._progress", "torchlens.demo"),
    ("torchlens.plugins",),
    ("torchlens.core",),
    ("torchlens.edit",),  # edit rules (apply_edit, helpers) are applied by capture during the forward
    ("torchlens.capture",),
    ("torchlens.arch",),
    # The capture-facing half of features: ``tl.trace(..., features=...)`` splices dictionaries in
    # while capturing, so they sit below ``api``; ``features/`` reads and edits them through ``api``.
    ("torchlens.dictionaries",),
    ("torchlens.api",),
    ("torchlens.store",),
    ("torchlens.analysis",),  # renders store's and edit's objects (core.repr_html), captures through api
    ("torchlens.features",),
    ("torchlens.generation", "torchlens.testing"),
    ("torchlens.patching",),
    ("torchlens._core_services",),
    ("torchlens",),  # the package's __init__: the public names
    ("torchlens.cli",),
    ("torchlens.__main__",),
)
LAYER_OF = {unit: depth for depth, units in enumerate(LAYERS) for unit in units}


def unit_of(module: str) -> str | None:
    """The entry of :data:`LAYERS` that ``module`` belongs to (the longest naming it), or None."""
    named = [u for u in LAYER_OF if _in_package(module, u) and (u != "torchlens" or module == "torchlens")]
    return max(named, key=len, default=None)


# Uphill imports known and not yet fixed, each with its reason: (importing unit, imported unit).
# Empty: the last one (api importing features.attach, which ran features/__init__ -> stats -> store
# -> api) went when the capture-facing half of features became ``torchlens.dictionaries``.
KNOWN_UPHILL: dict[tuple[str, str], str] = {}


def _imported(module: str, importer: str) -> list[str]:
    """What importing ``module`` runs: it and every package ``__init__`` above it that ``importer``
    is not inside (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first)."""
    parts = module.split(".")
    found = [".".join(parts[:k]) for k in range(2, len(parts))]
    return [m for m in [*found, module] if m in FILES and not _in_package(importer, m)]


def uphill_imports(graph: dict[str, list[Import]], known=KNOWN_UPHILL) -> list[str]:
    """Every import (lazy and ``TYPE_CHECKING`` ones included) from a unit into its own layer or
    above, counting the package ``__init__`` files an import runs, but the ``known`` ones."""
    bad = []
    for module, imps in graph.items():
        here = unit_of(module)
        for imp in imps:
            if here is None or not _in_package(imp.module, "torchlens"):
                continue
            up = [(ran, there) for ran in _imported(imp.module, module) for there in [unit_of(ran)]
                  if there is not None and there != here and (here, there) not in known
                  and LAYER_OF[there] >= LAYER_OF[here]]
            if up:
                ran, there = up[-1]
                bad.append(f"{_where(imp, module)} ({here}) imports {ran} ({there})")
    return bad


def test_every_torchlens_module_has_a_layer():
    missing = [m for m in MODULES["torchlens"] if unit_of(m) is None]
    assert not missing, "modules in no unit of LAYERS (add their package):\n  " + "\n  ".join(missing)


def test_no_uphill_imports_between_packages():
    """No module imports a package in its own layer or above (see :data:`LAYERS`), lazy imports
    included: a package's folder never closes a loop with another's."""
    graph = {m: imps for m, imps in GRAPH.items() if _in_package(m, "torchlens")}
    bad = uphill_imports(graph)
    assert not bad, "imports up the package order (invert them, or move the code):\n  " + "\n  ".join(bad)
    used = {(unit_of(m), unit_of(ran)) for m, imps in graph.items() for i in imps
            if _in_package(i.module, "torchlens") for ran in _imported(i.module, m)}
    assert set(KNOWN_UPHILL) <= used, f"KNOWN_UPHILL lists imports that are gone: {set(KNOWN_UPHILL) - used}"


def test_the_uphill_rule_sees_an_uphill_import():
    up = Import("torchlens.analysis.notebook", 3, True, "torchlens.analysis.notebook.recipe_html", False, 3)
    peer = Import("torchlens.generation.run", 4, False, "torchlens.generation.run.generate", False, 4)
    down = Import("torchlens.core.records", 5, False, "torchlens.core.records.Op", False, 5)
    own = Import("torchlens.store._shards", 6, False, "torchlens.store._shards.write_shard", False, 6)
    assert len(uphill_imports({"torchlens.store.recipes": [up, down, own]})) == 1
    assert len(uphill_imports({"torchlens.testing": [peer]})) == 1
    # a module of a lower unit inside a higher package still runs that package's __init__:
    # api importing features.dla runs features/__init__ (above api), and ``known`` excuses it
    dla = Import("torchlens.features.dla", 7, False, "torchlens.features.dla.feature_activations", False, 7)
    assert len(uphill_imports({"torchlens.api": [dla]})) == 1
    assert not uphill_imports({"torchlens.api": [dla]}, known={("torchlens.api", "torchlens.features"): "why"})
    attach = Import("torchlens.dictionaries.attach", 8, False, "torchlens.dictionaries.attach.feature_steps",
                    False, 8)
    assert not uphill_imports({"torchlens.api": [attach]})  # below api, and so is its package's __init__
    assert len(uphill_imports({"torchlens.dictionaries.wrap": [Import("torchlens.api", 9, True, "torchlens.api.trace",
                                                                      False, 9)]})) == 1
    assert unit_of("torchlens.dictionaries.attach") == "torchlens.dictionaries"
    assert unit_of("torchlens.features.stats") == "torchlens.features"
    assert unit_of("torchlens.api") == "torchlens.api" and unit_of("torchlens") == "torchlens"


# Module names (a leading underscore ignored; packages count by their folder's name) that several
# torchlens modules may share, each with its reason. Any other name has one owner.
SHARED_MODULE_NAMES = {
    "__init__": "every package has one",
    # generation/ mirrors the core's API one generation step at a time (GenerationTrace is a trace
    # per step, generation.compare compares two generations, generation.replay re-runs steps)
    "compare": "generation/ mirrors analysis.compare per step",
    "replay": "generation/ mirrors edit.replay per step",
    "sites": "generation/ mirrors core.sites per step",
    "steps": "generation/ mirrors core.steps per step",
    "trace": "generation/ mirrors core.trace per step",
    "fork": "generation/fork.py edits a generation's fork step by step, as core.fork's Fork a trace's",
    # features/ offers edit/'s and analysis/'s roles over a dictionary's features
    "edits": "features/ mirrors edit.edits for features",
    "reads": "features/ mirrors edit.reads for features",
    "display": "features/ mirrors analysis.display for features",
}


def module_names() -> dict[str, list[str]]:
    """``{name: [file or folder, ...]}`` for every torchlens module and package."""
    names: dict[str, list[str]] = {}
    for path in MODULES["torchlens"].values():
        where = path.relative_to(REPO).as_posix()
        name = path.parent.name if path.name == "__init__.py" else path.stem
        names.setdefault(name.lstrip("_") or name, []).append(where.removesuffix("/__init__.py") + "/"
                                                             if path.name == "__init__.py" else where)
        if path.name == "__init__.py":
            names.setdefault("__init__", []).append(where)
    return names


def test_one_module_per_name():
    """No two torchlens modules (or packages) share a name, leading underscore ignored, but the
    justified :data:`SHARED_MODULE_NAMES`; and each justification is still needed."""
    names = module_names()
    shared = {n: files for n, files in names.items() if len(files) > 1}
    bad = [f"{n}: {', '.join(files)}" for n, files in sorted(shared.items()) if n not in SHARED_MODULE_NAMES]
    assert not bad, "modules sharing a name (rename one so each name has one owner):\n  " + "\n  ".join(bad)
    stale = sorted(set(SHARED_MODULE_NAMES) - set(shared))
    assert not stale, f"SHARED_MODULE_NAMES lists names no longer shared: {stale}"


def test_one_class_per_name():
    """No two classes defined anywhere in torchlens (nested ones included) share a name."""
    where: dict[str, list[str]] = {}
    for path in MODULES["torchlens"].values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    bad = [f"{name}: {', '.join(places)}" for name, places in sorted(where.items()) if len(places) > 1]
    assert not bad, "classes sharing a name (one name, one class):\n  " + "\n  ".join(bad)


def test_no_package_imports_a_private_name_of_core():
    """Outside ``core/`` no module imports a private name of ``core``: ``arch/`` resolves names only
    (selectors bind themselves, ``Selector.bind(names)``) and the store encodes the public ``And`` /
    ``Or`` combinators."""
    bad = [f"{_where(i, m)} imports {i.name}" for m, imps in GRAPH.items()
           if _in_package(m, "torchlens") and not _in_package(m, "torchlens.core")
           for i in imps if _in_package(i.name, "torchlens.core") and i.name.rsplit(".", 1)[-1].startswith("_")]
    assert not bad, "private names of core imported from outside it:\n  " + "\n  ".join(bad)


def test_core_services_are_replay_only_and_typed():
    """``core.services.TraceServices`` holds only what the core cannot import (a model's names, replay,
    re-execution); every other trace method is provided by its owning package (``core.actions``). Its
    parameters are typed: ``Any`` only for the user's ``inputs``."""
    tree = ast.parse(FILES["torchlens.core.services"].read_text())
    proto = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TraceServices")
    methods = [n for n in proto.body if isinstance(n, ast.FunctionDef)]
    assert {m.name for m in methods} == {"names", "replay", "replay_many", "rerun"}
    loose = [f"{m.name}({a.arg})" for m in methods for a in [*m.args.args, *m.args.kwonlyargs]
             if a.arg not in ("self", "inputs") and (a.annotation is None or ast.unparse(a.annotation) == "Any")]
    loose += [f"{m.name} returns Any" for m in methods if m.returns is None or ast.unparse(m.returns) == "Any"]
    assert not loose, f"untyped services parameters: {loose}"


def _class_node(module: str, name: str) -> ast.ClassDef:
    tree = ast.parse(FILES[module].read_text(), str(FILES[module]))
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _type_checking_declarations(cls: type) -> dict[str, tuple[type, ast.FunctionDef]]:
    """``{name: (declaring class, node)}``: the methods declared under ``if TYPE_CHECKING:`` in the
    bodies of ``cls`` and its torchlens bases (what type checkers see and the run never defines)."""
    found = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ not in FILES:
            continue
        for stmt in _class_node(klass.__module__, klass.__name__).body:
            if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
                found.update({f.name: (klass, f) for f in stmt.body if isinstance(f, ast.FunctionDef)})
    return found


def _signature(fn: ast.FunctionDef) -> list[tuple[str, ...]]:
    """A function's decorators and parameters but ``self`` (name, kind, annotation, default), as source text."""
    a = fn.args
    text = ast.unparse
    pos = [*a.posonlyargs, *a.args]
    pos_defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
    params = [(p.arg, "positional", p.annotation and text(p.annotation), d and text(d))
              for p, d in zip(pos, pos_defaults)][1:]
    params += [(p.arg, "keyword", p.annotation and text(p.annotation), d and text(d))
               for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    params += [(p.arg, kind, p.annotation and text(p.annotation), None)
               for p, kind in ((a.vararg, "*"), (a.kwarg, "**")) if p is not None]
    return [tuple(text(d) for d in fn.decorator_list), *params]


def _provided() -> dict[tuple[type, str], str]:
    """``{(core class, name): "module.Mixin"}`` for torchlens' own classes (tests add toy targets)."""
    import torchlens  # noqa: F401 - lazy: importing it runs every provide_methods
    from torchlens.core.actions import provided_methods

    return {k: v for k, v in provided_methods().items() if k[0].__module__ in FILES}


def test_provided_methods_are_declared_for_type_checkers_with_their_owners_signatures():
    """Each method a package provides to a core class (``core.actions.provide_methods``) is declared
    under ``if TYPE_CHECKING:`` in that class's body or a torchlens base's, and nothing else is: the
    same decorators and parameters as the owner's, and the owner's return type, or ``Any`` when the
    core may not name it (a class of a package above the core)."""
    import typing

    provided = _provided()
    assert {name for _, name in provided} >= {"validate", "save", "draw", "facets"}
    for target in {t for t, _ in provided}:
        declared = _type_checking_declarations(target)
        names = {n for t, n in provided if t is target}
        assert set(declared) == names, f"{target.__name__}: declared {sorted(declared)}, provided {sorted(names)}"
        for name, (_, node) in declared.items():
            module, mixin = provided[target, name].rsplit(".", 1)
            owner = next(f for f in _class_node(module, mixin).body
                         if isinstance(f, ast.FunctionDef) and f.name == name)
            assert _signature(node) == _signature(owner), f"{target.__name__}.{name} drifted from {mixin}.{name}"
            want, got = ast.unparse(owner.returns), ast.unparse(node.returns)
            if got != want:
                member = vars(target)[name]
                returned = typing.get_type_hints(getattr(member, "fget", member))["return"]
                above_core = returned.__module__.startswith("torchlens.") and not returned.__module__.startswith(
                    "torchlens.core")
                assert got == "Any" and above_core, f"{target.__name__}.{name} returns {got}, its owner {want}"


def test_a_runtime_trace_gets_the_declared_methods_from_their_owners():
    """The declarations never run: at run time each name is the owner's mixin's own member, on a
    trace, a fork and a site."""
    import importlib
    import inspect

    provided = _provided()
    _, _, trace = _tiny_trace()
    instances = {"Trace": [trace, trace.fork()], "Site": [trace[trace.output_layers[0]]]}
    for (target, name), owner in provided.items():
        module, mixin = owner.rsplit(".", 1)
        member = vars(getattr(importlib.import_module(module), mixin))[name]
        declaring = _type_checking_declarations(target)[name][0]
        assert vars(target)[name] is member and (declaring is target or name not in vars(declaring))
        for obj in instances[target.__name__]:
            assert inspect.getattr_static(obj, name) is member
    assert "relu" in trace.table() and trace.validate().ok


def test_the_signature_check_sees_a_drift():
    def sig(src: str) -> list[tuple[str, ...]]:
        return _signature(ast.parse(src).body[0])

    assert sig("def f(self: T, a: int = 1, *, b=None) -> X: ...") == sig("def f(self, a: int = 1, *, b=None): ...")
    assert sig("def f(self, a=1): ...") != sig("def f(self, *, a=1): ...")  # kind
    assert sig("def f(self, a=1): ...") != sig("def f(self, a=2): ...")  # default
    assert sig("def f(self, a: int): ...") != sig("def f(self, a: str): ...")  # annotation
    assert sig("@property\ndef f(self): ...") != sig("def f(self): ...")
