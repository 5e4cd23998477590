"""``nnsight.intervention.backends.remote``: the NDIF back end; every name is refused."""

from __future__ import annotations

from ..._unsupported import refusing
from ...errors import RemoteUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    RemoteUnsupportedError,
    "the remote back end talks to NDIF, which the shim never contacts",
)
