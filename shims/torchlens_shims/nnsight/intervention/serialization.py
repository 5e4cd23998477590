"""``nnsight.intervention.serialization``: serializing traces for NDIF; every name is refused."""

from __future__ import annotations

from .._unsupported import refusing
from ..errors import RemoteUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    RemoteUnsupportedError,
    "serializing traces is for the remote back end, which the shim never uses",
)
