"""The slicing rules of shape ops (``view``/``reshape``, ``expand``, ``transpose``/``permute``,
``cat``, ``stack``, ``getitem``, ``split``/``chunk``/``unbind``): they map the changed region of their input
through their shapes to the region of their output, and are re-run whole (they are views or
copies). ``_slicing`` holds the other rules and applies them all.
"""

from __future__ import annotations

import math
from typing import Any

from ._regions import WHOLE, Plan, Region, Rows, normal, union

__all__ = ["cat_rule", "expand_rule", "full_plan", "getitem_rule", "map_shape", "permute_rule", "split_rule",
           "stack_rule", "transpose_rule", "view_rule"]


def full_plan(region: Region) -> Plan:
    region = normal(region) if isinstance(region, Rows) else region
    return Plan("full", region)


def map_shape(shape_in: tuple, r: Rows, shape_out: tuple) -> Region:
    """A region of a tensor of ``shape_in`` as a region of the same elements viewed as ``shape_out``."""
    outer, inner = math.prod(shape_in[: r.axis]), math.prod(shape_in[r.axis + 1:])
    size = shape_in[r.axis]
    for b in range(len(shape_out)):
        if shape_out[b] == size and math.prod(shape_out[:b]) == outer and math.prod(shape_out[b + 1:]) == inner:
            return Rows(b, r.start)
    if outer != 1:
        return WHOLE
    flat_start = r.start * inner  # only a suffix of the flattened tensor changed
    b = 0
    while b + 1 < len(shape_out) and math.prod(shape_out[: b + 1]) == 1:
        b += 1
    return normal(Rows(b, flat_start // max(1, math.prod(shape_out[b + 1:]))))


def view_rule(call: Any, changed, out_shape: tuple) -> Plan:
    t, r = changed[0]
    if len(changed) != 1 or t is not call.args[0]:
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: changed shape argument")
    return full_plan(map_shape(tuple(t.shape), r, out_shape))


def expand_rule(call: Any, changed, out_shape: tuple) -> Plan:
    t, r = changed[0]
    axis = len(out_shape) - (t.dim() - r.axis)
    if t.shape[r.axis] != out_shape[axis]:
        return Plan("full", WHOLE, reason="expand: the changed axis is broadcast")
    return full_plan(Rows(axis, r.start))


def transpose_rule(call: Any, changed, out_shape: tuple) -> Plan:
    t, r = changed[0]
    n = t.dim()
    if call.op.func_name in ("t", "T"):
        d0, d1 = 0, n - 1
    else:
        d0, d1 = call.arg(1, "dim0") % n, call.arg(2, "dim1") % n
    axis = d1 if r.axis == d0 else d0 if r.axis == d1 else r.axis
    return full_plan(Rows(axis, r.start))


def permute_rule(call: Any, changed, out_shape: tuple) -> Plan:
    t, r = changed[0]
    dims = call.args[1:] if len(call.args) > 2 or isinstance(call.arg(1, "dims"), int) else call.arg(1, "dims")
    dims = [d % t.dim() for d in dims]
    return full_plan(Rows(dims.index(r.axis), r.start))


def cat_rule(call: Any, changed, out_shape: tuple) -> Plan:
    seq = call.arg(0, "tensors")
    dim = call.arg(1, "dim", 0) % len(out_shape)
    regions = {id(t): r for t, r in changed}
    region: Region = None
    offset = 0
    for t in seq:
        r = regions.get(id(t))
        if r is not None:
            if r.axis == dim:
                region = union(region, Rows(dim, offset + r.start))
            else:
                region = union(region, r)
        offset += t.shape[dim] if t.dim() == len(out_shape) else 0
    return full_plan(region)


def stack_rule(call: Any, changed, out_shape: tuple) -> Plan:
    """``stack``: a changed axis of an input is that axis of the output, one further on from ``dim``."""
    dim = call.arg(1, "dim", 0) % len(out_shape)
    region: Region = None
    for t, r in changed:
        if t.dim() != len(out_shape) - 1:
            return Plan("full", WHOLE, reason="stack: an input of another rank")
        region = union(region, Rows(r.axis + (1 if r.axis >= dim else 0), r.start))
    return full_plan(region)


def getitem_rule(call: Any, changed, out_shape: tuple) -> Plan:
    t, r = changed[0]
    index = call.args[1] if len(call.args) > 1 else None
    index = index if isinstance(index, tuple) else (index,)
    # a tensor index (also one the edit changed, held as its pending rows): advanced indexing
    if any(isinstance(i, bool) or not (i is None or i is Ellipsis or isinstance(i, (int, slice))) for i in index):
        return Plan("full", WHOLE, reason="getitem: advanced (tensor) indexing")
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    expanded: list[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (t.dim() - n_real))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (t.dim() - sum(1 for i in expanded if i is not None)))
    src = out = 0
    for i in expanded:
        if i is None:
            out += 1
            continue
        if src == r.axis:
            size = t.shape[src]
            if isinstance(i, int):
                return Plan("full", WHOLE) if i % size >= r.start else Plan("skip", None)
            lo, hi, step = i.indices(size)
            if step != 1:
                return Plan("full", WHOLE, reason="getitem: a strided slice of the changed axis")
            if hi <= r.start:
                return Plan("skip", None)
            return full_plan(Rows(out, max(0, r.start - lo)))
        src += 1
        out += 0 if isinstance(i, int) else 1
    return Plan("full", WHOLE, reason="getitem: could not follow the index")


def split_rule(call: Any, changed) -> Plan:
    t, r = changed[0]
    if t is not call.args[0]:
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: changed size argument")
    outs = call.op.shape
    dim = call.arg(2, "dim", 0) % t.dim() if call.op.func_name != "unbind" else call.arg(1, "dim", 0) % t.dim()
    regions = []
    offset = 0
    for shape in outs:
        if call.op.func_name == "unbind":
            if dim == r.axis:
                regions.append(WHOLE if offset >= r.start else None)
            else:
                regions.append(Rows(r.axis - (1 if r.axis > dim else 0), r.start))
            offset += 1
            continue
        if dim != r.axis:
            regions.append(Rows(r.axis, r.start))
            continue
        n = shape[dim]
        regions.append(None if offset + n <= r.start else normal(Rows(dim, max(0, r.start - offset))))
        offset += n
    return Plan("full", tuple(regions))
