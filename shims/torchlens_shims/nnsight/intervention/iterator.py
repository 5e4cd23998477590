"""``nnsight.intervention.iterator``: ``tracer.iter[...]`` steps."""

from __future__ import annotations

from ..tracer import Iterations

__all__ = [
    "Iterations",
]
