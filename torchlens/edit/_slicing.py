"""Changed regions: which rows of each op an edit can reach, so replay recomputes only those.

An edit at position ``p`` of a causal model changes nothing at positions ``< p``. A *region*
says which part of a tensor may have changed: ``None`` (nothing), :data:`WHOLE`, or
``Rows(axis, start)`` (only elements whose index along ``axis`` is ``>= start``; everything
else is bit-for-bit what the fork held before the edit). Per-op rules, keyed by function
name, map the regions of an op's arguments to the region of its output and, where that is
a proper part of the output, give the call that computes only those rows:

* elementwise ops (``add``, ``mul``, ``tanh``, ``dropout`` in eval mode ...) keep rows;
* row-wise ops (``linear``, ``addmm``, ``matmul`` by an unchanged matrix, ``layer_norm``,
  ``rms_norm``, ``softmax``/reductions over another axis, ``embedding``) keep rows;
* shape ops (``view``/``reshape``/``transpose``/``permute``/``split``/``cat``/``getitem``
  ...) map the region through their shapes and are re-run whole (they are views or copies;
  their rules are ``_shape_rules``');
* ``scaled_dot_product_attention`` maps changed query rows ``>= p`` to output rows ``>= p``,
  and changed key/value rows ``>= p`` too when no earlier query can see them (causal, or a
  mask that hides them); the changed queries then read the recorded keys and values of the
  unchanged positions.

An op without a rule, or a mix the rules cannot bound (non-causal attention as in BERT, a
reduction over the changed axis), marks its whole output changed and says why
(:class:`Plan` ``reason``): replay then recomputes it whole, exactly as unsliced replay does.
Recomputing rows instead of whole ops changes BLAS blocking, so results agree with a full
replay to float rounding (see ``tests/test_slicing.py`` for the tolerance), not bit for bit.
One exception is made faster and exact: see :func:`rows_linear`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ._regions import WHOLE, Corner, Plan, Region, RowPatch, Rows, as_built, normal, union
from ._shape_rules import (
    cat_rule,
    expand_rule,
    getitem_rule,
    permute_rule,
    split_rule,
    stack_rule,
    transpose_rule,
    view_rule,
)

__all__ = ["PADDED_ROWS", "StackedCall", "collect_rows", "plan_op", "rows_linear"]


_TENSORS = (torch.Tensor, RowPatch)  # a changed argument may be a RowPatch: its new rows over the recorded tensor


class StackedCall(NamedTuple):
    """A row recomputation held back (:func:`collect_rows`): ``func(*args, **kwargs)``, where
    ``axes[id(a)]`` is the axis each narrowed argument ``a`` was cut along."""

    func: Callable[..., Any]
    args: tuple
    kwargs: dict
    axes: dict[int, int]


# While a plan's call is being collected (this thread only), calls are held back, not run.
_COLLECTING = threading.local()


def collect_rows(plan: Plan) -> StackedCall | None:
    """The call ``plan.call()`` would make, with its arguments, without making it (None: the
    plan's rule builds its result some other way)."""
    _COLLECTING.axes = {}
    try:
        got = plan.call()
    finally:
        _COLLECTING.axes = None
    return got if isinstance(got, StackedCall) else None


def _narrow(t: torch.Tensor | RowPatch, axis: int, start: int) -> torch.Tensor:
    cut = t.narrow(axis, start, t.shape[axis] - start)
    axes = getattr(_COLLECTING, "axes", None)
    if axes is not None:
        axes[id(cut)] = axis
    return cut


# -- the rules -------------------------------------------------------------------------------

ELEMENTWISE = frozenset({
    "add", "radd", "sub", "rsub", "mul", "rmul", "div", "truediv", "rtruediv", "true_divide", "pow", "rpow", "neg",
    "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "gelu", "silu", "mish", "softplus", "sin", "cos",
    "erf", "clamp", "clip", "reciprocal", "square", "dropout", "to", "float", "half", "bfloat16", "double",
    "type_as", "type", "where", "contiguous", "clone", "detach", "minimum", "maximum", "masked_fill", "and", "or",
    "logical_not", "eq", "ne", "lt", "gt", "le", "ge", "floor", "ceil", "round", "sign", "leaky_relu", "elu",
    "hardtanh",
})
VIEWS = frozenset({"view", "reshape", "flatten", "unsqueeze", "squeeze", "view_as", "reshape_as", "unflatten"})


class _Call:
    """An op's function with arguments bound by parameter name where a rule needs them."""

    def __init__(self, op: Any, args: tuple, kwargs: dict) -> None:
        self.op, self.args, self.kwargs = op, args, kwargs

    def arg(self, pos: int, name: str, default: Any = None) -> Any:
        if len(self.args) > pos:
            return self.args[pos]
        return self.kwargs.get(name, default)

    def run(self, args: tuple, kwargs: dict | None = None, func: Callable[..., Any] | None = None) -> Any:
        kwargs = self.kwargs if kwargs is None else kwargs
        func = self.op.func if func is None else func
        axes = getattr(_COLLECTING, "axes", None)
        if axes is not None:
            return StackedCall(func, args, kwargs, axes)
        return func(*args, **kwargs)


# Row counts a float32 CPU ``linear`` is padded to 16 rows for (MKL builds only). MKL's sgemm
# by a transposed weight takes a matrix-vector path below 16 rows, about one pass over the
# weight per two rows (GPT-2's 50,257 x 768 head: 12 rows 55 ms, 16 rows 27 ms, one thread);
# from 16 rows on it runs its blocked kernel, which gives each row bit for bit what the
# full-size call (the recorded one, 16 rows or more) gave it. Below 6 rows the padding costs
# more than it saves.
PADDED_ROWS = range(6, 16)
_MKL = torch.backends.mkl.is_available()


def rows_linear(input: torch.Tensor, weight: torch.Tensor,  # noqa: A002 - linear's own name: calls pass it by keyword
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` on recomputed rows: a float32 CPU call with a row count in
    :data:`PADDED_ROWS` is padded with zero rows to 16, run, and cut back (faster, and exactly the
    rows a call of 16 rows or more computes); any other call is ``linear`` itself."""
    rows = input.numel() // input.shape[-1] if input.dim() and input.shape[-1] else 0
    if (rows in PADDED_ROWS and _MKL and input.dtype is torch.float32 and input.device.type == "cpu"
            and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.dtype is torch.float32):
        flat = input.reshape(rows, input.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(16 - rows, flat.shape[1])])
        out = torch.nn.functional.linear(padded, weight, bias)[:rows]
        return out.reshape(*input.shape[:-1], out.shape[-1])
    return torch.nn.functional.linear(input, weight, bias)


def plan_op(op: Any, args: tuple, kwargs: dict, regions: dict[int, Region], shape: Any = None) -> Plan:
    """How to recompute ``op`` given its rebuilt arguments and the changed region of each.

    Args:
        op: the recorded op.
        args: its positional arguments, rebuilt from the fork's current values.
        kwargs: its keyword arguments.
        regions: ``id(argument tensor) -> its changed region`` (unchanged ones absent or None).
        shape: ``op.shape``, when the caller has it.

    Returns:
        the :class:`Plan`.
    """
    changed = []
    corner = whole = False
    region_of = regions.get
    for t in _tensors(args, kwargs):
        r = region_of(id(t))
        if r is not None:
            changed.append((t, r))
            if type(r) is not Rows:
                if isinstance(r, Corner):
                    corner = True
                elif r is WHOLE or not isinstance(r, Rows):
                    whole = True
    if not changed:
        return Plan("skip", None)
    name = op.func_name
    if corner:
        return _corner(name, changed, op.shape)
    if whole:
        return Plan("full", WHOLE)
    call = _Call(op, args, kwargs)
    out_shape = op.shape if shape is None else shape
    if not isinstance(out_shape, tuple) or (out_shape and isinstance(out_shape[0], tuple)):
        rule = _MULTI.get(name)
        if rule is None:
            return Plan("full", WHOLE, reason=f"no slicing rule for {name} (several outputs)")
        return rule(call, changed)
    rule = _RULES.get(name)
    if rule is None:
        if name in ELEMENTWISE:
            return _elementwise(call, changed, out_shape)
        if name in VIEWS:
            return view_rule(call, changed, out_shape)
        return Plan("full", WHOLE, reason=f"no slicing rule for {name}")
    return rule(call, changed, out_shape)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for values in (args, kwargs.values()) if kwargs else (args,):
        for v in values:
            if isinstance(v, _TENSORS):
                found.append(v)
            elif isinstance(v, (list, tuple)):
                found.extend(x for x in v if isinstance(x, _TENSORS))
    return found


def _aligned(changed, out_ndim: int, out_shape: tuple) -> Rows | str:
    """One output region from argument regions aligned from the right (broadcasting)."""
    region: Region = None
    for t, r in changed:
        axis = out_ndim - (t.dim() - r.axis)
        if axis < 0 or t.shape[r.axis] != out_shape[axis]:
            return "a changed argument is broadcast along its changed axis"
        region = union(region, Rows(axis, r.start))
    if region is WHOLE:
        return "arguments changed along different axes"
    return region


def _slice_args(value: Any, axis: int, start: int, out_ndim: int, size: int) -> Any:
    """Every tensor in ``value`` that spans ``axis`` of the output (aligned from the right), narrowed."""
    if isinstance(value, _TENSORS):
        a = value.dim() - (out_ndim - axis)
        if a >= 0 and value.shape[a] == size:
            return _narrow(value, a, start)
        return value
    if isinstance(value, (list, tuple)) and any(isinstance(x, _TENSORS) for x in value):
        return type(value)(_slice_args(x, axis, start, out_ndim, size) for x in value)
    return value


def _rows_plan(call: _Call, region: Rows, out_shape: tuple, build: Callable[[], Any] | None = None) -> Plan:
    region = normal(region)
    if region is WHOLE:
        return Plan("full", WHOLE)
    if build is None:
        n, axis, start, size = len(out_shape), region.axis, region.start, out_shape[region.axis]

        def build():
            args = tuple(_slice_args(a, axis, start, n, size) for a in call.args)
            kwargs = {k: _slice_args(v, axis, start, n, size) for k, v in call.kwargs.items()}
            return call.run(args, kwargs)

    return Plan("rows", region, build)


def _elementwise(call: _Call, changed, out_shape: tuple) -> Plan:
    region = _aligned(changed, len(out_shape), out_shape)
    if isinstance(region, str):
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: {region}")
    return _rows_plan(call, region, out_shape)


def _rowwise(trailing: Callable[[_Call], int], data: tuple[int, str] = (0, "input"),
             func: Callable[..., Any] | None = None):
    """A rule for ops that treat the last ``trailing(call)`` dims of their data argument as one
    row (``linear``, norms, softmax): the changed axis must lie before them. ``func`` replaces
    the recorded function for the rows' call."""

    def rule(call: _Call, changed, out_shape: tuple) -> Plan:
        x = call.arg(*data)
        if len(changed) != 1 or changed[0][0] is not x:
            return Plan("full", WHOLE, reason=f"{call.op.func_name}: a parameter changed, not only its input")
        r = changed[0][1]
        if r.axis >= x.dim() - trailing(call) or x.dim() != len(out_shape):
            return Plan("full", WHOLE, reason=f"{call.op.func_name}: changed along an axis it mixes")
        pos = data[0]

        def build():
            args = list(call.args)
            if len(args) > pos:
                args[pos] = _narrow(x, r.axis, r.start)
                return call.run(tuple(args), func=func)
            kwargs = dict(call.kwargs)
            kwargs[data[1]] = _narrow(x, r.axis, r.start)
            return call.run(tuple(args), kwargs, func=func)

        return _rows_plan(call, r, out_shape, build)

    return rule


def _norm_dims(call: _Call) -> int:
    shape = call.arg(1, "normalized_shape")
    return 1 if isinstance(shape, int) else len(shape or (1,))


def _dim_of(call: _Call) -> int:
    dim = call.arg(1, "dim")
    return dim if isinstance(dim, int) else -1


def _softmax(call: _Call, changed, out_shape: tuple) -> Plan:
    x = call.arg(0, "input")
    if len(changed) != 1 or changed[0][0] is not x or x.dim() != len(out_shape):
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: changed along an axis it mixes")
    r = changed[0][1]
    if r.axis == _dim_of(call) % x.dim():
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: normalises over the changed axis")
    return _rows_plan(call, r, out_shape, lambda: call.run((_narrow(x, r.axis, r.start), *call.args[1:])))


def _reduction(call: _Call, changed, out_shape: tuple) -> Plan:
    x = call.arg(0, "input")
    dim = call.arg(1, "dim")
    if len(changed) != 1 or changed[0][0] is not x or dim is None:
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: reduces over every axis")
    dims = {d % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else (dim,))}
    r = changed[0][1]
    if r.axis in dims:
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: reduces over the changed axis")
    keep = call.arg(2, "keepdim", False)
    axis = r.axis if keep else r.axis - sum(1 for d in dims if d < r.axis)
    if axis >= len(out_shape) or out_shape[axis] != x.shape[r.axis]:
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: output shape does not keep the changed axis")
    return _rows_plan(call, Rows(axis, r.start), out_shape,
                      lambda: call.run((_narrow(x, r.axis, r.start), *call.args[1:])))


def _addmm(call: _Call, changed, out_shape: tuple) -> Plan:
    bias, mat1 = call.arg(0, "input"), call.arg(1, "mat1")
    if len(changed) != 1 or changed[0][0] is not mat1 or changed[0][1].axis != 0:
        return Plan("full", WHOLE, reason="addmm: its weight, bias or contracted axis changed")
    r = changed[0][1]

    def build():
        b = _narrow(bias, 0, r.start) if bias.dim() == 2 and bias.shape[0] == out_shape[0] else bias
        return call.run((b, _narrow(mat1, 0, r.start), *call.args[2:]))

    return _rows_plan(call, r, out_shape, build)


def _matmul(call: _Call, changed, out_shape: tuple) -> Plan:
    a, b = call.arg(0, "input"), call.arg(1, "other")
    if a.dim() < 2 or b.dim() < 2 or len(out_shape) < 2:
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: a vector factor")
    if len(changed) == 2:
        return _both_changed(call, dict((id(t), r) for t, r in changed), a, b, out_shape)
    if len(changed) != 1:
        return Plan("full", WHOLE, reason=f"{call.op.func_name}: both factors changed")
    t, r = changed[0]
    n = len(out_shape)
    if t is a and r.axis < a.dim() - 1:
        axis = n - (a.dim() - r.axis)
        if axis < 0 or out_shape[axis] != a.shape[r.axis]:
            return Plan("full", WHOLE, reason=f"{call.op.func_name}: a broadcast batch axis changed")
        # a batch axis (heads): the output's rows there read the same rows of b, unless b broadcasts
        bd = b.dim() - (a.dim() - r.axis)
        cut_b = r.axis < a.dim() - 2 and bd >= 0 and b.shape[bd] != 1
        return _rows_plan(call, Rows(axis, r.start), out_shape,
                          lambda: call.run((_narrow(a, r.axis, r.start), _narrow(b, bd, r.start) if cut_b else b,
                                            *call.args[2:])))
    if t is b and r.axis == b.dim() - 1:
        return _rows_plan(call, Rows(n - 1, r.start), out_shape,
                          lambda: call.run((a, _narrow(b, r.axis, r.start), *call.args[2:])))
    return Plan("full", WHOLE, reason=f"{call.op.func_name}: changed along the contracted axis")


def _both_changed(call: _Call, regions: dict[int, Rows], a: Any, b: Any, out_shape: tuple) -> Plan:
    """``a @ b`` with both factors changed from some row on, as in eager attention.

    Scores ``q @ k.T`` (changed query rows ``>= p``, key columns ``>= p``) change in a
    :class:`Corner`; they are recomputed whole. Weights ``probs @ v`` (changed rows of both)
    change only in rows ``>= p`` when the unchanged rows of ``probs`` are exactly zero on the
    changed rows of ``v`` (a causal softmax) and those rows are finite (``0 * inf`` is NaN).
    """
    name = call.op.func_name
    ra, rb = regions.get(id(a)), regions.get(id(b))
    if ra is None or rb is None or ra.axis != a.dim() - 2:
        return Plan("full", WHOLE, reason=f"{name}: both factors changed")
    if rb.axis == b.dim() - 1:
        return Plan("full", Corner(ra.start, rb.start), reason="")
    if rb.axis != b.dim() - 2:
        return Plan("full", WHOLE, reason=f"{name}: both factors changed")
    kept = a.base if isinstance(a, RowPatch) and a.axis == ra.axis and a.start >= ra.start else a
    if isinstance(kept, RowPatch):
        kept = kept.resolve()
    block = kept[..., : ra.start, rb.start:]
    if not bool((block == 0).all()) or not bool(torch.isfinite(_narrow(b, rb.axis, rb.start)).all()):
        return Plan("full", WHOLE, reason=f"{name}: both factors changed and earlier rows read the changed ones")
    return _rows_plan(call, Rows(len(out_shape) - 2, ra.start), out_shape,
                      lambda: call.run((_narrow(a, ra.axis, ra.start), as_built(b), *call.args[2:])))


def _corner(name: str, changed, out_shape: Any) -> Plan:
    """Elementwise ops keep a :class:`Corner` (recomputed whole; replay then checks whether a
    causal mask made the corner's extra block unchanged, ``_regions.refine_corner``)."""
    corners = {(r.row, r.col) for _, r in changed if isinstance(r, Corner)}
    if name not in ELEMENTWISE or len(corners) != 1 or not isinstance(out_shape, tuple) or len(out_shape) < 2:
        return Plan("full", WHOLE, reason=f"{name}: changed in a corner of rows and columns")
    row, col = corners.pop()
    for t, r in changed:
        if isinstance(r, Corner):
            if t.dim() != len(out_shape) or tuple(t.shape[-2:]) != tuple(out_shape[-2:]):
                return Plan("full", WHOLE, reason=f"{name}: a corner broadcast")
        elif not (isinstance(r, Rows) and r.axis - t.dim() == -2 and r.start >= row):
            return Plan("full", WHOLE, reason=f"{name}: changed in a corner and elsewhere")
    return Plan("full", Corner(row, col))


def _embedding(call: _Call, changed, out_shape: tuple) -> Plan:
    ids = call.arg(0, "input")
    if len(changed) != 1 or changed[0][0] is not ids:
        return Plan("full", WHOLE, reason="embedding: its weight changed")
    r = changed[0][1]
    return _rows_plan(call, r, out_shape, lambda: call.run((_narrow(ids, r.axis, r.start), *call.args[1:])))


# -- shape ops: re-run whole (views and copies), region mapped through shapes ------------------


def _sdpa(call: _Call, changed, out_shape: tuple) -> Plan:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    a = {n: call.arg(i, n, d) for i, (n, d) in enumerate(zip(names, defaults))}
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    by_id = {id(t): r for t, r in changed}
    if mask is not None and id(mask) in by_id:
        return Plan("full", WHOLE, reason="attention: its mask changed")
    if a["dropout_p"]:
        return Plan("full", WHOLE, reason="attention: dropout inside the kernel")
    seq = q.dim() - 2
    starts = {}
    for name, t in (("q", q), ("k", k), ("v", v)):
        r = by_id.get(id(t))
        if r is not None:
            if r.axis != t.dim() - 2:
                return Plan("full", WHOLE, reason="attention: changed along a head or feature axis")
            starts[name] = r.start
    start = min(starts.values())
    n_q, n_k = q.shape[-2], k.shape[-2]
    kv = min((starts[n] for n in ("k", "v") if n in starts), default=None)
    if kv is not None:
        why = _hidden_from_earlier(mask, bool(a["is_causal"]), n_q, n_k, kv)
        if why:
            return Plan("full", WHOLE, reason=f"attention: {why}")
    start = normal(Rows(seq, start))
    if start is WHOLE:
        return Plan("full", WHOLE)
    s = start.start

    def build():
        if a["is_causal"]:
            m = torch.ones(n_q - s, n_k, dtype=torch.bool, device=q.device).tril(diagonal=s)
        elif mask is not None and mask.dim() >= 2 and mask.shape[-2] == n_q:
            m = _narrow(mask, mask.dim() - 2, s)
        else:
            m = mask
        kwargs = dict(call.kwargs)
        for n in names:
            kwargs.pop(n, None)
        kwargs.update(attn_mask=m, dropout_p=0.0, is_causal=False, scale=a["scale"])
        if a["enable_gqa"]:
            kwargs["enable_gqa"] = True
        return call.run((_narrow(q, seq, s), as_built(k), as_built(v)), kwargs)

    return Plan("rows", start, build)


def _hidden_from_earlier(mask: Any, causal: bool, n_q: int, n_k: int, start: int) -> str:
    """Why queries before ``start`` may see keys at ``>= start`` ('' when they cannot)."""
    if causal and mask is None:
        return "" if n_q == n_k else "causal attention with a key cache (queries and keys differ in length)"
    if mask is None:
        return "not causal (every query sees every key, as in BERT)"
    if mask.shape[-1] != n_k or mask.shape[-2] not in (1, n_q) or start >= n_q:
        return "a mask that does not line queries up with keys"
    early = mask[..., :start, start:] if mask.shape[-2] == n_q else mask[..., :, start:]
    if mask.dtype == torch.bool:
        seen = bool(early.any())
    else:
        seen = bool((early > torch.finfo(mask.dtype).min / 2).any())
    return "not causal (its mask lets earlier queries see the changed keys)" if seen else ""


_RULES: dict[str, Callable[[_Call, list, tuple], Plan]] = {
    "linear": _rowwise(lambda c: 1, func=rows_linear),
    "layer_norm": _rowwise(_norm_dims),
    "rms_norm": _rowwise(_norm_dims),
    "softmax": _softmax,
    "log_softmax": _softmax,
    "mean": _reduction,
    "sum": _reduction,
    "amax": _reduction,
    "amin": _reduction,
    "addmm": _addmm,
    "matmul": _matmul,
    "mm": _matmul,
    "bmm": _matmul,
    "embedding": _embedding,
    "expand": expand_rule,
    "expand_as": expand_rule,
    "transpose": transpose_rule,
    "swapaxes": transpose_rule,
    "t": transpose_rule,
    "permute": permute_rule,
    "cat": cat_rule,
    "concat": cat_rule,
    "concatenate": cat_rule,
    "stack": stack_rule,
    "getitem": getitem_rule,
    "scaled_dot_product_attention": _sdpa,
}
_MULTI: dict[str, Callable[[_Call, list], Plan]] = {"split": split_rule, "chunk": split_rule, "unbind": split_rule}
