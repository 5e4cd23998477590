"""nnsight's ``nnsight.tracing`` package: how a ``with`` block is captured, at nnsight's paths."""

from __future__ import annotations

__all__: list[str] = []
