"""``nnsight.intervention.tracer``: the tracers ``model.trace`` / ``tracer.invoke`` return."""

from __future__ import annotations

from ..tracer import InterleavingTracer, Invoker, ScanningTracer, Tracer

__all__ = [
    "InterleavingTracer",
    "Invoker",
    "ScanningTracer",
    "Tracer",
]
