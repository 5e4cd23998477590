"""``envoy.source.<op>_<n>``: the operations inside one module's ``forward``.

A module's own ``.input``/``.output`` are the only values its hooks see. To reach
what happens *between* them, the module's ``forward`` is recompiled from its
source with every call ``f(...)`` routed through ``__tl_op__("f_<n>", f, ...)`` and
every single-name assignment ``x = v`` through ``__tl_op__("x_<n>", bind, v)``.
``<n>`` counts occurrences of a name in execution order (inner calls first), so
the labels are the ones nnsight 0.8 gives (``self_c_attn_0``,
``attention_interface_0``, ``torch_relu_0``).

During a run a sourced module's gate runs the recompiled forward; each operation
reports ``{path}.source.{label}.input``, ``.skip`` and ``.output`` to the run,
which serves and edits them like a module's. Outside a run the recompiled
forward is never called. Decorators around ``forward`` (``functools.wraps``
style) are kept: each wrapper is rebuilt around the recompiled function.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from types import CellType, CodeType, FunctionType
from typing import TYPE_CHECKING, Any, NamedTuple

from torchlens.core.names import nearest

from . import _worker
from ._served import Served, first_input_repack, first_input_view
from ._unsupported import STATE, Controller
from .errors import ShimUnsupportedError, SourceNotAvailableError
from .interleaver import NO_SKIP

if TYPE_CHECKING:
    from .envoy import Envoy

__all__ = [
    "STATE",
    "Compiled",
    "Controller",
    "Source",
    "SourceNotAvailable",
    "SourceOp",
    "compile_forward",
    "install",
    "instrument",
    "make_op",
]

SourceNotAvailable = SourceNotAvailableError  # nnsight's name for it

OP = "__tl_op__"
BIND = "__tl_bind__"
SHELL = "__tl_shell__"


def _bind(value: Any) -> Any:
    return value


class Compiled(NamedTuple):
    code: CodeType
    labels: tuple[str, ...]
    lines: dict[str, int]  # label -> line within `text` (1-based)
    text: str


class _Labeller(ast.NodeTransformer):
    """Rewrites calls and assignments into op calls, numbering names in execution order."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.labels: list[str] = []
        self.lines: dict[str, int] = {}

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
        return self._op("_".join(parts), ast.Name(id=BIND, ctx=ast.Load()), [value], [], at)

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


_COMPILED: dict[CodeType, Compiled] = {}


def compile_forward(fn: FunctionType) -> Compiled:
    """``fn`` recompiled with its operations labelled (cached per code object)."""
    code = fn.__code__
    cached = _COMPILED.get(code)
    if cached is not None:
        return cached
    try:
        lines, start = inspect.getsourcelines(code)
    except (OSError, TypeError) as error:
        raise SourceNotAvailableError(f"no Python source for {fn.__qualname__}") from error
    text = textwrap.dedent("".join(lines))
    tree = ast.parse(text)
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
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
    ast.increment_lineno(tree, start - 1)
    ast.fix_missing_locations(tree)
    module_code = compile(tree, code.co_filename, "exec")
    shell_code = next(c for c in module_code.co_consts if isinstance(c, CodeType) and c.co_name == SHELL)
    inner = next(c for c in shell_code.co_consts if isinstance(c, CodeType) and c.co_name == code.co_name)
    compiled = Compiled(inner, tuple(labeller.labels), labeller.lines, text)
    _COMPILED[code] = compiled
    return compiled


def _peel(fn: Any) -> tuple[FunctionType, list[tuple[FunctionType, int]]]:
    """The innermost function under ``functools.wraps`` decorators, and how to rebuild them."""
    chain: list[tuple[FunctionType, int]] = []
    while isinstance(fn, FunctionType) and isinstance(getattr(fn, "__wrapped__", None), FunctionType):
        inner = fn.__wrapped__
        cells = fn.__closure__ or ()
        index = next((i for i, cell in enumerate(cells) if cell.cell_contents is inner), None)
        if index is None:
            break
        chain.append((fn, index))
        fn = inner
    if not isinstance(fn, FunctionType):
        raise SourceNotAvailableError(f"{fn!r} has no Python source to instrument")
    return fn, chain


def instrument(module: Any, op: Any) -> tuple[Any, Compiled]:
    """A bound replacement for ``module.forward`` that reports each operation to ``op``."""
    forward = type(module).forward
    inner, chain = _peel(forward)
    compiled = compile_forward(inner)
    cells = dict(zip(inner.__code__.co_freevars, inner.__closure__ or ()))
    closure = tuple(cells[name] for name in compiled.code.co_freevars) or None
    rebuilt = FunctionType(
        compiled.code, {**inner.__globals__, OP: op, BIND: _bind}, inner.__name__, inner.__defaults__, closure
    )
    rebuilt.__kwdefaults__ = inner.__kwdefaults__
    for wrapper, index in reversed(chain):
        new_cells = list(wrapper.__closure__)
        new_cells[index] = CellType(rebuilt)
        outer = FunctionType(
            wrapper.__code__, wrapper.__globals__, wrapper.__name__, wrapper.__defaults__, tuple(new_cells)
        )
        outer.__kwdefaults__ = wrapper.__kwdefaults__
        outer.__wrapped__ = rebuilt
        rebuilt = outer
    return rebuilt.__get__(module), compiled


def make_op(envoy: Envoy) -> Any:
    """The ``__tl_op__`` of one module: report an operation's input, skip and output to the run."""
    tree = envoy._tree
    prefix = f"{envoy.path}.source."
    get_ident = threading.get_ident
    locations: dict[str, tuple[str, str, str]] = {}

    def op(label: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        run = tree.run
        if run is None or run.owner != get_ident():
            return fn(*args, **kwargs)
        where = locations.get(label)
        if where is None:
            base = prefix + label
            where = locations[label] = (f"{base}.input", f"{base}.skip", f"{base}.output")
        args, kwargs = run.handle(where[0], (args, kwargs))
        value = run.handle(where[1], NO_SKIP)
        if value is NO_SKIP:
            value = fn(*args, **kwargs)
        return run.handle(where[2], value)

    return op


class SourceOp:
    """One operation of a sourced forward: ``.output``, ``.input``, ``.inputs``, ``.skip(v)``."""

    output = Served("output")
    inputs = Served("input")
    input = Served("input", view=first_input_view, repack=first_input_repack)

    def __init__(self, envoy: Envoy, label: str, compiled: Compiled) -> None:
        self.envoy = envoy
        self.label = label
        self.path = f"{envoy.path}.source.{label}"
        self._compiled = compiled

    def skip(self, replacement: Any) -> None:
        _worker.skip(f"{self.path}.skip", replacement)

    @property
    def source(self) -> Any:
        raise ShimUnsupportedError(
            f"{self.path}.source: drilling into a called function is not available in the shim",
            remedy="Source the submodule that runs it instead, or record every op with torchlens.trace(model, x).",
        )

    def __repr__(self) -> str:
        lines = self._compiled.text.split("\n")
        at = self._compiled.lines[self.label] - 1
        window = range(max(0, at - 3), min(len(lines), at + 4))
        body = [f"--> {lines[i]} <--" if i == at else f"    {lines[i]}" for i in window]
        return f"{self.path}:\n" + "\n".join(body)


class Source:
    """The labelled operations of one module's ``forward``; attribute access by label."""

    def __init__(self, envoy: Envoy) -> None:
        object.__setattr__(self, "_envoy", envoy)
        object.__setattr__(self, "_compiled", install(envoy))

    def __getattr__(self, name: str) -> SourceOp:
        compiled = self._compiled
        if name not in compiled.lines:
            raise SourceNotAvailableError(
                f"{self._envoy.path}.source has no operation {name!r}; nearest: "
                f"{nearest(name, compiled.labels)}"
            )
        return SourceOp(self._envoy, name, compiled)

    @property
    def names(self) -> list[str]:
        """The operation labels, in the order the forward reaches them."""
        return list(self._compiled.labels)

    def __dir__(self) -> list[str]:
        return list(self._compiled.labels)

    def __iter__(self):
        return iter(self._compiled.labels)

    def __repr__(self) -> str:
        compiled = self._compiled
        lines = compiled.text.split("\n")
        by_line: dict[int, list[str]] = {}
        for label in compiled.labels:
            by_line.setdefault(compiled.lines[label] - 1, []).append(label)
        width = max((len(label) for label in compiled.labels), default=0)
        out = []
        # nnsight's layout: the def line marked '*', an op's line '->', more ops on it '+'
        for index, line in enumerate(lines):
            labels = by_line.get(index, [])
            if labels:
                out.append(f"{labels[0]:>{width}} -> {line}")
                out.extend(f"{label:>{width}}  + " for label in labels[1:])
            elif line.lstrip().startswith(("def ", "async def ")):
                out.append(f"{'':>{width}}  * {line.lstrip()}")
            else:
                out.append(f"{'':>{width}}    {line}")
        return "\n".join(out).rstrip()


def install(envoy: Envoy) -> Compiled:
    """Source-instrument ``envoy``'s module for every later run (and the current one)."""
    tree = envoy._tree
    module = envoy._module
    entry = tree.sourced.get(id(module))
    if entry is None:
        try:
            bound, compiled = instrument(module, make_op(envoy))
        except SyntaxError as error:
            raise SourceNotAvailableError(f"could not recompile {type(module).__name__}.forward") from error
        entry = tree.sourced[id(module)] = (bound, compiled)
        tree.source_installed(module)
    return entry[1]
