"""``nnsight.intervention.barrier``: `Barrier`, for values shared across invokes."""

from __future__ import annotations

from ..barrier import Barrier

__all__ = [
    "Barrier",
]
