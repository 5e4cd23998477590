"""Small structural helpers for the values a forward hands around."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "apply",
    "first_input",
    "from_import_path",
    "map_tensors",
    "replace_first_input",
    "to_import_path",
]


def apply(data: Any, fn: Callable[[Any], Any], cls: type, n: int = 0) -> Any:
    """``data`` rebuilt with ``fn`` applied to every instance of ``cls`` inside it (``nnsight.util.apply``).

    Lists, tuples (namedtuples too), dicts (keeping their exact type, e.g. a
    ``defaultdict`` or a transformers ``ModelOutput``), sets and slices are walked
    without limit and rebuilt; the originals are untouched. Other objects with a
    ``__dict__`` are descended into *in place*, at most ``n`` objects deep (container
    nesting is free); anything else is a leaf and is returned as is.

    Args:
        data: the structure to walk.
        fn: called on each ``cls`` instance; its result replaces it.
        cls: the leaf type to transform.
        n: how many levels of plain objects to descend into (0: none).

    Returns:
        The transformed structure.
    """
    if isinstance(data, cls):
        return fn(data)
    if isinstance(data, list):
        return type(data)(apply(value, fn, cls, n) for value in data)
    if isinstance(data, tuple):
        items = [apply(value, fn, cls, n) for value in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, dict):
        new = data.copy()
        for key, value in data.items():
            new[key] = apply(value, fn, cls, n)
        return new
    if isinstance(data, (set, frozenset)):
        return type(data)(apply(value, fn, cls, n) for value in data)
    if isinstance(data, slice):
        return slice(apply(data.start, fn, cls, n), apply(data.stop, fn, cls, n), apply(data.step, fn, cls, n))
    if n > 0 and hasattr(data, "__dict__"):
        for key, value in vars(data).items():
            transformed = apply(value, fn, cls, n - 1)
            if transformed is not value:
                setattr(data, key, transformed)
    return data


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``data`` rebuilt with ``fn`` applied to every tensor inside its containers (see `apply`)."""
    return apply(data, fn, torch.Tensor)


def to_import_path(obj: type) -> str:
    """The dotted ``module.QualName`` path of a class or function (read back by `from_import_path`)."""
    return f"{obj.__module__}.{obj.__qualname__}"


def from_import_path(path: str) -> Any:
    """The object a dotted ``module.QualName`` path names (as `to_import_path` writes it).

    Raises:
        ImportError: the module part does not import.
        AttributeError: the qualified name is not in that module.
    """
    module_path, _, qualname = path.rpartition(".")
    obj: Any = importlib.import_module(module_path)
    for name in qualname.split("."):
        obj = getattr(obj, name)
    return obj


def first_input(args: tuple, kwargs: dict) -> Any:
    """The first positional argument, else the first keyword one (nnsight's ``.input``)."""
    if args:
        return args[0]
    return next(iter(kwargs.values()))


def replace_first_input(args: tuple, kwargs: dict, value: Any) -> tuple:
    """``(args, kwargs)`` with ``value`` in place of the first input (see `first_input`)."""
    if args:
        return ((value, *args[1:]), kwargs)
    key = next(iter(kwargs))
    return (args, {**kwargs, key: value})
