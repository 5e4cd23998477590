"""``nnsight.intervention.backends``: execution back ends; every name is refused."""

from __future__ import annotations

from ..._unsupported import refusing
from ...errors import RemoteUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    RemoteUnsupportedError,
    "the shim runs every trace locally, in this process",
)
