"""``nnsight.intervention.source``: ``envoy.source``, the operations inside a module's forward."""

from __future__ import annotations

from ..source import STATE, Controller, Source, SourceNotAvailable, SourceOp

__all__ = [
    "STATE",
    "Controller",
    "Source",
    "SourceNotAvailable",
    "SourceOp",
]
