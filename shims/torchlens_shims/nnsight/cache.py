"""``tracer.cache()``: keep many modules' values from one run without naming each read.

A cache subscribes to ``{path}.output`` (and optionally ``{path}.input``) of the
modules it was given and records what the run serves there *after* the blocks
have had it (post-intervention), detached and moved to a device by default. One
entry per visit, so a module run once per generation step has one per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._node import ModuleNode
from .util import map_tensors

if TYPE_CHECKING:
    from .envoy import Envoy

__all__ = ["CPU", "Cache", "CacheView", "Entry"]

CPU = torch.device("cpu")


@dataclass
class Entry:
    """One visit of one module."""

    output: Any = None
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    @property
    def input(self) -> Any:
        if self.inputs is None:
            return None
        args, kwargs = self.inputs
        values = list(args) + list(kwargs.values())
        return values[0] if values else None


class Cache:
    """The recorded entries of one ``tracer.cache()`` call, keyed by module path."""

    def __init__(
        self,
        model: Envoy,
        modules: list[Any] | None = None,
        device: Any = CPU,
        dtype: Any = None,
        detach: bool = True,
        include_output: bool = True,
        include_inputs: bool = False,
        non_blocking: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.detach = detach
        self.non_blocking = non_blocking
        self.include_output = include_output
        self.include_inputs = include_inputs
        self.targets = None if modules is None else [m if isinstance(m, str) else m.path for m in modules]
        self.entries: dict[str, list[Entry]] = {}
        self._filled: dict[str, set[str]] = {}

    def subscriptions(self) -> dict[str, tuple[str, str]]:
        targets = self.targets if self.targets is not None else [e.path for e in self.model.modules()]
        routes: dict[str, tuple[str, str]] = {}
        for path in targets:
            if self.include_output:
                routes[f"{path}.output"] = (path, "output")
            if self.include_inputs:
                routes[f"{path}.input"] = (path, "inputs")
        return routes

    def _convert(self, value: Any) -> Any:
        if self.detach:
            value = map_tensors(value, lambda t: t.detach())
        if self.device is not None or self.dtype is not None:
            value = map_tensors(
                value, lambda t: t.to(device=self.device, dtype=self.dtype, non_blocking=self.non_blocking)
            )
        return value

    def record(self, selected: tuple[str, str], value: Any) -> None:
        path, slot = selected
        value = self._convert(value)
        entries = self.entries.setdefault(path, [])
        filled = self._filled.setdefault(path, set())
        # A module's input arrives before its output: both land in one entry per visit.
        if entries and slot not in filled:
            setattr(entries[-1], slot, value)
        else:
            entries.append(Entry(**{slot: value}))
            filled.clear()
        filled.add(slot)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "model": None, "_filled": {}}


class CacheView:
    """What ``tracer.cache()`` returns: entries by full path or by navigating the model tree."""

    def __init__(self, cache: Cache, envoy: Envoy | None, path: str | None = None) -> None:
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_envoy", envoy)
        object.__setattr__(self, "_path", path)

    def _node_path(self) -> str | None:
        if self._path is not None:
            return self._path
        return self._envoy.path if self._envoy is not None else None

    def _entries(self) -> list[Entry]:
        path = self._node_path()
        if path is None:
            raise KeyError("the cache root is not a module")
        if path not in self._cache.entries:
            raise KeyError(f"{path!r} was not cached")
        return self._cache.entries[path]

    def _values(self, slot: str) -> Any:
        values = [getattr(entry, slot) for entry in self._entries()]
        return values[0] if len(values) == 1 else values

    @property
    def output(self) -> Any:
        return self._values("output")

    @property
    def inputs(self) -> Any:
        return self._values("inputs")

    @property
    def input(self) -> Any:
        return self._values("input")

    def keys(self) -> list[str]:
        prefix = self._node_path()
        if prefix is None:
            return list(self._cache.entries)
        return [key for key in self._cache.entries if key == prefix or key.startswith(prefix + ".")]

    def __getattr__(self, name: str) -> CacheView:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._navigate(self._child(name))

    def __getitem__(self, key: str | int) -> CacheView:
        if isinstance(key, int):
            return self._navigate(self._envoy[key])
        if "." in key:
            if key in self._cache.entries:
                return CacheView(self._cache, None, path=key)
            view = CacheView(self._cache, None)
            for part in key.split("."):
                view = CacheView(self._cache, view._child(part))
            return view
        return self._navigate(self._child(key))

    def __contains__(self, key: str) -> bool:
        try:
            node = self[key]
        except (AttributeError, IndexError, KeyError):
            return False
        path = node._node_path()
        return path is not None and path in self._cache.entries

    def __len__(self) -> int:
        return len(self._entries())

    def __repr__(self) -> str:
        path = self._node_path()
        where = "root" if path is None else repr(path)
        return f"CacheView({where}, cached={self.keys()})"

    def _child(self, name: str) -> Any:
        if self._envoy is None:
            model = self._cache.model
            if model is None:
                raise KeyError(name)
            if name == model.path:
                return model
            return getattr(model, name)
        if name.lstrip("-").isdigit():
            return self._envoy[int(name)]
        return getattr(self._envoy, name)

    def _navigate(self, node: Any) -> CacheView:
        if not isinstance(node, ModuleNode):
            raise AttributeError(f"{node!r} is not a module")
        return CacheView(self._cache, node)
