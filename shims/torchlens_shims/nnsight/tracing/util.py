"""``nnsight.tracing.util``: `clean_traceback` and `push` (hand names back to a frame)."""

from __future__ import annotations

from .._blocks import push
from ..tracer import clean_traceback

__all__ = [
    "clean_traceback",
    "push",
]
