"""Bound views of records: what ``trace[key]`` and ``find_sites`` hand out.

A view pairs a record (shared by a trace and all its forks) with the trace it was read
from, so ``fork[label].out`` shows the fork's values without copying any record.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .records import ModuleCall, Op

__all__ = ["ModuleSites", "Site", "Sites"]

if TYPE_CHECKING:
    from .trace import Trace


class Site:
    """One op or one module call, as seen from one trace or fork."""

    __slots__ = ("trace", "record")

    if TYPE_CHECKING:
        # Provided by analysis.facets on import (core.actions.provide_methods), declared for type
        # checkers only; tests/test_architecture.py checks it matches the owner's.
        @property
        def facets(self) -> Any: ...

    def __init__(self, trace: Trace, record: Op | ModuleCall) -> None:
        self.trace = trace
        self.record = record

    @property
    def kind(self) -> str:
        return "module" if isinstance(self.record, ModuleCall) else "op"

    @property
    def label(self) -> str:
        return self.record.label

    @property
    def out(self) -> Any:
        """The value at this site in this trace (edited values on a fork)."""
        return self.trace.read(self.record)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.record, name)

    def __repr__(self) -> str:
        return f"<Site {self.kind} {self.label}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Site) and other.record is self.record and other.trace is self.trace

    def __hash__(self) -> int:
        return hash((id(self.trace), id(self.record)))


class ModuleSites(list):
    """``trace.modules``: every module call in call order, indexed by position or by address.

    ``trace.modules[0]`` is the first call; ``trace.modules["transformer.h.0"]`` (or
    ``"block:2"``, or a canonical name) is that module's call, as ``trace[...]`` finds it.
    """

    def __init__(self, trace: Trace, sites: list[Site]) -> None:
        super().__init__(sites)
        self._trace = trace

    def __getitem__(self, key: int | slice | str) -> Any:
        """The site at a position (or slice), or the module call an address names.

        Raises:
            SiteNotFoundError: no module that ran has that address (the nearest are listed).
            AmbiguousSiteError: a module that ran several times, named without a pass.
        """
        if isinstance(key, str):
            return Site(self._trace, self._trace.module_call(key))
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            return any(site.record.address == key or site.record.key == key for site in self)
        return super().__contains__(key)

    @property
    def addresses(self) -> list[str]:
        """The address of each call, in order (repeated for a module that ran several times)."""
        return [site.record.address for site in self]


class Sites:
    """The ordered result of ``trace.find_sites``: iterate it, index it, or take ``.first()``."""

    def __init__(self, sites: list[Site], selector: Any = None) -> None:
        self._sites = sites
        self.selector = selector

    def __len__(self) -> int:
        return len(self._sites)

    def __iter__(self) -> Iterator[Site]:
        return iter(self._sites)

    def __getitem__(self, i: int) -> Site:
        return self._sites[i]

    def first(self) -> Site:
        return self._sites[0]

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self._sites]

    def __repr__(self) -> str:
        shown = ", ".join(self.labels[:8]) + (" ..." if len(self) > 8 else "")
        return f"<Sites {len(self)}: {shown}>"
