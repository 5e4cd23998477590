"""``nnsight.intervention.backward``: ``with loss.backward():`` blocks."""

from __future__ import annotations

from ..backward import BackwardTracer

__all__ = [
    "BackwardTracer",
]
