"""``nnsight.tracing.backend``: `Backend`, nnsight's execution back-end base: refused (internal)."""

from __future__ import annotations

from .._unsupported import Backend

__all__ = [
    "Backend",
]
