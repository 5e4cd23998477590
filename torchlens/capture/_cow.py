"""Copy on write for in-place ops: recorded values stay as the forward produced them.

The recorder keeps outputs without copying them. Before an in-place op overwrites memory
that recorded tensors use, the records on that storage are copied (``before_inplace``); a
storage index, built at the first in-place op, finds them.

A write that changes memory other recorded tensors view (a buffer filled through slices of it,
a write into a view followed by a read of its base) is noted per record it reaches
(``alias_writes``, see ``torchlens.core.writes``): replay applies the writes again, in order, to
rebuild what later readers saw. A record copied that way keeps a ghost entry (its place in the
memory, which stays alive while the capture runs) so later writes to the same memory are noted too.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.records import Deferred, Op
from ..core.writes import AliasWrite, geometry

__all__ = ["CopyOnWrite"]

Tensor = torch.Tensor

# In-place ops that change which memory a tensor describes, not the data in it: only the
# records holding that very tensor object change.
_RESHAPES_IN_PLACE = frozenset(
    {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_", "swapaxes_", "detach_", "set_"}
)
# In-place ops that may move the whole storage elsewhere: every record on it changes address.
_REALLOCATES = frozenset({"resize_", "resize_as_"})


class CopyOnWrite:
    """The recorder's copy-on-write part (a mixin). It reads ``build`` (the trace's builder), ``ops``, ``transient`` and
    writes ``storage`` (storage key -> indices of the ops whose outputs use it), ``stale``,
    ``alias_writes`` (op index -> the writes through other views into its memory) and ``ghosts``
    (storage key -> records copied before such a write: index, element, geometry, span, dtype,
    memory); the
    class it is mixed into defines ``_update_lean`` (ops stop taking the inlined record once
    there is a storage index to keep) and ``flush`` (makes records of the ops noted so far)."""

    build: Any
    ops: list[Op]
    transient: bool
    storage: dict[int, list[int]] | None
    stale: dict[int, int]
    alias_writes: dict[int, list[AliasWrite]]
    ghosts: dict[int, list[tuple[int, int | None, Any, tuple[int, int], Any, Any]]]

    def _storage_key(self, t: Tensor) -> int | None:
        try:
            # Views share their base's storage, whatever their offset. A tensor with no memory
            # yet (torch.empty(0), later filled through out=) is keyed by the object itself.
            return t.untyped_storage().data_ptr() or -id(t)
        except (RuntimeError, NotImplementedError):
            return None

    def _live_out(self, op: Op) -> Any:
        """The tensors op ``op`` produced, as the model still holds them (a bounded or disk-backed
        capture keeps only weak references, or its own copy on disk)."""
        out = op._out
        if self.transient and (out is None or isinstance(out, Deferred)):
            return self.build.live_value(op.index)
        return out

    def _index_storage(self, op: Op) -> None:
        out = self._live_out(op)
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        for t in leaves:
            if isinstance(t, Tensor):
                key = self._storage_key(t)
                if key:
                    self.storage.setdefault(key, []).append(op.index)

    def _before_inplace(self, target: Tensor, name: str, out_arg: bool = False, elem: int | None = None) -> bool:
        """Snapshot every recorded tensor the in-place op ``name`` on ``target`` is about to change.

        Works leaf by leaf: one element of a tuple output (``topk``, ``split``...) is copied
        when it is the target or overlaps the memory the op writes; the other elements keep
        sharing memory with the model and stay indexed.

        Args:
            target: the tensor the op mutates (``args[0]`` or an ``out=`` tensor).
            name: the op's name, which says whether it writes data or only moves metadata.
            out_arg: ``target`` is an ``out=`` argument, which the op may resize (and so move).
            elem: which of the op's targets ``target`` is, when it writes several (``_foreach_*_``,
                ``out=(values, indices)``): the element of its output that holds the write.

        Returns:
            True when the overwritten memory is viewed by other recorded tensors, whose
            later readers would see data the recorded graph does not describe.
        """
        self.flush()  # ops noted but not yet records are indexed and copied like the others
        if self.storage is None:
            self.storage = {}
            self._update_lean()
            for op in self.ops:
                self._index_storage(op)
        key = self._storage_key(target)
        bucket = self.storage.pop(key, None) if key else None
        ghosts = self.ghosts.get(key) if key and self.ghosts else None
        if not bucket and not ghosts:
            return False
        # ``span``: the memory the op writes (None: no data written, only ``target`` changes
        # shape or storage). ``moves``: the op may give the storage new memory, which changes
        # where every tensor on it points: all of them are copied (their values stay).
        span = None if name in _RESHAPES_IN_PLACE or name in _REALLOCATES else _span(target)
        moves = out_arg or name in _REALLOCATES
        aliased = False
        keep: list[int] = []
        ops = self.ops
        position = len(ops)
        # where the write lands, for replay to apply it again (None: the memory may move)
        wrote = None if moves or span is None else geometry(target)
        for index, ghost, where, reach, dtype, _memory in ghosts or ():  # copied records written again
            if span is not None and _overlap(reach, span):
                aliased = True
                self._note_write(index, ghost, where if dtype == target.dtype else None, wrote, position, elem)
        for index in dict.fromkeys(bucket or ()):
            op = ops[index]
            out = self._live_out(op)
            if out is None:
                continue  # freed: nothing left to overwrite
            detached = out is not op._out  # the record holds its own copy (on disk) or nothing: never copy it
            multi = not isinstance(out, Tensor)
            leaves = list(out) if multi else [out]
            copied = shared = others = False
            for i, t in enumerate(leaves):
                if not isinstance(t, Tensor) or (multi and self._storage_key(t) != key):
                    continue
                written = t is not target and span is not None and _overlap(_span(t), span)
                if t is target or written or moves:
                    if not detached:
                        leaves[i] = t.clone()
                        copied = True
                    others = others or written
                    if written:
                        where = geometry(t) if t.dtype == target.dtype else None
                        self._note_write(index, i if multi else None, where, wrote, position, elem)
                        if not moves:  # its memory lives on: later writes reach it too
                            self.ghosts.setdefault(key, []).append(
                                (index, i if multi else None, geometry(t), _span(t), t.dtype, t.untyped_storage()))
                else:
                    shared = True
            if shared:  # still views the model's memory: a later write must find it again
                keep.append(index)
            if others:
                aliased = True
                self.stale.setdefault(index, position)
            if not copied:
                continue
            op._out = type(out)(leaves) if multi else leaves[0]
            op.snapshotted = True
        if keep:
            self.storage[key] = keep
        return aliased

    def targets_overlap(self, targets: Any) -> bool:
        """Whether two of the tensors an op writes at once (``_foreach_add_([x, x[:1]])``) share memory."""
        seen: dict[int, tuple[int | None, tuple[int, int]]] = {}  # one tensor listed twice: replay copies it once
        for t in targets:
            if not isinstance(t, Tensor) or id(t) in seen:
                continue
            key, span = self._storage_key(t), _span(t)
            if any(key == k and _overlap(span, s) for k, s in seen.values()):
                return True
            seen[id(t)] = (key, span)
        return False

    def _note_write(self, index: int, elem: int | None, where: Any, wrote: Any, position: int,
                    written: int | None) -> None:
        """Op ``position`` writes (at ``wrote``; element ``written`` of its output) memory that element
        ``elem`` of op ``index``'s output views (at ``where``)."""
        self.alias_writes.setdefault(index, []).append(AliasWrite(position, elem, where, wrote, written))


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``t`` can touch (empty for no elements)."""
    if t.numel() == 0:
        return (0, 0)
    size = t.element_size()
    start = t.storage_offset() * size
    reach = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (start, start + reach * size)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]
