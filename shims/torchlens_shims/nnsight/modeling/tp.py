"""``nnsight.modeling.tp``: tensor-parallel rules; every name is refused."""

from __future__ import annotations

from .._unsupported import refusing
from ..errors import TensorParallelUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    TensorParallelUnsupportedError,
    "tensor-parallel sharding is not available; the shim runs one local forward",
)
