"""Site selectors as JSON, for recipes and saved traces: ``{"module": path}``, ``{"and": [a, b]}`` ...

Only the built-in selector kinds have a saved form, so a loaded site is always one of
them; anything else in a file is a RecipeFormatError, never an import.
"""

from __future__ import annotations

from typing import Any

from ..core.selectors import And, Func, InModule, Label, ModuleOutput, Or, Selector
from ..errors import NotPortableError
from ._load_checks import MAX_DEPTH, fail

__all__ = ["selector_from_dict", "selector_to_dict"]

_LEAF_SELECTORS: dict[str, type] = {"module": ModuleOutput, "in_module": InModule, "func": Func, "label": Label}


def selector_to_dict(sel: Selector) -> dict[str, Any]:
    """The JSON form of a selector: ``{"module": path}``, ``{"and": [a, b]}`` ...

    Raises:
        NotPortableError: a selector class with no saved form (e.g. a plugin's own).
    """
    t = type(sel)
    if t is ModuleOutput or t is InModule:
        return {"module" if t is ModuleOutput else "in_module": sel.path}
    if t is Func:
        return {"func": sel.name}
    if t is Label:
        return {"label": sel.label}
    if t is And or t is Or:
        return {"and" if t is And else "or": [selector_to_dict(sel.a), selector_to_dict(sel.b)]}
    raise NotPortableError(f"selector {sel.describe()} ({t.__name__}) has no saved form",
                           remedy="Use tl.module / tl.in_module / tl.func / labels, combined with & and |.")


def selector_from_dict(d: Any, depth: int = 0) -> Selector:
    """Rebuild a selector from its JSON form; anything else raises RecipeFormatError."""
    if depth > MAX_DEPTH:
        raise fail("a site selector is nested too deeply")
    if not isinstance(d, dict) or len(d) != 1:
        raise fail(f"a site must be an object with one key, got {str(d)[:80]}")
    (kind, arg), = d.items()
    if kind in _LEAF_SELECTORS:
        if not isinstance(arg, str) or len(arg) > 1000:
            raise fail(f"site {kind!r} takes a string of at most 1000 characters")
        return _LEAF_SELECTORS[kind](arg)
    if kind in ("and", "or"):
        if not isinstance(arg, list) or len(arg) != 2:
            raise fail(f"site {kind!r} takes a list of two sites")
        a, b = (selector_from_dict(x, depth + 1) for x in arg)
        return And(a, b) if kind == "and" else Or(a, b)
    raise fail(f"unknown site kind {kind!r:.40}; known: {sorted([*_LEAF_SELECTORS, 'and', 'or'])}")
