"""``nnsight.ndif``: NDIF status, login and registration, each refused with `RemoteUnsupportedError`."""

from __future__ import annotations

from .unsupported import compare, is_model_running, login, ndif_status, register, status, whoami

__all__ = [
    "compare",
    "is_model_running",
    "login",
    "ndif_status",
    "register",
    "status",
    "whoami",
]
