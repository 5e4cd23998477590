"""``nnsight.intervention.batching``: `Batcher`, the per-invoke rows of a batched forward."""

from __future__ import annotations

from ..batching import Batcher

__all__ = [
    "Batcher",
]
