"""``nnsight.intervention.util``: helpers over the values a forward hands around."""

from __future__ import annotations

from ..util import apply, map_tensors

__all__ = [
    "apply",
    "map_tensors",
]
