"""The nnsight names that need NDIF, vLLM or a tensor-parallel back end, in one public place.

Every name here is a typed refusal (a `ShimUnsupportedError` subclass with a remedy) or,
for configuration, an accepted no-op; nnsight's ``nnsight.ndif``,
``nnsight.schema.config`` and ``nnsight.modeling.vllm`` resolve to these names.
Any other name of those modules (``nnsight.ndif.main``, ``get_local_env`` ...) imports as a
class whose use raises `RemoteUnsupportedError`.
"""

from __future__ import annotations

from ._unsupported import (
    CONFIG,
    VLLM,
    Config,
    compare,
    is_model_running,
    login,
    ndif_status,
    refusing,
    register,
    status,
    whoami,
)
from .errors import RemoteUnsupportedError

__all__ = [
    "CONFIG",
    "Config",
    "VLLM",
    "compare",
    "is_model_running",
    "login",
    "ndif_status",
    "register",
    "status",
    "whoami",
]

__getattr__ = refusing(
    "torchlens_shims.nnsight.ndif",
    RemoteUnsupportedError,
    "NDIF's services are not available through the shim, which never contacts NDIF",
)
