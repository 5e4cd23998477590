"""Torch functions by qualified name, from an allowlist, so a loaded trace never imports.

A saved op names its function (``torch.nn.functional.relu``); loading looks the name up
in a table built from torch's own overridable-function list plus a few tensor factories,
minus anything that touches storage, files, hooks or pickling. An unknown name leaves
the op readable but not replayable: its function is an :class:`UnresolvedFunction` that
refuses when called and keeps the saved name (so a re-save writes it back unchanged).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import get_overridable_functions

from ..capture._recorder import FlatOutputs
from ..errors import ReplayNotExactError

__all__ = ["FLAT", "UnresolvedFunction", "function_name", "function_table", "resolve_function"]

_FACTORIES = {
    "torch": frozenset({
        "arange", "tensor", "as_tensor", "scalar_tensor", "zeros", "ones", "full", "empty", "empty_strided",
        "empty_permuted", "eye", "linspace", "logspace", "range", "tril_indices", "triu_indices", "rand", "randn",
        "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like", "as_strided", "fill", "vander",
        "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window",
    }),
    "torch.Tensor": frozenset({
        "new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros", "unflatten",
    }),
}
_DENIED = frozenset({
    "register_hook", "register_post_accumulate_grad_hook", "apply_", "map_", "map2_", "__setstate__",
    "__reduce__", "__reduce_ex__", "__deepcopy__", "module_load", "set_", "share_memory_", "storage",
    "untyped_storage", "_typed_storage", "data_ptr", "tolist", "numpy", "__array__", "__array_wrap__",
    "pin_memory", "record_stream", "backward", "from_file", "load", "save", "from_numpy", "frombuffer",
})
_FUNCS: tuple[dict[str, Any], dict[Any, str]] | None = None


FLAT = "flat:"  # prefix of a saved function name whose nested outputs the op records flat


def function_table() -> tuple[dict[str, Any], dict[Any, str]]:
    """``(name -> function, function -> name)`` for every torch function a trace may replay."""
    global _FUNCS
    if _FUNCS is not None:
        return _FUNCS
    allowed: set[Any] = set()
    for funcs in get_overridable_functions().values():
        for fn in funcs:
            try:
                allowed.add(fn)
            except TypeError:
                pass
    spaces = {"torch": torch, "torch.Tensor": torch.Tensor, "torch.nn.functional": F, "torch.linalg": torch.linalg,
              "torch.fft": torch.fft, "torch.special": torch.special}
    by_name: dict[str, Any] = {}
    by_func: dict[Any, str] = {}
    for prefix, space in spaces.items():
        for attr in sorted(dir(space)):
            dunder = attr.startswith("__") and attr.endswith("__")
            if attr in _DENIED or (attr.startswith("_") and not dunder):
                continue
            try:
                obj = getattr(space, attr)
                found = [(f"{prefix}.{attr}", obj)]
                if prefix == "torch.Tensor" and type(obj).__name__ == "getset_descriptor" or isinstance(obj, property):
                    found.append((f"{prefix}.{attr}.__get__", obj.__get__))
            except Exception:  # noqa: BLE001 - some attributes refuse to be read on the class
                continue
            for name, fn in found:
                try:
                    ok = fn in allowed or attr in _FACTORIES.get(prefix, ())
                except TypeError:
                    continue
                if ok:
                    by_name[name] = fn
                    by_func.setdefault(fn, name)
    _FUNCS = (by_name, by_func)
    return _FUNCS


class UnresolvedFunction:
    """The function of a loaded op whose saved name is not on the allow-list: never imported, refuses a call."""

    __name__ = "unresolved"

    def __init__(self, name: str | None) -> None:
        self.name = name  # the saved qualified name (None: the save named no function)
        # why the op cannot be re-issued (tl.validate lists it as not checked with this reason)
        self.refusal = (f"its function {name!r} is not on the allow-list of torch functions a loaded trace may "
                        "call, so it was not resolved" if name is not None else
                        "its function was not on the allow-list when the trace was saved, so no name was saved")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ReplayNotExactError(
            f"a loaded op cannot be re-issued: {self.refusal}",
            remedy="Re-execute with the model instead: fork.do(site, edit, model=model, inputs=x).",
        )


def function_name(fn: Any) -> str | None:
    """The allow-listed name of ``fn`` (an unresolved loaded function keeps its saved name; a
    function whose nested outputs the trace keeps flat, ``FLAT + name``); None if unknown."""
    if isinstance(fn, UnresolvedFunction):
        return fn.name
    if isinstance(fn, FlatOutputs):
        inner = function_name(fn.func)
        return None if inner is None else FLAT + inner
    try:
        return function_table()[1].get(fn)
    except TypeError:
        return None


def resolve_function(name: str) -> Any:
    """The function a saved trace names (see :func:`function_name`); None if not allow-listed."""
    if name.startswith(FLAT):
        inner = function_table()[0].get(name[len(FLAT):])
        return None if inner is None else FlatOutputs(inner)
    return function_table()[0].get(name)
