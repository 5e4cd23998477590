"""What a sweep (:mod:`torchlens.edit._sweep`) holds: the stacked rows of an op for several
forks (:class:`Stack`), a fork's value cut from them when read (:class:`BlockPatch`,
:class:`Outputs`), and eager attention's scores for every fork at once (:func:`forks_batch`,
:func:`refine_forks`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.tree import Pending
from ._regions import WHOLE, Corner, RowPatch, Rows, as_built, corner_restored, normal

__all__ = ["WHOLE_ROWS", "BlockPatch", "Outputs", "Stack", "forks_batch", "refine_forks"]

# A value recomputed whole, kept in the stack as all its rows along axis 0 (one block per fork).
WHOLE_ROWS = Rows(0, 0)


class Stack:
    """The changed rows ``start:`` along ``axis`` of op values, one block per fork of ``forks`` (in order)."""

    __slots__ = ("base", "axis", "start", "rows", "forks", "corner", "region", "block")

    def __init__(self, base: torch.Tensor, axis: int, start: int, rows: torch.Tensor, forks: tuple[int, ...],
                 corner: Corner | None = None, region: Rows | None = None) -> None:
        self.base, self.axis, self.start, self.rows, self.forks = base, axis, start, rows, forks
        # eager attention's scores: each fork's whole value (all rows along axis 0), changed in this corner
        self.corner = corner
        self.region = Rows(axis, start) if region is None else region  # (``Rows(axis, start)``, made once)
        self.block = base.shape[axis] - start  # each fork's rows along ``axis``

    def rows_of(self, fork: int) -> torch.Tensor:
        """Fork ``fork``'s rows (the recorded ones if it has not changed this value)."""
        m = self.block
        if fork in self.forks:
            return self.rows.narrow(self.axis, self.forks.index(fork) * m, m)
        return self.base.narrow(self.axis, self.start, m)

    def aligned(self, forks: tuple[int, ...]) -> torch.Tensor:
        """The rows of ``forks`` (a superset of this stack's), one block each, in order."""
        if forks == self.forks:
            return self.rows
        return torch.cat([self.rows_of(f) for f in forks], self.axis)


class BlockPatch(RowPatch):
    """A fork's :class:`RowPatch` of a stacked op: its rows are the block at ``offset`` of the
    stack's rows, cut when read (most recomputed values of a sweep are never read by anyone)."""

    __slots__ = ("stacked", "offset")

    def __init__(self, base: torch.Tensor, axis: int, start: int, stacked: torch.Tensor, offset: int) -> None:
        self.base, self.axis, self.start, self.stacked, self.offset = base, axis, start, stacked, offset

    @property
    def rows(self) -> torch.Tensor:  # (the slot RowPatch declares stays empty)
        return self.stacked.narrow(self.axis, self.offset, self.base.shape[self.axis] - self.start)


class Outputs(Pending):
    """Several outputs of one op on one fork, each the recorded tensor or a :class:`RowPatch`, built when read."""

    __slots__ = ("values",)

    def __init__(self, values: tuple) -> None:
        self.values = values

    def resolve(self) -> tuple:
        return tuple(as_built(v) for v in self.values)

    def held(self) -> list[Any]:
        return [t for v in self.values for t in (v.held() if isinstance(v, RowPatch) else [v])]


def forks_batch(t: torch.Tensor, axis: int, start: int, rows: torch.Tensor, n: int) -> torch.Tensor:
    """The whole value of each of ``n`` forks, one batch entry each along axis 0: the recorded
    tensor ``t`` with its rows ``start:`` along ``axis`` replaced by that fork's block of ``rows``
    (``t``'s shape with ``n`` blocks along ``axis``)."""
    m = t.shape[axis] - start
    changed = rows.unflatten(axis, (n, m)).movedim(axis, 0)
    kept = t.narrow(axis, 0, start)
    kept = kept.unsqueeze(0).expand(n, *kept.shape)
    return torch.cat([kept, changed], axis + 1).reshape(n * t.shape[0], *t.shape[1:])


def refine_forks(base: torch.Tensor, out: torch.Tensor, corner: Corner, n: int) -> tuple[Any, torch.Tensor] | None:
    """Eager attention's scores of ``n`` forks, one batch entry each (``out``), whose change lies
    in ``corner``: where a causal mask restored every fork's corner block (as replay alone
    decides, ``refine_corner``), each fork's changed rows stacked along their axis; else the
    corner (or ``WHOLE_ROWS``) with the whole values as they are. None: not scores of ``base``."""
    b = base.shape[0]
    if out.dtype != base.dtype or base.dim() < 2 or out.shape != (n * b, *base.shape[1:]):
        return None
    region = normal(Rows(base.dim() - 2, corner.row)) if corner_restored(base, out.unflatten(0, (n, b)), corner) \
        else corner
    if region is WHOLE:
        return WHOLE_ROWS, out
    if isinstance(region, Corner):
        return region, out
    a, m = region.axis, base.shape[region.axis] - region.start
    rows = out.unflatten(0, (n, b)).narrow(a + 1, region.start, m).movedim(0, a).flatten(a, a + 1)
    return region, rows
