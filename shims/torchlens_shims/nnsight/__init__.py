"""nnsight 0.8 dialect on TorchLens: port code by changing one import line.

``from torchlens_shims.nnsight import NNsight`` (or ``import torchlens_shims.nnsight
as nnsight``) gives the names nnsight code uses — ``NNsight``, ``TransformersModel``,
``LanguageModel``, ``save`` — with nnsight's semantics: the ``with model.trace(x):``
body runs beside the forward, ``.save()`` decides what leaves it, modules are read
in forward order. Values are served through TorchLens's module hooks; remote
execution (NDIF), vLLM and tensor parallelism raise a typed error instead.

The modules import one way: each runs imports only of modules in an earlier layer
(annotation-only imports under ``TYPE_CHECKING`` aside, which never run):

1. ``errors``, ``util``, ``_node`` (what lower layers know an envoy by)
2. ``_saving``, ``_blocks``, ``_worker``, ``_unsupported``, ``processing``, ``batching``, ``cache``
3. ``_served``, ``barrier``, ``interleaver``
4. ``tracer``, ``source``
5. ``backward``
6. ``_driver``
7. ``envoy``
8. ``modeling``
9. this package, the public API

Modules named like nnsight's own are public (nnsight's tests import them by that
path); the ``_`` ones are the shim's machinery.
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

from . import _saving  # noqa: E402
from ._saving import save  # noqa: E402
from ._unsupported import (  # noqa: E402
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
from .envoy import Envoy, NNsight  # noqa: E402
from .errors import NNsightDeprecationWarning, OutOfOrderError  # noqa: E402
from .modeling import LanguageModel, TransformersModel  # noqa: E402

__version__ = "0.8.0"

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


class Object(torch.Tensor):
    """Type-hint name for a value read inside a trace (it *is* the tensor at run time)."""

    def save(self, _: Any = None) -> Object:
        return _saving.mark(self)


_saving.mount()
