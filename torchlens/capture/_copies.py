"""Copies of a module made while a capture is attached come out without the capture.

A capture puts callables on the model's modules: hooks in torch's hook tables and wrappers in
instance ``forward`` slots. ``copy.copy``, ``copy.deepcopy``, ``pickle`` and ``torch.save``
copy a module's ``__dict__`` with whatever it holds, and functions are copied by reference: a
copy made inside an edit or a hook (``copy.deepcopy(model)`` to try something on the side)
would call the original's forward through our wrapper, with the original's weights, and keep
doing so after the capture ends; a pickle would fail on our closures. While a capture holds a
module type, ``copyreg`` gives copy and pickle a reduction of that type's modules that leaves
out what captures put there: the state has the slot's earlier content (or no slot entry) and
hook tables without our entries. Types that copy or pickle themselves their own way
(``__reduce_ex__``, ``__reduce__``, ``__copy__``/``__deepcopy__``, a ``copyreg`` entry of their
own) are left alone: their copies keep our hooks, as they keep anybody's.
"""

from __future__ import annotations

import copyreg
import threading
from collections.abc import Iterable
from typing import Any

from torch import nn

__all__ = ["forget_hooks", "forget_slot", "hold_types", "note_hooks", "note_slot", "release_types"]

_LOCK = threading.Lock()
_PREVIOUS: dict[int, Any] = {}  # id(wrapper in a slot) -> what the slot held before it
_HOOKS: set[int] = set()  # ids of hook callables captures attached
_HELD: dict[type, int] = {}  # module type -> how many captures hold its copyreg entry
_NO_SLOT = object()  # what _PREVIOUS holds for a slot that held nothing (the class's forward)
_HOOK_TABLES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def note_slot(wrapper: Any, previous: Any, empty: Any) -> None:
    """``wrapper`` now stands in a forward slot that held ``previous`` (``empty``: nothing)."""
    _PREVIOUS[id(wrapper)] = _NO_SLOT if previous is empty else previous


def forget_slot(wrapper: Any) -> None:
    _PREVIOUS.pop(id(wrapper), None)


def note_hooks(*hooks: Any) -> None:
    """These callables are hooks a capture attached."""
    for h in hooks:
        _HOOKS.add(id(h))


def forget_hooks(*hooks: Any) -> None:
    for h in hooks:
        _HOOKS.discard(id(h))


def _copies_plainly(kind: type) -> bool:
    """Whether ``kind`` copies and pickles as ``nn.Module`` does (its ``__dict__`` as state)."""
    found = _PLAINLY.get(kind)
    if found is None:  # a failed hasattr costs an exception: once per type, not per capture
        found = _PLAINLY[kind] = (kind.__reduce_ex__ is object.__reduce_ex__ and kind.__reduce__ is object.__reduce__
                                  and not hasattr(kind, "__deepcopy__") and not hasattr(kind, "__copy__"))
    return found


_PLAINLY: dict[type, bool] = {}


def hold_types(modules: Iterable[nn.Module]) -> list[type]:
    """Give the types of ``modules`` the capture-free reduction while a capture runs; returns
    the types held, for :func:`release_types`."""
    kinds = set(map(type, modules))
    held = []
    with _LOCK:
        for kind in kinds:
            n = _HELD.get(kind)
            if n is None:
                if copyreg.dispatch_table.get(kind) is not None or not _copies_plainly(kind):
                    continue
                copyreg.dispatch_table[kind] = _reduce
                n = 0
            _HELD[kind] = n + 1
            held.append(kind)
    return held


def release_types(kinds: Iterable[type]) -> None:
    with _LOCK:
        for kind in kinds:
            n = _HELD.get(kind, 0) - 1
            if n > 0:
                _HELD[kind] = n
                continue
            _HELD.pop(kind, None)
            if copyreg.dispatch_table.get(kind) is _reduce:
                del copyreg.dispatch_table[kind]


def _reduce(module: nn.Module) -> Any:
    """``module``'s usual reduction, its state without what captures attached."""
    reduced = module.__reduce_ex__(4)
    state = reduced[2]
    if not isinstance(state, dict):
        return reduced
    state = dict(state)
    slot = state.get("forward")
    while slot is not None and id(slot) in _PREVIOUS:  # wrappers nest: back to the model's own
        slot = _PREVIOUS[id(slot)]
    if slot is _NO_SLOT:
        del state["forward"]
    elif "forward" in state:
        state["forward"] = slot
    ours = {k for name in ("_forward_pre_hooks", "_forward_hooks") for k, h in (state.get(name) or {}).items()
            if id(h) in _HOOKS}
    for name in _HOOK_TABLES if ours else ():  # hook ids come from one counter: pre and post never share one
        table = state.get(name)
        if table and any(k in ours for k in table):
            state[name] = type(table)((k, v) for k, v in table.items() if k not in ours)
    return (reduced[0], reduced[1], state, *reduced[3:])
