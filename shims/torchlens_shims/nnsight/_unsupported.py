"""The parts of nnsight that need a server or a special back end: typed refusals.

Remote execution on NDIF, the vLLM engine and tensor-parallel loading have no
local equivalent; each entry point raises a `ShimUnsupportedError` subclass whose
remedy says what to do instead. Configuration calls (``CONFIG.set_default_api_key``)
are accepted and ignored, so a script that only sets a key still imports and runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .errors import RemoteUnsupportedError, VLLMUnsupportedError

__all__ = [
    "CONFIG",
    "VLLM",
    "compare",
    "is_model_running",
    "login",
    "ndif_status",
    "register",
    "status",
    "whoami",
]


class _Config:
    """Stand-in for ``nnsight.CONFIG``: settings are kept, nothing is ever sent."""

    def __init__(self) -> None:
        self.API = SimpleNamespace(APIKEY=None, HOST="", SSL=True)
        self.APP = SimpleNamespace(DEBUG=False, PYMOUNT=True, REMOTE_LOGGING=False)

    def set_default_api_key(self, apikey: str) -> None:
        self.API.APIKEY = apikey

    def set_default_app_debug(self, debug: bool) -> None:
        self.APP.DEBUG = debug

    def save(self) -> None:
        """nnsight writes its config file here; the shim has nothing to persist."""


CONFIG = _Config()


def _remote(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RemoteUnsupportedError(f"nnsight.{name}() talks to NDIF, which the shim never contacts")

    refuse.__name__ = name
    refuse.__doc__ = f"nnsight.{name}: needs NDIF; raises RemoteUnsupportedError."
    return refuse


status = _remote("status")
ndif_status = _remote("ndif_status")
is_model_running = _remote("is_model_running")
login = _remote("login")
whoami = _remote("whoami")
register = _remote("register")
compare = _remote("compare")


class VLLM:
    """``nnsight.modeling.vllm.VLLM``: refused — the shim runs the eager transformers forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise VLLMUnsupportedError("the vLLM back end is not available through the TorchLens nnsight shim")
