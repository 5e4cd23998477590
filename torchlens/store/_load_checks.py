"""The checks every loader of a save shares: strict JSON, bounded integers, and the one error.

A save directory may come from a stranger, so everything read from it is checked field by
field; a failed check raises :class:`~torchlens.errors.RecipeFormatError` (or a subclass)
built by :func:`fail`. :func:`guarded` is the backstop around a whole loader: anything
that slips past the named checks still surfaces as a RecipeFormatError.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import FormatVersionError, RecipeFormatError

__all__ = ["MAX_DEPTH", "MAX_DIM", "check_int", "fail", "guarded", "loading", "loads_json"]

MAX_DEPTH = 64  # nesting of stored values and selectors
MAX_DIM = 1 << 48  # largest dimension a stored shape may declare


def fail(message: str, cls: type[RecipeFormatError] = RecipeFormatError, **fields: Any) -> RecipeFormatError:
    """The error for a malformed save (``raise fail(...)``); ``cls`` picks a subclass."""
    return cls(message, **fields)


def check_int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    """``value`` if it is a plain int (not a bool) in ``[lo, hi]``, else a RecipeFormatError about ``what``."""
    if type(value) is not int or not lo <= value <= hi:
        raise fail(f"{what} must be an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def loads_json(raw: bytes | memoryview, what: str) -> Any:
    """Strict JSON: UTF-8, no NaN/Infinity literals, no duplicate keys; errors say which file."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise ValueError(f"duplicate key {k!r:.80}")
            out[k] = v
        return out

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=pairs, parse_constant=constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise fail(f"{what} is not valid JSON: {str(exc)[:200]}") from None


def guarded(build: Callable[..., Any], *args: Any) -> Any:
    """Run a loader; a slip past the field checks still surfaces as a RecipeFormatError.

    The error then carries ``unexpected`` (the original exception type), which the fuzz
    tests treat as a bug: every malformed input should be caught by a named check.
    """
    try:
        return build(*args)
    except RecursionError:
        raise fail("the save is nested too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as exc:
        if isinstance(exc, RecipeFormatError):
            raise
        raise fail(f"the save is malformed: {type(exc).__name__}: {str(exc)[:200]}",
                   unexpected=type(exc).__name__) from exc


# What to do about a save that does not load, said of the kind of save at hand (the class remedies
# speak of both kinds).
_SAVE_AGAIN = {
    ("trace", RecipeFormatError): "Save the trace again with trace.save(path) from this TorchLens version; never "
                                  "hand-edit its manifest.",
    ("trace", FormatVersionError): "Upgrade TorchLens to the version named, or save the trace again with this "
                                   "one (trace.save(path)).",
    ("recipe", RecipeFormatError): "Save the recipe again with fork.save_intervention(path) from this TorchLens "
                                   "version; never hand-edit its manifest.",
    ("recipe", FormatVersionError): "Upgrade TorchLens to the version named, or save the recipe again with this "
                                    "one (fork.save_intervention(path)).",
}


@contextmanager
def loading(kind: str) -> Iterator[None]:
    """Around the load of a ``kind`` save (``"trace"`` or ``"recipe"``): a format error that gives its
    class's remedy is raised again with the remedy for that kind (save *the trace* again ...)."""
    try:
        yield
    except RecipeFormatError as exc:
        cls = type(exc)
        remedy = _SAVE_AGAIN.get((kind, cls))
        if remedy is None or exc.remedy != cls.remedy:
            raise
        raise cls(exc.message, remedy=remedy, **exc.fields) from exc.__cause__
