"""``nnsight.intervention.fragments``: gathering sharded values; every name is refused."""

from __future__ import annotations

from .._unsupported import refusing
from ..errors import TensorParallelUnsupportedError

__all__: list[str] = []

__getattr__ = refusing(
    __name__,
    TensorParallelUnsupportedError,
    "fragments are pieces of values sharded by a distributed runtime; the shim runs one local forward",
)
