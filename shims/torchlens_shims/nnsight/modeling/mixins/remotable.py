"""``nnsight.modeling.mixins.remotable``: placing a model on NDIF; refused (the shim runs locally)."""

from __future__ import annotations

from typing import Any

from ..._unsupported import _internal
from ...errors import RemoteUnsupportedError

__all__ = ["Remotable", "bytes_per_element"]

Remotable = _internal("Remotable", "nnsight.modeling.mixins.remotable")


def bytes_per_element(*args: Any, **kwargs: Any) -> Any:
    """NDIF's sizing of a deployment: refused with `RemoteUnsupportedError`."""
    raise RemoteUnsupportedError("sizing a deployment for NDIF is not available in the shim")
