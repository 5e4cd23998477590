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

__all__ = ["Served", "eproperty", "first_input_repack", "first_input_view"]


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


class eproperty(Served):  # noqa: N801 - nnsight's name, imported by user code
    """A served value defined on an envoy subclass (``nnsight.intervention.eproperty.eproperty``).

    Decorate a stub with ``@eproperty`` or ``@eproperty(key="output")``: the stub is
    the *preprocess* (served value -> what the user reads). ``@prop.postprocess``
    maps an assigned value before it is swapped in; ``@prop.transform`` maps an
    edited view back to the model's layout, ``transform(self, view, raw)``. The
    write-back is swapped in when the block next asks the model for anything or
    ends, and until then a second read of the same value returns the same view, so
    ``x.heads[:, 5] += f(x.heads)`` edits one tensor.

    Args:
        key: the location suffix (``"{path}.{key}"``); defaults to the stub's name.
        description: a short label shown in reprs.
    """

    def __init__(self, key: Any = None, description: str | None = None) -> None:
        super().__init__(None if callable(key) else key)
        self.description = description
        self.write_back: Callable[[Any, Any, Any], Any] | None = None
        if callable(key):
            self(key)

    def __call__(self, preprocess: Callable[[Any, Any], Any]) -> eproperty:
        self.name = preprocess.__name__
        self.view = preprocess
        self.__doc__ = preprocess.__doc__
        if self.key is None:
            self.key = self.name
        return self

    def postprocess(self, func: Callable[[Any, Any], Any]) -> eproperty:
        """Register ``func(self, value)``, applied to an assigned value before it is swapped in."""
        self.repack = func
        return self

    def transform(self, func: Callable[[Any, Any, Any], Any]) -> eproperty:
        """Register ``func(self, view, raw)``, mapping an edited view back into the model's value."""
        self.write_back = func
        return self

    def __str__(self) -> str:
        hint = getattr(self.view, "__annotations__", {}).get("return")
        if hint is not None and not isinstance(hint, str):
            hint = getattr(hint, "__name__", repr(hint))
        typed = f" -> {hint}" if hint and hint != "Any" else ""
        return f"({self.name}){typed}: {self.description}"

    def __get__(self, host: Any, owner: Any = None) -> Any:
        if host is None:
            return self
        if self.write_back is None:
            return super().__get__(host, owner)
        location = self.location(host)
        held = _worker.held_view(self, location)
        if held is not None:
            return held[0]
        raw = _worker.read(location)
        view = raw if self.view is None else self.view(host, raw)
        _worker.hold_view(self, location, view, lambda: self.write_back(host, view, raw))
        return view


def first_input_view(host: Any, value: Any) -> Any:
    """``view`` of an ``.input`` attribute: the first argument of the served ``(args, kwargs)``."""
    args, kwargs = value
    return first_input(args, kwargs)


def first_input_repack(host: Any, value: Any) -> Any:
    """``repack`` of an ``.input`` attribute: the host's current inputs with ``value`` first."""
    args, kwargs = _worker.read(f"{host.path}.input")
    return replace_first_input(args, kwargs, value)
