"""Changed regions of tensors, and the record of what one replayed edit recomputed.

A *region* says which part of a tensor may have changed since the fork's previous values:
``None`` (nothing), :data:`WHOLE`, or ``Rows(axis, start)`` (only elements whose index along
``axis`` is ``>= start``), or a tuple of those for a multi-output op. The per-op rules that map
regions through ops live in :mod:`torchlens.edit._slicing`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..core.tree import Pending
from ._shared_pages import page_copy

__all__ = [
    "WHOLE", "Corner", "Plan", "Region", "ReplayLog", "RowPatch", "Rows", "Touched", "as_built", "changed_mask",
    "corner_restored", "diff_region", "edit_touches", "join_touched", "normal",
    "refine_corner", "region_lookup", "rows_from_zero", "union",
]


class Rows(NamedTuple):
    """Only elements whose index along ``axis`` (a non-negative dim) is ``>= start`` may have changed."""

    axis: int
    start: int


class Corner:
    """Over the last two axes (rows, columns): rows ``>= row`` and columns ``>= col`` may have
    changed — the attention scores ``q @ k.T`` when queries and keys changed from some position
    on. A causal mask then overwrites the upper-right block (rows ``< row``, columns ``>= col``),
    after which only the rows changed (:func:`refine_corner`)."""

    __slots__ = ("row", "col")

    def __init__(self, row: int, col: int) -> None:
        self.row, self.col = row, col

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Corner) and (self.row, self.col) == (other.row, other.col)

    def __hash__(self) -> int:
        return hash((Corner, self.row, self.col))

    def __repr__(self) -> str:
        return f"Corner(row={self.row}, col={self.col})"


def refine_corner(old: Any, new: Any, corner: Corner) -> Any:
    """``Rows(rows axis, corner.row)`` when ``new`` equals ``old`` bit for bit on the block the corner
    adds to those rows (rows ``< row``, columns ``>= col``: a causal mask wrote it), else the corner."""
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape \
            or old.dtype != new.dtype or old.dim() < 2:
        return corner
    return normal(Rows(old.dim() - 2, corner.row)) if corner_restored(old, new, corner) else corner


def corner_restored(old: torch.Tensor, new: torch.Tensor, corner: Corner) -> bool:
    """Whether ``new`` equals ``old`` bit for bit on the corner's extra block (see
    :func:`refine_corner`); ``new`` may hold several values of ``old``'s shape along leading dims."""
    a, b = old[..., : corner.row, corner.col:], new[..., : corner.row, corner.col:]
    same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
    return bool(same.all()) and bool((torch.signbit(a) == torch.signbit(b)).all() if a.is_floating_point() else True)


class RowPatch(Pending):
    """A recomputed value kept as its recorded tensor ``base`` with the rows ``start:`` along
    ``axis`` replaced by ``rows``, built (one copy) only when something reads it whole.

    Replay's row rules read the changed rows straight from ``rows`` (:meth:`narrow`), so a
    chain of row-wise ops downstream of an edit never copies the unchanged rows.
    """

    __slots__ = ("base", "axis", "start", "rows")

    def __init__(self, base: torch.Tensor, axis: int, start: int, rows: torch.Tensor) -> None:
        self.base, self.axis, self.start, self.rows = base, axis, start, rows

    def held(self) -> list[torch.Tensor]:
        return [self.base, self.rows]

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.base.device

    def dim(self) -> int:
        return self.base.dim()

    def narrow(self, axis: int, start: int, length: int) -> torch.Tensor:
        """``value.narrow(axis, start, length)`` without building the value when only new rows are asked for."""
        if axis == self.axis and start >= self.start:
            return self.rows.narrow(axis, start - self.start, length)
        return self.resolve().narrow(axis, start, length)

    def resolve(self) -> torch.Tensor:
        # a big base whose new rows are few: share its pages instead of copying them all
        new = None if self.rows.requires_grad or 2 * self.rows.numel() > self.base.numel() else page_copy(self.base)
        if new is None:
            new = self.base.clone()
        new.narrow(self.axis, self.start, new.shape[self.axis] - self.start).copy_(self.rows)
        return new


def as_built(value: Any) -> Any:
    """``value`` whole: built if it is a :class:`RowPatch`, else as it is."""
    return value.resolve() if isinstance(value, RowPatch) else value


class _Whole:
    """The whole tensor may have changed."""

    def __repr__(self) -> str:
        return "WHOLE"


WHOLE = _Whole()
Region = Any  # None | WHOLE | Rows, or a tuple of them for a multi-output op


class Plan(NamedTuple):
    """How replay recomputes one op: ``kind`` is ``"skip"`` (output unchanged), ``"full"``
    (re-run it whole; ``region`` is its output's changed region) or ``"rows"`` (``call()``
    returns only the rows ``region.start:`` along ``region.axis``). ``reason`` says why a
    rule could not bound the output (empty when its inputs were simply changed whole)."""

    kind: str
    region: Region
    call: Callable[[], Any] | None = None
    reason: str = ""


class ReplayLog:
    """What one replayed edit recomputed on a fork: per op, whole or which rows, and each
    fallback to whole-op replay with its reason.

    ``entries`` holds ``(label, func_name, how, rows, reason)``: ``how`` is ``"rows"`` (only
    ``rows`` = ``(axis, start, size)`` were recomputed; ``reason`` says when they were computed
    in one call with other forks' rows, ``Trace.forks``), ``"full"`` (its inputs changed whole)
    or ``"fallback"`` (a rule was missing or could not bound it; ``reason`` says which), or
    ``"read"`` (a final ``linear`` computed only on the row and columns a patching metric
    declared it reads; ``rows`` counts it as one row, ``reason`` says which).

    ``decisions`` holds ``(strategy, reason)``: each time a replay strategy declared it could not
    take this edit (or one op of it), so a slower one did (``torchlens.edit._engine``; the reason
    names the op). ``chosen`` counts, per strategy, the ops it recomputed for this edit (each op once,
    for the strategy that finished it).
    """

    __slots__ = ("chosen", "decisions", "entries", "sliced")

    def __init__(self, sliced: bool) -> None:
        self.sliced = sliced
        self.entries: list[tuple[str, str, str, tuple[int, int, int] | None, str]] = []
        self.decisions: list[tuple[str, str]] = []
        self.chosen: dict[str, int] = {}

    @property
    def fallbacks(self) -> list[tuple[str, str, str]]:
        """``(label, func_name, reason)`` of every op replayed whole because no rule could slice it."""
        return [(e[0], e[1], e[4]) for e in self.entries if e[2] == "fallback"]

    @property
    def n_sliced(self) -> int:
        """How many ops were recomputed on some of their rows only."""
        return sum(1 for e in self.entries if e[2] == "rows")

    @property
    def fraction(self) -> float:
        """The share of recomputed output elements, over the elements of every recomputed op (1.0: unsliced)."""
        done = total = 0
        for e in self.entries:
            if e[3] is None:
                continue
            _, start, size = e[3]
            done += size - start
            total += size
        whole = sum(1 for e in self.entries if e[3] is None)
        return (done + whole) / (total + whole) if total + whole else 0.0

    def __repr__(self) -> str:
        return (f"<ReplayLog {len(self.entries)} ops recomputed, {self.n_sliced} on changed rows only, "
                f"{len(self.fallbacks)} fallbacks, {len(self.decisions)} strategy decisions>")


# -- regions ---------------------------------------------------------------------------------


def union(a: Region, b: Region) -> Region:
    """The smallest region holding both (different axes: WHOLE)."""
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, Corner) or isinstance(b, Corner):
        return a if a == b else WHOLE
    if a is WHOLE or b is WHOLE or isinstance(a, tuple) and not isinstance(a, Rows) \
            or isinstance(b, tuple) and not isinstance(b, Rows):
        return WHOLE
    if a.axis != b.axis:
        return WHOLE
    return Rows(a.axis, min(a.start, b.start))


def normal(r: Region) -> Region:
    """``Rows(axis, 0)`` is the whole tensor (kept as rows while :func:`rows_from_zero` is on)."""
    return WHOLE if isinstance(r, Rows) and r.start <= 0 and not getattr(_FROM_ZERO, "on", False) else r


_FROM_ZERO = threading.local()


class _FromZero:
    """The context :func:`rows_from_zero` returns (a class: the sweep enters one per op it plans)."""

    __slots__ = ("on", "before")

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        self.before = getattr(_FROM_ZERO, "on", False)
        _FROM_ZERO.on = self.on

    def __exit__(self, *exc: object) -> None:
        _FROM_ZERO.on = self.before


def rows_from_zero(on: bool = True) -> _FromZero:
    """While on (in this thread), the rules keep ``Rows(axis, 0)`` as rows instead of the whole
    tensor: a sweep planning an op on forks' whole values, stacked along an axis the op keeps,
    learns from them which axis of the output holds each fork's block."""
    return _FromZero(on)


Touched = tuple[int, list[int]]
"""Where an edit may change a tensor: ``(axis, rows)``, every element off those rows of ``axis`` kept."""


def edit_touches(edit: Any, value: Any) -> Touched | None:
    """The rows ``edit`` declares it may change in ``value`` (``edit.touches(value)``), normalised
    (non-negative axis, sorted distinct rows); None when the edit declares nothing or ``value`` is no tensor."""
    declare = getattr(edit, "touches", None)
    if declare is None or not isinstance(value, torch.Tensor) or value.ndim == 0:
        return None
    found = declare(value)
    if found is None:
        return None
    axis, rows = found
    axis %= value.ndim
    size = value.shape[axis]
    return axis, sorted({int(r) % size for r in rows}) if size else []


def join_touched(a: Touched | None, b: Touched | None) -> Touched | None:
    """Rows either declaration may change (None, unknown, when either is unknown or their axes differ)."""
    if a is None or b is None or a[0] != b[0]:
        return None
    return a[0], sorted(set(a[1]) | set(b[1]))


def changed_mask(old: torch.Tensor, new: torch.Tensor, touched: Touched | None = None) -> torch.Tensor:
    """Where same-shaped ``new`` differs from ``old`` (NaN equal to NaN); with ``touched``, over the
    touched rows only (``index_select`` of them along their axis): elsewhere the edit kept every element."""
    if touched is not None:
        index = torch.tensor(touched[1], dtype=torch.long, device=old.device)
        old, new = old.index_select(touched[0], index), new.index_select(touched[0], index)
    changed = old != new
    if old.is_floating_point() or old.is_complex():
        changed &= ~(old.isnan() & new.isnan())
    return changed


def diff_region(old: Any, new: Any, touched: Touched | None = None) -> Region:
    """The region where ``new`` differs from ``old`` (the axis leaving the largest unchanged share).

    ``touched`` (from :func:`edit_touches`) limits the comparison to the rows the edits declared; the
    region found is the same as comparing everything, since off those rows nothing changed.
    """
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape \
            or old.dtype != new.dtype:
        return WHOLE
    if old is new:
        return None
    changed = changed_mask(old, new, touched)
    if not bool(changed.any()):
        return None
    best: Region = WHOLE
    best_share = 0.0
    for axis, size in enumerate(old.shape):
        if size <= 1:
            continue
        if touched is not None and axis == touched[0]:
            hit = changed.movedim(axis, 0).reshape(len(touched[1]), -1).any(1)
            start = touched[1][int(hit.nonzero()[0, 0])]
        else:
            rows = changed.movedim(axis, 0).reshape(size, -1).any(1)
            start = int(rows.nonzero()[0, 0])
        if start / size > best_share:
            best, best_share = Rows(axis, start), start / size
    return best


def _region_at(value: Any, index: int, elem: int | None, regions: dict[int, Region]) -> Region:
    r = regions.get(index, WHOLE)
    if elem is not None and isinstance(r, tuple) and not isinstance(r, Rows):
        return r[elem]
    return r


def region_lookup(values: list[Any], refs: list[Any], regions: dict[int, Region]) -> dict[int, Region]:
    """The regions :func:`plan_op` reads: of each rebuilt argument, by identity."""
    return {id(v): _region_at(v, r.index, r.elem, regions) for v, r in zip(values, refs)}
