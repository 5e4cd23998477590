"""Where a recorded op came from: the model's own line, seen through torch's and TorchLens's frames.

A code object is the model's unless it is torch's, TorchLens's own machinery, frozen, or a
dispatcher's (accelerate moving weights and activations between devices); the answer is
cached per code object, by id.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from ..core.records import LAZY_LINES

__all__ = ["DISPATCHER_DIRS", "INTERNAL", "is_dispatcher", "is_internal", "source_of"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # torchlens/
# TorchLens's own machinery, skipped when looking for the model line that issued an op.
_OWN = tuple(_PKG_DIR + p for p in ("capture" + os.sep, "core" + os.sep, "edit" + os.sep, "api.py",
                                    "_core_services.py"))
# Per code object (by id: hashing a code object hashes all its constants, on every lookup): is it
# TorchLens's or torch's own, not the model's? ``_HELD`` keeps each code alive, so its id stays its own.
INTERNAL: dict[int, bool] = {}
_HELD: list[Any] = []


def _package_dirs(*names: str) -> tuple[str, ...]:
    """Where these packages are installed (found without importing them)."""
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or ()) if spec is not None else ():
            found.append(os.path.join(loc, ""))
    return tuple(found)


# Packages that move a model's weights and activations between devices around its forward
# (accelerate's dispatch and offload hooks): the ops they issue are not the model's.
DISPATCHER_DIRS = _package_dirs("accelerate")
_DISPATCHER: dict[int, bool] = {}  # by code id, as ``INTERNAL``
def is_dispatcher(code) -> bool:
    """Whether the frame that called a torch function is a dispatcher's own code."""
    found = _DISPATCHER.get(id(code))
    if found is None:
        found = _DISPATCHER[id(code)] = code.co_filename.startswith(DISPATCHER_DIRS)
        _HELD.append(code)
    return found


def is_internal(code) -> bool:
    internal = INTERNAL.get(id(code))
    if internal is None:
        fn = code.co_filename
        # A dispatcher's forward wrapper stands between the model's line and the module it calls.
        internal = fn.startswith(_TORCH_DIR) or fn.startswith(_OWN) or fn.startswith("<frozen") or \
            bool(DISPATCHER_DIRS) and fn.startswith(DISPATCHER_DIRS)
        INTERNAL[id(code)] = internal
        _HELD.append(code)
    return internal


def source_of(f) -> tuple[Any, int | None, int]:
    """The first frame from ``f`` outwards that is the model's own: its code, and its line or (with
    ``LAZY_LINES``) None and the offset of its calling instruction, for ``Op`` to find the line from."""
    internal = INTERNAL
    while f is not None:
        code = f.f_code
        found = internal.get(id(code))
        if found is None:
            found = is_internal(code)
        if not found:
            return (code, None, f.f_lasti) if LAZY_LINES else (code, f.f_lineno, -1)
        f = f.f_back
    return None, 0, -1
