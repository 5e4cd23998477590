"""Patch sources: what a ``patch_from`` / ``mean_ablate`` source trace provided, saved instead of the trace.

Saving records the values the helper reads from its source trace (by running it once per
edited site against a recording wrapper); loading answers the same lookups from those
stored values only (:class:`StoredSource`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.records import ModuleCall
from ..core.selectors import Selector
from ..core.tree import clone_value, tensor_leaves
from ..edit.edits import EditContext
from ..edit.helpers import Helper
from ..errors import NotPortableError, SiteNotFoundError, TorchLensError

__all__ = ["StoredSource", "is_source", "record_source", "selector_key"]


def selector_key(sel: Any) -> str:
    return "selector:" + (sel.describe() if isinstance(sel, Selector) else repr(sel))


class _Found:
    def __init__(self, value: Any) -> None:
        self.out = value

    def first(self) -> _Found:
        return self


class StoredSource:
    """What a ``patch_from`` / ``mean_ablate`` source trace provided, saved instead of the trace.

    Answers the lookups the helper makes (``source[key].out``, ``find_sites(sel).first().out``,
    how many passes a module ran) from the stored values only.
    """

    def __init__(self, values: dict[str, Any], passes: dict[str, int]) -> None:
        self.values = values
        self.passes = passes

    def __getitem__(self, key: str) -> _Found:
        if key not in self.values:
            raise SiteNotFoundError(
                f"the saved patch source holds no value for {key!r}; it holds {sorted(self.values)[:8]}",
                site=key,
                remedy="Save it again (fork.save_intervention(path) for a recipe, trace.save(path) for a trace) "
                       "from a fork where this edit reached that site: a save keeps only the source values it read.",
            )
        return _Found(self.values[key])

    def find_sites(self, selector: Any, max_fanout: int | None = None) -> _Found:
        return self[selector_key(selector)]

    def calls_of(self, address: str) -> list[None]:
        """One placeholder per pass the source ran the module (what helpers count)."""
        return [None] * self.passes.get(address, 0)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StoredSource) or other.passes != self.passes or other.values.keys() != \
                self.values.keys():
            return False
        for k, v in self.values.items():
            a, b = tensor_leaves(v), tensor_leaves(other.values[k])
            if len(a) != len(b) or not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b)):
                return False
        return True

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<saved patch source: {len(self.values)} value(s)>"


class _SourceRecorder:
    """Wraps a source trace and remembers every value a helper reads from it."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.values: dict[str, Any] = {}
        self.passes: dict[str, int] = {}

    def __getitem__(self, key: str) -> Any:
        site = self.source[key]
        self.values[key] = site.out
        return site

    def find_sites(self, selector: Any, max_fanout: int | None = None) -> Any:
        found = self.source.find_sites(selector)
        self.values[selector_key(selector)] = found.first().out
        return found

    def calls_of(self, address: str) -> list[Any]:
        calls = self.source.calls_of(address)
        self.passes[address] = len(calls)
        return calls


def _contexts(record: Any, site: str) -> list[EditContext]:
    """The contexts a step's edit can see at ``record`` (replay and capture label modules differently)."""
    if isinstance(record, ModuleCall):
        labels = dict.fromkeys([record.label, record.address])
        return [EditContext(site, label, record.address, record.pass_index, record, None) for label in labels]
    return [EditContext(site, record.label, record.module, record.module_pass, record, None)]


def record_source(helper: Helper, param: str, records: list[tuple[Any, Any]], site: str) -> StoredSource:
    """Run ``helper`` once per matched site with its trace parameter wrapped, keeping what it read."""
    if not records:
        raise NotPortableError(
            f"{helper!r} at {site}: no edited site's value could be read in this trace, so what the source "
            "provides there cannot be recorded",
            remedy="Save from a trace that keeps the edited sites' values (captured without save=).",
        )
    rec = _SourceRecorder(helper.params()[param])
    probe = type(helper)(**{**helper.params(), param: rec})
    for record, value in records:
        first_error = None
        ok = False
        for ctx in _contexts(record, site):
            try:
                probe(clone_value(value), ctx=ctx)
                ok = True
            except (TorchLensError, LookupError, AttributeError, TypeError, RuntimeError) as exc:
                first_error = first_error or exc
        if not ok and first_error is not None:
            raise NotPortableError(
                f"{helper!r} could not read its source at {getattr(record, 'label', record)}: {first_error}",
                remedy="Check the edit works on the fork first; its source must have the site.",
            ) from first_error
    return StoredSource(rec.values, rec.passes)


def is_source(value: Any) -> bool:
    return isinstance(value, StoredSource) or (hasattr(value, "find_sites") and hasattr(value, "calls_of"))
