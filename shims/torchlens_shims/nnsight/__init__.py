"""nnsight 0.8 dialect on TorchLens: port code by changing one import line.

``from torchlens_shims.nnsight import NNsight`` (or ``import torchlens_shims.nnsight
as nnsight``) gives the names nnsight code uses — ``NNsight``, ``TransformersModel``,
``LanguageModel``, ``save`` — with nnsight's semantics: the ``with model.trace(x):``
body runs beside the forward, ``.save()`` decides what leaves it, modules are read
in forward order. Values are served through TorchLens's module hooks; remote
execution (NDIF), vLLM and tensor parallelism raise a typed error instead.
"""

from __future__ import annotations

# torch and transformers (and anyio, which transformers may reach) define their
# classes before `.save` is mounted on `object`: pybind11 refuses a module
# function named like an attribute every object has, and anyio refuses
# unannotated public attributes on its classes.
import torch
import transformers  # noqa: F401

try:  # pragma: no cover - optional
    import anyio  # noqa: F401
except ImportError:  # pragma: no cover
    pass

from typing import Any  # noqa: E402


class NNsightDeprecationWarning(FutureWarning):
    """The category of every deprecation the shim repeats from nnsight."""


class Object(torch.Tensor):
    """Type-hint name for a value read inside a trace (it *is* the tensor at run time)."""

    def save(self, _: Any = None) -> Object:
        from .saving import mark

        return mark(self)


from . import saving  # noqa: E402
from .envoy import Envoy, NNsight  # noqa: E402
from .errors import OutOfOrderError  # noqa: E402
from .saving import save  # noqa: E402
from .unsupported import (  # noqa: E402
    CONFIG,
    VLLM,
    compare,
    is_model_running,
    login,
    ndif_status,
    register,
    status,
    whoami,
)

__version__ = "0.8.0"

_LAZY = {
    "TransformersModel": ".modeling",
    "LanguageModel": ".modeling",
}


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'torchlens_shims.nnsight' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "CONFIG",
    "Envoy",
    "LanguageModel",
    "NNsight",
    "NNsightDeprecationWarning",
    "Object",
    "OutOfOrderError",
    "TransformersModel",
    "VLLM",
    "compare",
    "is_model_running",
    "login",
    "ndif_status",
    "register",
    "save",
    "status",
    "whoami",
]

saving.mount()
