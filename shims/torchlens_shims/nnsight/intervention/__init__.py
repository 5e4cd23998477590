"""nnsight's ``nnsight.intervention`` package: envoys, tracers and served values, at nnsight's paths."""

from __future__ import annotations

__all__: list[str] = []
