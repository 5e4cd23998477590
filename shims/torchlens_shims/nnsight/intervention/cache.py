"""``nnsight.intervention.cache``: ``tracer.cache()`` and its entries."""

from __future__ import annotations

from ..cache import Cache, CacheView, Entry

__all__ = [
    "Cache",
    "CacheView",
    "Entry",
]
