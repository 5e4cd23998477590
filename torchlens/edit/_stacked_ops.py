"""How one op runs on the stacked rows of a sweep (:mod:`torchlens.edit._sweep`): the ops whose
rows of several forks can be computed in one call, the stand-in a rule sees for a stacked
argument, and the shape ops and attention that need more than a row rule's call.
"""

from __future__ import annotations

from typing import Any

import torch

from ._execute import ROW_VIEWS
from ._regions import RowPatch, Rows
from ._slicing import ELEMENTWISE
from ._stack import forks_batch

__all__ = ["ATTENTION", "MEMORY_VIEWS", "SHAPED", "STACKED_OPS", "STACKED_RULES", "PerFork", "Swept", "SweptWhole",
           "attention", "several", "shaped"]

# Ops whose row rule reads each changed argument only as its changed rows: run once on every fork's rows.
STACKED_RULES = ELEMENTWISE | {"linear", "layer_norm", "rms_norm", "softmax", "log_softmax", "mean", "sum", "amax",
                               "amin", "addmm", "matmul"}
# Ops with several outputs, each a slice of the input along a kept axis: run once on the stacked rows.
SPLITS = frozenset({"split", "chunk", "unbind"})
CATS = frozenset({"cat", "concat", "concatenate", "stack"})
ATTENTION = "scaled_dot_product_attention"
SHAPED = SPLITS | CATS | {"getitem"}
STACKED_OPS = STACKED_RULES | ROW_VIEWS | SHAPED | {ATTENTION}
# Shape ops that reinterpret memory: stacked rows keep one block per fork only if nothing before the axis changes.
MEMORY_VIEWS = frozenset({"view", "reshape", "flatten", "unflatten"})


class PerFork(Exception):
    """A rule reads a stacked argument other than as its changed rows: run the op once per fork."""


class Swept(RowPatch):
    """A stacked argument as a row rule sees it while its op is planned: cutting it to its
    changed rows gives every fork's rows; reading it any other way asks for a per-fork run."""

    __slots__ = ()

    def narrow(self, axis: int, start: int, length: int) -> torch.Tensor:
        if axis == self.axis and start == self.start and length == self.base.shape[axis] - start:
            return self.rows
        raise PerFork

    def resolve(self) -> torch.Tensor:
        raise PerFork


class SweptWhole(Swept):
    """A stacked key or value of attention: the rule passes it whole, so planning sees the
    recorded tensor, and :func:`attention` puts each fork's rows in."""

    __slots__ = ()

    def resolve(self) -> torch.Tensor:
        return self.base


def several(region: Any) -> bool:
    """Whether ``region`` is one region per output of a multi-output op (``Rows`` is a tuple too)."""
    return isinstance(region, tuple) and not isinstance(region, Rows)



def shaped(op: Any, args: tuple, kwargs: dict, plan: Any, n: int) -> tuple[Any, Any, str]:
    """Shape ops on the stacked rows: ``split``/``chunk``/``unbind`` and ``cat``/``stack`` along
    another axis, a ``cat`` whose stacked tensor ends its sequence along the stacked axis (a key
    cache), and ``getitem`` taking every row of the stacked axis."""
    x = args[0] if args else kwargs.get("tensors", kwargs.get("input"))
    region, name = plan.region, op.func_name
    if plan.kind != "full":
        raise PerFork
    if name in SPLITS:
        if not isinstance(x, Swept) or any(isinstance(a, Swept) for a in (*args[1:], *kwargs.values())) \
                or not several(region) or any(r is not None and r.axis != x.axis for r in region):
            raise PerFork
        rows = tuple(op.func(x.rows, *args[1:], **kwargs))
        shapes = op.shape
        if len(rows) != len(region) or not isinstance(shapes, tuple) or len(shapes) != len(rows):
            raise PerFork
        for r, got, shape in zip(region, rows, shapes):
            if r is not None and (got.shape[r.axis] != (shape[r.axis] - r.start) * n
                                  or got.shape[: r.axis] != torch.Size(shape[: r.axis])):
                raise PerFork
        return region, rows, "mapped"
    if not isinstance(region, Rows) or not isinstance(op.shape, tuple):
        raise PerFork
    want = list(op.shape)
    want[region.axis] = (want[region.axis] - region.start) * n
    if name == "getitem":
        index = args[1] if len(args) == 2 and not kwargs else None
        parts = index if isinstance(index, tuple) else (index,)
        # a basic index: selecting as many rows of the stacked axis as it holds means all of them, in order
        if not isinstance(x, Swept) or index is None or any(
                isinstance(i, (torch.Tensor, list, bool)) or isinstance(i, slice) and i.step not in (None, 1)
                for i in parts):
            raise PerFork
        rows = x.rows[index]
    else:
        seq = list(x) if isinstance(x, (list, tuple)) else []
        swept = [t for t in seq if isinstance(t, Swept)]
        if not swept or len(args) < 1 or any(isinstance(a, Swept) for a in kwargs.values()):
            raise PerFork
        dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(op.shape)
        if name != "stack" and dim == region.axis:  # the stacked tensor must end the sequence: a key cache
            last = swept[0]
            # found by identity: ``list.index`` would compare tensors with ``==``, element by element
            after = seq[next(k for k, t in enumerate(seq) if t is last) + 1:]
            if len(swept) != 1 or any(t.dim() == last.dim() and t.shape[dim] != 0 for t in after) \
                    or last.shape[dim] - last.start != op.shape[dim] - region.start:
                raise PerFork
            rows = last.rows
        else:  # along another axis: every tensor must be stacked the same way
            if len(swept) != len(seq) or len({(t.axis, t.start) for t in swept}) != 1:
                raise PerFork
            rows = op.func([t.rows for t in seq], *args[1:], **kwargs)
    if not isinstance(rows, torch.Tensor) or list(rows.shape) != want:
        raise PerFork
    return region, rows, "mapped"

def attention(call: Any, args: tuple, kwargs: dict, n: int, want: list[int]) -> torch.Tensor:
    """Attention on stacked query rows: each fork's queries, keys and values as one batch
    entry of one call (forks never see each other's keys)."""
    by_base = {id(a.base): a for a in (*args, *kwargs.values()) if isinstance(a, SweptWhole)}
    q, k, v = call.args[:3]
    if len(call.args) != 3 or q.dim() != 4 or id(q) not in call.axes or call.axes[id(q)] != 2:
        raise PerFork
    b, heads, rows, d = q.shape
    m = rows // n

    def per_fork_batch(t: torch.Tensor) -> torch.Tensor:
        s = by_base.get(id(t))
        if t.dim() != 4 or t.shape[0] != b:
            raise PerFork
        if s is None:  # unchanged: the same keys for every fork
            return t.unsqueeze(0).expand(n, *t.shape).reshape(n * b, *t.shape[1:])
        if s.axis != 2:
            raise PerFork
        return forks_batch(t, s.axis, s.start, s.rows, n)  # each fork's keys: recorded ones, then its own

    mask = call.kwargs.get("attn_mask")
    extra = dict(call.kwargs)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] != 1:
        if mask.shape[0] != b:
            raise PerFork
        extra["attn_mask"] = mask.repeat(n, 1, 1, 1)
    queries = q.reshape(b, heads, n, m, d).permute(2, 0, 1, 3, 4).reshape(n * b, heads, m, d)
    out = call.func(queries, per_fork_batch(k), per_fork_batch(v), **extra)
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[0] != n * b:
        raise PerFork
    out = out.reshape(n, b, heads, m, out.shape[-1]).permute(1, 2, 0, 3, 4).reshape(b, heads, n * m, out.shape[-1])
    if list(out.shape) != want:
        raise PerFork
    return out
