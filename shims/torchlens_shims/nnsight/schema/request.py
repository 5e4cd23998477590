"""``nnsight.schema.request``: NDIF request schema; every name is refused."""

from __future__ import annotations

from .._unsupported import refusing
from ..errors import RemoteUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    RemoteUnsupportedError,
    "requests are sent to NDIF, which the shim never contacts",
)
