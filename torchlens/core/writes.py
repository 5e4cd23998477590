"""Writes through views: the value a tensor has when memory it shares was written through another view.

A forward may fill a buffer through views of it (``buf[..., :d].copy_(k)`` after ``new_empty``),
or write into a view and then read another region of the same memory (``f = x[0]; f[..., i] = y``,
then ``x[2]``). The op that made the tensor recorded it as it was produced; an op reading it later
sees it with the writes made since. The recorder notes each such write (:class:`AliasWrite`):
which in-place op wrote, and where the written view and the read tensor lie in their shared
memory. Replay rebuilds what a reader saw by laying the read tensor out in a scratch buffer as
it lay in the forward's memory and applying the writes in their order (:func:`fold`), so a
replayed write of edited values reaches every later reader, as it did in the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = ["AliasWrite", "Geometry", "fold", "geometry"]

# (sizes, strides, storage offset), in elements of the tensor's dtype
Geometry = tuple[tuple[int, ...], tuple[int, ...], int]


class AliasWrite(NamedTuple):
    """One write an in-place op made into memory a recorded tensor views.

    ``op``: the in-place op's index (its output is the written view after the write); ``elem``:
    the element of the read op's output that lies on the memory (None: the output itself);
    ``read`` and ``write``: where the read tensor and the written view lie in the shared memory
    (None: the write cannot be laid out again: the dtypes differ, or the op may move the memory);
    ``written``: the element of the in-place op's output that is the written view, for an op
    writing several tensors (``_foreach_add_``, ``out=(values, indices)``; None: its output).
    """

    op: int
    elem: int | None
    read: Geometry | None
    write: Geometry | None
    written: int | None = None

    @property
    def reproducible(self) -> bool:
        return self.read is not None and self.write is not None


def geometry(t: torch.Tensor) -> Geometry | None:
    """Where ``t`` lies in its memory (None: its elements overlap beyond broadcast dimensions,
    so writing it into a scratch buffer is not defined)."""
    size, stride, offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()
    try:
        if torch._debug_has_internal_overlap(t.as_strided(*_spread((size, stride, offset)))) == 1:  # 2: not known
            return None
    except RuntimeError:
        return None
    return size, stride, offset


def _spread(g: Geometry) -> Geometry:
    """``g`` without its broadcast (stride 0) dimensions: the memory it covers, each element once."""
    size, stride, offset = g
    kept = [(n, s) for n, s in zip(size, stride) if s != 0]
    return tuple(n for n, _ in kept), tuple(s for _, s in kept), offset


def _end(g: Geometry) -> int:
    size, stride, offset = g
    if any(n == 0 for n in size):
        return offset
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))


def _place(image: torch.Tensor, g: Geometry, value: torch.Tensor, lo: int) -> None:
    size, stride, offset = _spread(g)
    one = tuple(0 if s == 0 else slice(None) for s in g[1])  # broadcast dims hold one value each
    image.as_strided(size, stride, offset - lo).copy_(value[one] if one else value)


def fold(value: torch.Tensor, writes: list[AliasWrite], written: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``value`` (a recorded tensor, as its op produced it) with ``writes`` applied in order.

    Args:
        value: the read tensor as produced.
        writes: the reproducible writes into its memory a reader saw, in the order they ran.
        written: the value of a write op (the written view after the write), by op index.

    Returns:
        a new tensor: what a reader after those writes saw.
    """
    if not writes:
        return value
    with torch._C.DisableTorchFunction():  # our scratch work, never ops of a model being captured
        read = writes[0].read
        lo = min(read[2], *(w.write[2] for w in writes))
        hi = max(_end(read), *(_end(w.write) for w in writes))
        image = value.new_empty(max(hi - lo, 1))
        _place(image, read, value, lo)
        for w in writes:
            v = written(w.op)
            _place(image, w.write, v if w.written is None else v[w.written], lo)
        return image.as_strided(read[0], read[1], read[2] - lo).clone()
