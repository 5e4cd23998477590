"""Small structural helpers for the values a forward hands around."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["first_input", "map_tensors", "replace_first_input"]


def map_tensors(data: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``data`` rebuilt with ``fn`` applied to every tensor inside its containers.

    Lists, tuples (namedtuples too), dicts (keeping their exact type, e.g. a
    transformers ``ModelOutput``), sets and slices are walked; any other object is
    a leaf and is returned as is.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, list):
        return type(data)(map_tensors(value, fn) for value in data)
    if isinstance(data, tuple):
        items = [map_tensors(value, fn) for value in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if isinstance(data, dict):
        new = data.copy()
        for key, value in data.items():
            new[key] = map_tensors(value, fn)
        return new
    if isinstance(data, (set, frozenset)):
        return type(data)(map_tensors(value, fn) for value in data)
    if isinstance(data, slice):
        return slice(map_tensors(data.start, fn), map_tensors(data.stop, fn), map_tensors(data.step, fn))
    return data


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
