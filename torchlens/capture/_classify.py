"""What TorchLens needs to know about a torch function before recording a call of it.

Computed once per function object and cached: its label stem, whether it mutates an
argument (and which), whether it draws random numbers, whether it reads data into Python.
"""

from __future__ import annotations

import inspect
from typing import Any

from ..core.records import RANDOM_NAMES

__all__ = [
    "DATA_READ_NAMES", "DROPOUT_NAMES", "FuncInfo", "GUARD_NAMES", "INPLACE_DUNDERS", "NOT_INPLACE",
    "info_for",
]

DROPOUT_NAMES = frozenset(
    {"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"}
)
# Calls that turn tensor data into Python values: control flow after them may depend on data.
DATA_READ_NAMES = frozenset(
    {
        "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "equal",
        "allclose", "is_nonzero", "numpy", "__array__", "__format__",
    }
)
# Ops whose index-valued outputs choose what runs next (which experts, which rows, how many):
# replay compares their integer outputs with the recorded ones (guards). ``where`` is one only
# with a single argument (the indices of nonzero elements).
GUARD_NAMES = frozenset(
    {
        "topk", "sort", "argsort", "argmax", "argmin", "max", "min", "median", "nanmedian", "kthvalue", "mode",
        "nonzero", "nonzero_static", "argwhere", "unique", "unique_consecutive", "searchsorted", "bucketize",
        "where",
    }
)
INPLACE_DUNDERS = frozenset(
    {
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
        "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
    }
)
NOT_INPLACE = frozenset({"__get__", "requires_grad_", "share_memory_", "retain_grad", "record_stream"})


class FuncInfo:
    __slots__ = ("name", "stem", "inplace", "inplace_pos", "random", "training_pos", "data_read", "guard")

    def __init__(self, func: Any) -> None:
        raw = getattr(func, "__name__", None) or type(func).__name__
        if raw == "__get__":  # attribute access such as tensor.T / tensor.data
            raw = getattr(getattr(func, "__self__", None), "__name__", "attr")
        name = raw.strip("_") if raw.startswith("__") else raw
        self.name = name
        self.stem = name.rstrip("_") or name
        self.inplace = raw in INPLACE_DUNDERS or (
            raw.endswith("_") and not raw.endswith("__") and raw not in NOT_INPLACE  # _foreach_add_ too
        )
        self.inplace_pos = _param_pos(func, "inplace")
        self.random = raw in RANDOM_NAMES
        self.training_pos = _param_pos(func, "training") if raw in DROPOUT_NAMES else None
        if raw in DROPOUT_NAMES and self.training_pos is None:
            self.random = True
        self.data_read = raw in DATA_READ_NAMES
        self.guard = name in GUARD_NAMES


def _param_pos(func: Any, param: str) -> int | None:
    if not inspect.isfunction(func):
        return None
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names.index(param) if param in names else None


_CACHE: dict[Any, FuncInfo] = {}


def info_for(func: Any) -> FuncInfo:
    try:
        info = _CACHE.get(func)
    except TypeError:  # unhashable callable
        return FuncInfo(func)
    if info is None:
        info = _CACHE[func] = FuncInfo(func)
    return info
