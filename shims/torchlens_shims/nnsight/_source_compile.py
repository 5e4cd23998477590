"""Recompiling a Python function with each of its operations routed through an op callback.

Every call ``f(...)`` in the function's source becomes ``__tl_op__("f_<n>", f, ...)`` and
every single-name assignment ``x = v`` becomes ``__tl_op__("x_<n>", __tl_bind__, v)``.
``<n>`` counts occurrences of a name in execution order (inner calls first), so the labels
are the ones nnsight 0.8 gives (``self_c_attn_0``, ``attention_interface_0``,
``torch_relu_0``). The same recompilation serves a module's ``forward`` and any callable
reached by drilling into an operation (``op.source``): a plain function, a bound method,
a callable instance (its ``__call__``), each under the decorators that wrap it.

Which decorators are peeled is read from the wrapper's own source: a wrapper is peeled
when exactly one of the Python functions it closes over is called by name in its body
(``func(*args, **kwargs)``) — that is the decorated function, and the wrapper is rebuilt
around the instrumented copy so its behaviour (``torch.no_grad()``) still applies. A
wrapper that hands the function to a helper or a lookup (the function may never run), or
that calls two closed-over functions (which one is decorated is ambiguous), is
instrumented as it is, so the call that really runs is the operation to drill into.
``__wrapped__`` alone decides nothing: it would peel a dispatcher too.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from types import CellType, CodeType, FunctionType, MethodType
from typing import Any, NamedTuple

from .errors import SourceNotAvailableError

__all__ = ["BIND", "OP", "Compiled", "bind", "compile_function", "instrument", "peel"]

OP = "__tl_op__"
BIND = "__tl_bind__"
SHELL = "__tl_shell__"


def bind(value: Any) -> Any:
    """The stand-in "function" of an assignment operation: its output is the assigned value."""
    return value


class Compiled(NamedTuple):
    """One recompiled function: its code, its operation labels and where they are."""

    code: CodeType
    labels: tuple[str, ...]
    lines: dict[str, int]  # label -> line within `text` (1-based)
    text: str
    assignments: frozenset[str]  # labels of `x = v` operations (nothing to drill into)

    @property
    def names(self) -> tuple[str, ...]:
        """The operation labels in execution order (nnsight's ``compiled.names``)."""
        return self.labels


class _Labeller(ast.NodeTransformer):
    """Rewrites calls and assignments into op calls, numbering names in execution order."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.labels: list[str] = []
        self.lines: dict[str, int] = {}
        self.assignments: set[str] = set()

    @staticmethod
    def _chain(expr: ast.expr) -> tuple[list[str], bool]:
        parts: list[str] = []
        while True:
            if isinstance(expr, ast.Attribute):
                parts.append(expr.attr)
                expr = expr.value
            elif isinstance(expr, ast.Subscript):
                expr = expr.value
            elif isinstance(expr, ast.Name):
                parts.append(expr.id)
                return parts[::-1], True
            else:
                return parts[::-1], False

    def _op(self, name: str, fn: ast.expr, args: list, keywords: list, at: ast.AST) -> ast.Call:
        index = self.seen.get(name, 0)
        self.seen[name] = index + 1
        label = f"{name}_{index}"
        self.labels.append(label)
        self.lines[label] = at.lineno
        call = ast.Call(
            func=ast.Name(id=OP, ctx=ast.Load()),
            args=[ast.Constant(value=label), fn, *args],
            keywords=keywords,
        )
        return ast.copy_location(call, at)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Name) and node.func.id == "super" and not (node.args or node.keywords):
            return node  # zero-argument super() needs the frame it is written in
        self.generic_visit(node)  # inner calls are numbered first
        parts, _ = self._chain(node.func)
        return self._op("_".join(parts) or "call", node.func, node.args, node.keywords, node)

    def _assigned(self, target: ast.expr, value: ast.expr, at: ast.AST) -> ast.expr:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            elements = [*target.elts, *value.elts]
            if len(target.elts) == len(value.elts) and not any(isinstance(e, ast.Starred) for e in elements):
                value.elts = [self._assigned(t, v, at) for t, v in zip(target.elts, value.elts)]
            return value
        parts, rooted = self._chain(target)
        if not rooted:
            return value
        call = self._op("_".join(parts), ast.Name(id=BIND, ctx=ast.Load()), [value], [], at)
        self.assignments.add(self.labels[-1])
        return call

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        node.value = self.visit(node.value)
        node.targets = [self.visit(target) for target in node.targets]
        if len(node.targets) == 1:
            node.value = self._assigned(node.targets[0], node.value, node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is not None:
            node.value = self._assigned(node.target, self.visit(node.value), node)
        return node


def _parse(code: CodeType, what: str) -> tuple[ast.Module, int, str]:
    """The parsed source of ``code`` (dedented), its first line in the file, and the text."""
    try:
        lines, start = inspect.getsourcelines(code)
    except (OSError, TypeError) as error:
        raise SourceNotAvailableError(f"no Python source for {what}") from error
    text = textwrap.dedent("".join(lines))
    try:
        tree = ast.parse(text)
    except SyntaxError as error:  # a lambda or a def sharing its line with other code
        raise SourceNotAvailableError(f"the source of {what} does not parse on its own") from error
    return tree, start, text


_COMPILED: dict[CodeType, Compiled] = {}


def compile_function(fn: FunctionType) -> Compiled:
    """``fn`` recompiled with its operations labelled (cached per code object).

    Raises:
        SourceNotAvailableError: ``fn`` has no readable Python source, or it is not a
            ``def`` (a lambda).
    """
    code = fn.__code__
    cached = _COMPILED.get(code)
    if cached is not None:
        return cached
    tree, start, text = _parse(code, fn.__qualname__)
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)) or definition.name != code.co_name:
        raise SourceNotAvailableError(f"{fn.__qualname__} is not a plain function")
    definition.decorator_list = []
    labeller = _Labeller()
    labeller.visit(tree)
    # Nested in a shell whose parameters are the free variables, so they stay free
    # variables (and get the original cells) instead of turning into globals.
    shell = ast.FunctionDef(
        name=SHELL,
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(arg=name) for name in code.co_freevars],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[definition, ast.Return(value=ast.Name(id=definition.name, ctx=ast.Load()))],
        decorator_list=[],
    )
    tree.body[0] = ast.copy_location(shell, definition)
    # Real file lines, so a traceback through the copy points at the user's line.
    ast.increment_lineno(tree, start - 1)
    ast.fix_missing_locations(tree)
    module_code = compile(tree, code.co_filename, "exec")
    shell_code = next(c for c in module_code.co_consts if isinstance(c, CodeType) and c.co_name == SHELL)
    inner = next(c for c in shell_code.co_consts if isinstance(c, CodeType) and c.co_name == code.co_name)
    compiled = Compiled(
        inner, tuple(labeller.labels), labeller.lines, text, frozenset(labeller.assignments)
    )
    _COMPILED[code] = compiled
    return compiled


_CALLED: dict[CodeType, frozenset[str]] = {}


def _called_names(code: CodeType, what: str) -> frozenset[str]:
    """The bare names ``code``'s source calls (``func(...)``); empty without readable source."""
    called = _CALLED.get(code)
    if called is None:
        try:
            tree, _, _ = _parse(code, what)
        except SourceNotAvailableError:
            tree = ast.Module(body=[], type_ignores=[])
        called = _CALLED[code] = frozenset(
            node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        )
    return called


def _decorated_cell(wrapper: FunctionType) -> int | None:
    """The closure cell holding the function ``wrapper`` decorates, if its source says so."""
    code = wrapper.__code__
    if not code.co_freevars:
        return None
    called = _called_names(code, wrapper.__qualname__)
    candidates = [
        index
        for index, (name, cell) in enumerate(zip(code.co_freevars, wrapper.__closure__))
        if name in called and isinstance(_contents(cell), FunctionType)
    ]
    return candidates[0] if len(candidates) == 1 else None


def _contents(cell: CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def peel(fn: FunctionType) -> tuple[FunctionType, list[tuple[FunctionType, int]]]:
    """The function under ``fn``'s peelable decorators, and the ``(wrapper, cell)`` chain, outermost first."""
    chain: list[tuple[FunctionType, int]] = []
    seen = {fn}
    while (index := _decorated_cell(fn)) is not None:
        chain.append((fn, index))
        fn = fn.__closure__[index].cell_contents
        if fn in seen:  # a closure that calls itself
            chain.pop()
            break
        seen.add(fn)
    return fn, chain


def _like(fn: FunctionType, code: CodeType, globals_: dict, closure: tuple | None) -> FunctionType:
    """A new function with ``fn``'s defaults, names and attributes but ``code``/``globals_``/``closure``."""
    new = FunctionType(code, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    new.__dict__.update(fn.__dict__)
    return new


def instrument(fn: Any, op: Any) -> tuple[Any, Compiled]:
    """A copy of the callable ``fn`` that reports each operation to ``op``, and its `Compiled`.

    A bound method is rebuilt from its function and bound to the same receiver; a callable
    instance is instrumented through its ``__call__``. Peelable decorators are rebuilt
    around the instrumented function with fresh cells (the originals are shared by every
    user of the function and stay untouched).

    Args:
        fn: the callable to instrument.
        op: the ``__tl_op__(label, fn, *args, **kwargs)`` its operations call.

    Returns:
        The instrumented callable and the labels of its operations.

    Raises:
        SourceNotAvailableError: ``fn`` has no Python code (a builtin or C function, or an
            object whose ``__call__`` is one) or its source cannot be read.
    """
    if not isinstance(fn, (FunctionType, MethodType)) and isinstance(
        inspect.getattr_static(type(fn), "__call__", None), FunctionType
    ):
        fn = fn.__call__  # a callable instance: its code is its class's __call__
    receiver = fn.__self__ if isinstance(fn, MethodType) else None
    function = fn.__func__ if receiver is not None else fn
    if not isinstance(function, FunctionType):
        raise SourceNotAvailableError(
            f"{fn!r} has no Python source to instrument (a builtin or C function, or an object whose "
            "__call__ is one)",
            remedy="Read the operation's own .input/.output; only Python functions can be drilled into.",
        )
    inner, chain = peel(function)
    compiled = compile_function(inner)
    cells = dict(zip(inner.__code__.co_freevars, inner.__closure__ or ()))
    closure = tuple(cells[name] for name in compiled.code.co_freevars) or None
    built = _like(inner, compiled.code, {**inner.__globals__, OP: op, BIND: bind}, closure)
    for wrapper, index in reversed(chain):
        new_cells = list(wrapper.__closure__)
        new_cells[index] = CellType(built)
        outer = _like(wrapper, wrapper.__code__, wrapper.__globals__, tuple(new_cells))
        if "__wrapped__" in wrapper.__dict__:
            outer.__wrapped__ = built
        built = outer
    return (built.__get__(receiver) if receiver is not None else built), compiled
