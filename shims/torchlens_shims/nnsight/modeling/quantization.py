"""``nnsight.modeling.quantization``: sizing quantized deployments for NDIF; every name is refused."""

from __future__ import annotations

from .._unsupported import refusing
from ..errors import RemoteUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    RemoteUnsupportedError,
    "deployment sizing is for NDIF placement, which the shim never does",
)
