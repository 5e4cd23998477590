"""Attributes whose value the model serves mid-run (``.output``, ``.input``, ``tracer.result``).

Reading one parks the running block until the forward reaches
``"{host.path}.{key}"`` and returns the value there; assigning one swaps the
block's value in at that visit. ``view`` maps the served value to what the user
reads (``.input`` is the first argument of the ``(args, kwargs)`` pair) and
``repack`` maps a written value back (a new first argument inside the pair).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _worker
from .util import first_input, replace_first_input

__all__ = ["Served", "first_input_repack", "first_input_view"]


class Served:
    """A data descriptor over one served location of its host."""

    def __init__(
        self,
        key: str,
        view: Callable[[Any, Any], Any] | None = None,
        repack: Callable[[Any, Any], Any] | None = None,
        doc: str | None = None,
    ) -> None:
        self.key = key
        self.view = view
        self.repack = repack
        self.name = key
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def location(self, host: Any) -> str:
        path = getattr(host, "path", "")
        return f"{path}.{self.key}" if path else self.key

    def __get__(self, host: Any, owner: Any = None) -> Any:
        if host is None:
            return self
        raw = _worker.read(self.location(host))
        return raw if self.view is None else self.view(host, raw)

    def __set__(self, host: Any, value: Any) -> None:
        if self.repack is not None:
            value = self.repack(host, value)
        _worker.write(self.location(host), value)


def first_input_view(host: Any, value: Any) -> Any:
    """``view`` of an ``.input`` attribute: the first argument of the served ``(args, kwargs)``."""
    args, kwargs = value
    return first_input(args, kwargs)


def first_input_repack(host: Any, value: Any) -> Any:
    """``repack`` of an ``.input`` attribute: the host's current inputs with ``value`` first."""
    args, kwargs = _worker.read(f"{host.path}.input")
    return replace_first_input(args, kwargs, value)
