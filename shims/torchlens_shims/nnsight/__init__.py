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
8. ``modeling`` (``modeling.transformers`` and its siblings, ``modeling.mixins``)
9. this package, the public API

nnsight's public module layout is mirrored: ``intervention/``, ``tracing/``, ``schema/``,
``modeling/`` and ``ndif`` re-export the names nnsight keeps at those paths, so
``from nnsight.X import Y`` ports by the same one-word change. Modules whose whole purpose
is out of scope (remote serialization, tensor parallelism, vLLM) answer every name with a
typed refusal. Modules named like nnsight's own are public; the ``_`` ones are the shim's
machinery (``saving`` and ``unsupported`` are public homes of ``save`` and the refusals).
"""

from __future__ import annotations

# torch and transformers (and anyio, which transformers may reach) define their
# classes before `.save` is mounted on `object`: pybind11 refuses a module
# function named like an attribute every object has, and anyio refuses
# unannotated public attributes on its classes.
import torch

from torchlens.errors import OptionalDependencyError

try:
    import transformers  # noqa: F401
except ModuleNotFoundError as error:  # a plain `pip install torchlens` has no transformers
    raise OptionalDependencyError(
        f"torchlens_shims.nnsight needs {error.name!r}, which is not installed",
        remedy="pip install 'torchlens[nnsight]' (or 'torchlens[shims]' for both shims).",
    ) from error

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
