"""``nnsight.intervention.eproperty``: define your own served values on an `Envoy` subclass."""

from __future__ import annotations

from .._served import eproperty

__all__ = [
    "eproperty",
]
