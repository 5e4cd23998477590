"""nnsight's ``nnsight.schema`` package (configuration)."""

from __future__ import annotations

__all__: list[str] = []
