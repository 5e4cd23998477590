"""Which values leave a trace: ``.save()`` marks and the trace-nesting depth.

nnsight's contract is that a trace body runs somewhere else, and only values
marked with ``.save()`` (or ``nnsight.save(x)``) come back to the caller's frame
when the *outermost* trace ends; inner traces hand everything up to the block
around them. Marks are by object identity, kept per thread so concurrent traces
never see each other's marks.

``.save()`` works on any object in nnsight because nnsight writes a ``save``
method into ``object`` itself. The shim does the same (``mount``) so ported
code keeps working, and chains to a ``save`` it displaces — real nnsight's, when
both libraries are loaded in one process — so that each library's traces keep
their own marks.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
from typing import Any

from .errors import SaveOutsideTraceError

__all__ = ["depth", "ensure_mounted", "enter", "is_marked", "leave", "mark", "mount", "save"]

_local = threading.local()


def depth() -> int:
    """How many shim traces are executing on this thread right now."""
    return getattr(_local, "depth", 0)


def _marks() -> set[int]:
    marks = getattr(_local, "marks", None)
    if marks is None:
        marks = _local.marks = set()
    return marks


def enter() -> None:
    """Open one trace scope (around the moment a block's body really runs)."""
    _local.depth = depth() + 1


def leave() -> None:
    """Close one trace scope; the outermost one forgets every mark."""
    level = depth() - 1
    _local.depth = level
    if level <= 0:
        _local.depth = 0
        _marks().clear()


def mark(value: Any) -> Any:
    """Mark ``value`` (by identity) to leave the outermost trace; no depth check."""
    _marks().add(id(value))
    return value


def is_marked(value: Any) -> bool:
    return id(value) in _marks()


def _nnsight_active() -> bool:
    """Whether real nnsight is running one of its own traces on this thread."""
    module = sys.modules.get("nnsight.tracing.tracer")
    local = getattr(module, "_local", None)
    return bool(getattr(local, "depth", 0))


def save(value: Any, _: Any = None) -> Any:
    """Mark ``value`` to be handed back after the outermost trace, and return it.

    The idiom is to save what you bind (``h = block.output.save()``): the mark is
    on this very object, so ``(x.save() * 2)`` returns ``x`` and not the product.
    """
    if depth() == 0:
        displaced = _displaced_save
        if displaced is not None and _nnsight_active():
            return displaced(value)
        raise SaveOutsideTraceError(
            "save() was called outside a trace: `.save()` / nnsight.save(x) marks a value to "
            "return from the enclosing `with model.trace(...):` block, so it only works inside one"
        )
    return mark(value)


def _method_save(self: Any, _: Any = None) -> Any:
    return save(self)


_method_save.__name__ = "save"
_method_save.__qualname__ = "object.save"
_displaced_save: Any = None


def _object_dict() -> dict:
    # ``object.__dict__`` is a read-only mappingproxy over the real dict; the
    # garbage collector's referents hand back the dict itself.
    return gc.get_referents(object.__dict__)[0]


def mount() -> None:
    """Make ``x.save()`` available on every object (idempotent, cheap to re-check).

    Called at import and again at the start of every trace, because loading
    nnsight after the shim replaces the method; the replaced one is kept and used
    when nnsight itself is tracing.
    """
    global _displaced_save
    current = object.__dict__.get("save")
    if current is _method_save:
        return
    if current is not None:
        _displaced_save = current
    _object_dict()["save"] = _method_save
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(object))


def ensure_mounted() -> None:
    if object.__dict__.get("save") is not _method_save:
        mount()
