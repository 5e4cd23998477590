"""``nnsight.intervention.source``: ``envoy.source``, the operations inside a module's forward."""

from __future__ import annotations

from ..source import STATE, Controller, Source, SourceNotAvailable, SourceOp

SourceEnvoy = SourceOp  # nnsight's name for one operation (`envoy.source.<op>_<n>`)

__all__ = [
    "STATE",
    "Controller",
    "Source",
    "SourceEnvoy",
    "SourceNotAvailable",
    "SourceOp",
]
