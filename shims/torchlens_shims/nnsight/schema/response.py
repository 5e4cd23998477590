"""``nnsight.schema.response``: NDIF response schema; every name is refused."""

from __future__ import annotations

from .._unsupported import refusing
from ..errors import RemoteUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    RemoteUnsupportedError,
    "responses come from NDIF, which the shim never contacts",
)
