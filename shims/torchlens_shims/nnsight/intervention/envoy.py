"""``nnsight.intervention.envoy``: `Envoy` and the `traceable` method decorator."""

from __future__ import annotations

from ..envoy import Envoy, traceable

__all__ = [
    "Envoy",
    "traceable",
]
