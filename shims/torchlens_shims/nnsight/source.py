"""``envoy.source``: operation-level access inside a module's forward (not yet available)."""

from __future__ import annotations

from typing import Any

from .errors import ShimUnsupportedError


class Source:
    def __init__(self, envoy: Any) -> None:
        self._envoy = envoy

    def __getattr__(self, name: str) -> Any:
        raise ShimUnsupportedError(
            f"{self._envoy.path}.source.{name}: operation-level access is not available in the shim yet",
            remedy="Record every op with torchlens.trace(model, x) and read trace.layers.",
        )
