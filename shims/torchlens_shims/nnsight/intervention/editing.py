"""``nnsight.intervention.editing``: the tracer behind ``model.edit()``."""

from __future__ import annotations

from ..tracer import EditingTracer

__all__ = [
    "EditingTracer",
]
