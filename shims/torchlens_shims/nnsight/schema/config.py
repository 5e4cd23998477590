"""``nnsight.schema.config``: `CONFIG` is accepted and kept; nothing is ever sent anywhere."""

from __future__ import annotations

from ..unsupported import CONFIG, Config

__all__ = [
    "CONFIG",
    "Config",
]
