"""Lifting a ``with`` body out of its frame so it can run later, elsewhere.

nnsight's ``with model.trace(x):`` body does not run where it is written: it
runs as a worker fed by the model's forward, which only starts once the block is
closed. Python offers no hook for "don't run this block", so the shim does what
nnsight does, in its own code:

1. **find** the ``with`` statement at the line the tracer was entered from, in
   the source the frame was compiled from, and compile its body on its own
   (kept under the original file name and line numbers, so tracebacks and nested
   blocks still point at the user's lines) — cached per site;
2. **skip** the body in place: a frame-local trace function raises `SkipBody`
   the moment the body's first line is reached, which ``__exit__`` swallows;
3. **run** the compiled body in a `BlockScope` and **push** back only what is
   meant to leave it (see `_saving`).
"""

from __future__ import annotations

import ast
import ctypes
import linecache
import os
import sys
import threading
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

from .errors import WithBlockNotFoundError, WithBlockShapeError

__all__ = [
    "not_found_message",
    "Block",
    "BlockScope",
    "SkipBody",
    "arm_skip",
    "clear_shared",
    "disarm",
    "find_block",
    "push",
    "require_block",
    "shared_store",
    "snapshot",
]

_TRY = tuple(node for node in (ast.Try, getattr(ast, "TryStar", None)) if node is not None)


@dataclass(frozen=True)
class Block:
    """One ``with`` statement: its node, its compiled body, where the body starts."""

    node: ast.With | ast.AsyncWith
    code: CodeType
    body_line: int
    runs_code: bool  # False for a body of only `pass` / docstrings: nothing to lift


class _SourceIndex:
    """Every ``with`` statement of one source text, by each line it can be entered from."""

    def __init__(self, source: str) -> None:
        self.by_line: dict[int, ast.With | ast.AsyncWith] = {}
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return
        for node in ast.walk(tree):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                lines = {node.lineno, *(item.context_expr.lineno for item in node.items)}
                for line in lines:
                    self.by_line.setdefault(line, node)


_INDEXES: dict[tuple[str, int], _SourceIndex] = {}
_BLOCKS: dict[tuple[CodeType, int], Block | None] = {}


def _source(filename: str, frame: FrameType) -> str:
    lines = linecache.getlines(filename, frame.f_globals)
    if lines:
        return "".join(lines)
    if filename == "<string>" and "-c" in getattr(sys, "orig_argv", ()):
        argv = sys.orig_argv
        return argv[argv.index("-c") + 1] + "\n"
    return ""


def _index(filename: str, frame: FrameType) -> _SourceIndex:
    source = _source(filename, frame)
    key = (filename, hash(source))
    index = _INDEXES.get(key)
    if index is None:
        index = _INDEXES[key] = _SourceIndex(source)
    return index


def _runs_code(node: ast.With | ast.AsyncWith) -> bool:
    for statement in node.body:
        if isinstance(statement, ast.Pass):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        return True
    return False


def find_block(frame: FrameType) -> Block | None:
    """The ``with`` statement ``frame`` is executing the header of, or ``None``."""
    code = frame.f_code
    key = (code, frame.f_lineno)
    if key in _BLOCKS:
        return _BLOCKS[key]
    node = _index(code.co_filename, frame).by_line.get(frame.f_lineno)
    block = None
    if node is not None:
        module = ast.Module(body=node.body, type_ignores=[])
        compiled = compile(module, code.co_filename, "exec", dont_inherit=True)
        compiled = compiled.replace(co_name=code.co_name)
        block = Block(node, compiled, node.body[0].lineno, _runs_code(node))
    _BLOCKS[key] = block
    return block


def not_found_message(filename: str, lineno: int, glbls: dict | None = None) -> str:
    """Why no ``with`` was found at ``filename:lineno``, told apart by what source there is.

    No source at all (stdin, an ``exec``'d string), a file on disk (not a ``with`` there,
    or the file changed since it was read) and other readable source (a cell rewritten
    by a magic, generated code out of step with ``linecache``) each have their own way out.
    """
    source = linecache.getlines(filename, glbls)
    reads = f", which reads `{source[lineno - 1].strip()}`" if 1 <= lineno <= len(source) else ""
    if not source:
        return (
            f"the shim has no source for {filename}, so it cannot read the body of the `with` block at "
            f"line {lineno}: it compiles the block's own source to run it, so a trace must live where its "
            "source can be read back (a file, a notebook cell, `python -c`). Piping a script on stdin "
            "(`python < script.py`) leaves none: run the file by name; code built at run time must "
            "register itself in `linecache`."
        )
    if os.path.isfile(filename):
        return (
            f"no `with` statement was found at {filename}:{lineno}, the line the trace was entered "
            f"from{reads}. Either the tracer was not used as a `with` block (the shim compiles the "
            "block's own body, so there is nothing to capture), or the source read for this file is "
            "stale: a file edited while the process runs keeps its old text; restart the process."
        )
    return (
        f"no `with` statement was found at {filename}:{lineno}, the line the trace was entered "
        f"from{reads}. Write the trace as `with model.trace(...):` in source whose line numbers match "
        "the code being run: a cell magic that rewrites the cell (`%%time`), or generated source "
        "out of step with its `linecache` entry, breaks that match."
    )


def require_block(frame: FrameType) -> Block:
    block = find_block(frame)
    if block is None:
        raise WithBlockNotFoundError(not_found_message(frame.f_code.co_filename, frame.f_lineno, frame.f_globals))
    return block


class SkipBody(Exception):
    """Control flow only: raised at the body's first line so the body does not run inline."""

    def __init__(self, displaced: Any, frame_trace: Any) -> None:
        super().__init__()
        self.displaced = displaced
        self.frame_trace = frame_trace


def _silent(frame: FrameType, event: str, arg: Any) -> None:
    return None


def arm_skip(frame: FrameType, block: Block) -> None:
    """Make ``frame`` raise `SkipBody` when it reaches the first line of ``block``'s body.

    Line events reach a frame's own trace function only while some global trace
    function is set, so a silent one is installed until ``__exit__`` restores
    whatever was there (a debugger, coverage).
    """
    node = block.node
    if block.body_line == node.lineno:
        raise WithBlockShapeError(
            "the body of a traced `with` must start on its own line: the shim runs the body "
            "itself and can only intercept it at the start of a line"
        )
    if isinstance(node.body[0], _TRY):
        raise WithBlockShapeError(
            "a traced `with` block cannot start with `try:` (Python gives no way back out of "
            "an exception raised on that line); put a statement above the `try`"
        )
    displaced = sys.gettrace()
    previous_local = frame.f_trace
    body_line = block.body_line

    def skip(current: FrameType, event: str, arg: Any) -> Any:
        if current.f_lineno < body_line:
            # itself, read off the frame: naming `skip` here would make the closure a cycle
            # that outlives every trace until a GC pass
            return current.f_trace
        raise SkipBody(displaced, previous_local)

    sys.settrace(_silent)
    frame.f_trace = skip


def disarm(frame: FrameType | None, exc: SkipBody) -> None:
    """Put back the trace functions `arm_skip` displaced."""
    sys.settrace(exc.displaced)
    if frame is not None:
        try:
            frame.f_trace = exc.frame_trace
        except (AttributeError, ValueError):
            pass


class BlockScope(dict):
    """The namespace a lifted body runs in (passed to ``exec`` as its globals).

    Lookups go: the snapshot of the frame's locals taken when the block was
    captured, then ``shared`` (names bound by sibling blocks written in the same
    frame, e.g. earlier invokes), then the frame's globals. Being ``exec``'s
    globals is what lets lambdas and comprehensions in the body see its names.
    Writes are recorded in `written`, which is all that is ever pushed back.
    """

    def __init__(self, own: dict, shared: dict, glbls: dict) -> None:
        super().__init__(own)
        self.shared = shared
        self.glbls = glbls
        self.written: set[str] = set()

    def __missing__(self, key: str) -> Any:
        try:
            return self.shared[key]
        except KeyError:
            return self.glbls[key]

    def __setitem__(self, key: str, value: Any) -> None:
        dict.__setitem__(self, key, value)
        self.shared[key] = value
        self.written.add(key)

    def __delitem__(self, key: str) -> None:
        dict.__delitem__(self, key)
        self.written.discard(key)

    def writes(self) -> dict:
        return {key: dict.__getitem__(self, key) for key in self.written if key in self}

    def fork(self) -> BlockScope:
        """A fresh scope with the same names, for a block that is replayed (an edit)."""
        return BlockScope(dict(self), self.shared, self.glbls)


def snapshot(frame: FrameType) -> dict:
    """The frame's current local names (a copy: the block must not see later rebinds)."""
    return dict(frame.f_locals)


_shared = threading.local()


def shared_store(frame: FrameType) -> dict:
    """The names sibling blocks written in ``frame`` share (kept until `clear_shared`)."""
    store = getattr(_shared, "store", None)
    if store is None:
        store = _shared.store = {}
    entry = store.get(id(frame))
    if entry is None:
        # The frame is held too, so its id cannot be reused by another frame
        # while the store lives.
        entry = store[id(frame)] = (frame, {})
    return entry[1]


def clear_shared() -> None:
    store = getattr(_shared, "store", None)
    if store is not None:
        store.clear()


if sys.version_info < (3, 13):
    _locals_to_fast = ctypes.pythonapi.PyFrame_LocalsToFast
    _locals_to_fast.argtypes = (ctypes.py_object, ctypes.c_int)
    _locals_to_fast.restype = None
else:  # pragma: no cover - PEP 667 made f_locals write through
    _locals_to_fast = None


def push(frame: Any, variables: dict) -> None:
    """Bind ``variables`` in ``frame`` as if the block had run there.

    A lifted body's own frame has a `BlockScope` for locals (a nested block
    pushing into its parent); a module frame's locals are its globals; a function
    frame's locals are a snapshot that has to be flushed into its fast locals.
    """
    if not variables:
        return
    target = frame.f_locals
    if isinstance(target, BlockScope):
        dict.update(target, variables)
        target.written.update(variables)
        return
    target.update(variables)
    if _locals_to_fast is not None and isinstance(frame, FrameType) and target is not frame.f_globals:
        _locals_to_fast(frame, 0)
