"""Which op values a disk-backed trace recomputes on read instead of writing, and how.

A value is recomputed only when its op is an IEEE correctly-rounded elementwise operation
(``add``/``sub`` without ``alpha``, ``mul``, true ``div``, ``neg``, ``abs``, ``where``,
``masked_fill``, ``clone``/``contiguous``/a same-dtype ``to``) on CPU tensors that are values of
earlier ops of the same store, with Python scalars as its other arguments. Each output element of
such an op is one rounding of a function of the same input elements, so the result does not
depend on how the kernel walks the tensor (vectorized or scalar loop, thread count, alignment):
recomputing from bit-equal inputs gives bit-equal outputs. Transcendental functions (``tanh``,
``exp``, ``pow``, ``gelu``, ``softmax`` ...) depend on the CPU's vector math library and are always
written. ``relu``/``maximum``/``minimum`` are written too: their vectorized and scalar loops may
pick different signs of zero (``max(-0.0, 0.0)``) or different NaNs, and which loop runs depends on
the thread count and the layout. ``add``/``sub`` with ``alpha`` may be fused into one FMA or not.

The store still checks every candidate while the forward runs (:func:`bits_equal` on the integer
views of both results, so NaNs and signed zeros count): only a recompute that reproduces the
value bit for bit replaces the bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..core.records import Ref
from ..core.tree import unflatten_call

__all__ = ["MAX_RECOMPUTE_OPS", "RECOMPUTABLE", "Recompute", "bits_equal", "candidate_args", "run_recipe"]

# The most ops one read recomputes (this value and every recomputed value it is made from,
# counted along each path): a read never walks a long chain such as a residual stream of adds.
MAX_RECOMPUTE_OPS = 8

_ADD = ("torch.add", "torch.Tensor.add", "torch.Tensor.__add__", "torch.Tensor.__radd__", "torch.sub",
        "torch.subtract", "torch.Tensor.sub", "torch.Tensor.subtract", "torch.Tensor.__sub__", "torch.Tensor.__rsub__")
_MUL = ("torch.mul", "torch.multiply", "torch.Tensor.mul", "torch.Tensor.multiply", "torch.Tensor.__mul__",
        "torch.Tensor.__rmul__")
_DIV = ("torch.div", "torch.divide", "torch.true_divide", "torch.Tensor.div", "torch.Tensor.divide",
        "torch.Tensor.true_divide", "torch.Tensor.__truediv__", "torch.Tensor.__rtruediv__")
_UNARY = ("torch.neg", "torch.negative", "torch.Tensor.neg", "torch.Tensor.negative", "torch.Tensor.__neg__",
          "torch.abs", "torch.absolute", "torch.Tensor.abs", "torch.Tensor.absolute", "torch.Tensor.__abs__",
          "torch.clone", "torch.Tensor.clone", "torch.Tensor.contiguous")
_SELECT = ("torch.where", "torch.Tensor.where", "torch.masked_fill", "torch.Tensor.masked_fill")
# name -> the keyword arguments it may carry and the values each may have. Names are those of the
# portable function table (``_fn_allowlist``), which a test checks; building that table takes half a
# second, too long to spend in every capture, so the few names needed here are resolved directly.
_KWARGS: dict[str, dict[str, tuple]] = {
    **{name: {"alpha": (1,)} for name in _ADD},
    **{name: {"rounding_mode": (None,)} for name in _DIV},
    **{name: {} for name in (*_MUL, *_UNARY, *_SELECT)},
    "torch.Tensor.to": {"copy": (True, False), "non_blocking": (False,)},  # the store also checks the dtype is kept
}


def _by_function() -> tuple[dict[Any, str], dict[Any, dict[str, tuple]]]:
    """``(function -> name, function -> keyword rules)``; aliases share a function: the first name listed wins."""
    spaces = {"torch": torch, "torch.Tensor": torch.Tensor}
    names: dict[Any, str] = {}
    rules: dict[Any, dict[str, tuple]] = {}
    for name, kwargs in _KWARGS.items():
        space, attr = name.rsplit(".", 1)
        fn = getattr(spaces[space], attr)
        names.setdefault(fn, name)
        rules.setdefault(fn, kwargs)
    return names, rules


_NAMES, _RULES = _by_function()
_WHERE = (torch.where, torch.Tensor.where)
RECOMPUTABLE = frozenset(_KWARGS)  # every function name a recipe may carry
_SCALARS = (bool, int, float)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Recompute:
    """How to recompute one value: a function (by its portable name) of stored values and scalars."""

    __slots__ = ("name", "func", "args", "kwargs")

    def __init__(self, name: str, func: Callable, args: list[Any], kwargs: dict[str, Any]) -> None:
        self.name = name  # its name in the portable function table (torch.Tensor.__mul__ ...)
        self.func = func
        self.args = args  # a Ref leaf became the stored value's name, wrapped in a 1-tuple
        self.kwargs = kwargs

    def tensor_names(self) -> list[str]:
        return [a[0] for a in (*self.args, *self.kwargs.values()) if type(a) is tuple]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (no pickle): tensors as ``{"tensor": name}``, dtypes as ``{"dtype": "float32"}``,
        a float that is not finite as ``{"float": "-inf"}``."""
        def enc(a: Any) -> Any:
            if type(a) is tuple:
                return {"tensor": a[0]}
            if isinstance(a, torch.dtype):
                return {"dtype": str(a).removeprefix("torch.")}
            if type(a) is float and not math.isfinite(a):
                return {"float": repr(a)}  # strict JSON has no inf or nan: "inf", "-inf", "nan"
            return a
        return {"fn": self.name, "args": [enc(a) for a in self.args],
                "kwargs": {k: enc(v) for k, v in self.kwargs.items()}}


def candidate_args(op: Any) -> tuple[str, Any, list[Any], dict[str, Any]] | None:
    """``(name, func, args, kwargs)`` of ``op`` when its function and arguments allow a recompute
    (``Ref`` leaves for recorded tensors, scalars, dtypes), else None."""
    func = op.func
    try:
        rule = _RULES.get(func)
    except TypeError:  # an unhashable callable
        return None
    if rule is None or op.args_spec is None:
        return None
    leaves, spec = op.args_spec
    for leaf in leaves:
        kind = type(leaf)
        if kind is Ref:
            if leaf.elem is not None:
                return None
        elif kind not in _SCALARS and leaf is not None and not (func is torch.Tensor.to and kind is torch.dtype):
            return None  # a parameter, a buffer, a tensor no op produced, a device, a list ...
    args, kwargs = unflatten_call(leaves, spec)
    if type(args) is not tuple or type(kwargs) is not dict:
        return None
    for key, value in kwargs.items():
        if key not in rule or type(value) not in (*_SCALARS, type(None)) or value not in rule[key]:
            return None
    if any(type(a) not in (Ref, *_SCALARS, torch.dtype) for a in args):
        return None
    if func in _WHERE and len(args) != 3:
        return None  # where(cond) returns indices: not elementwise
    return _NAMES[func], func, list(args), kwargs


def run_recipe(func: Callable, args: list[Any], kwargs: dict[str, Any]) -> torch.Tensor:
    """``func(*args, **kwargs)`` outside any capture (no op recorded) and without autograd."""
    with torch.no_grad(), torch._C.DisableTorchFunction():
        return func(*args, **kwargs)


def bits_equal(a: Any, b: torch.Tensor) -> bool:
    """Whether ``a`` is ``b`` bit for bit: same type, dtype and shape, and equal integer views
    (so NaN payloads and the sign of zero count)."""
    if type(a) is not torch.Tensor or a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ints = _INTS.get(a.element_size())
        if ints is None:
            return False
        with torch._C.DisableTorchFunction():
            return torch.equal(a.view(ints), b.view(ints))
    with torch._C.DisableTorchFunction():
        return torch.equal(a, b)
