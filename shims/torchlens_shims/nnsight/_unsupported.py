"""The parts of nnsight that need a server or a special back end: typed refusals.

Remote execution on NDIF, the vLLM engine and tensor-parallel loading have no
local equivalent; each entry point raises a `ShimUnsupportedError` subclass whose
remedy says what to do instead. Configuration calls (``CONFIG.set_default_api_key``)
are accepted and ignored, so a script that only sets a key still imports and runs.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

from .errors import (
    InternalsUnsupportedError,
    NNsightDeprecationWarning,
    RemoteUnsupportedError,
    VLLMUnsupportedError,
)

__all__ = [
    "CONFIG",
    "Backend",
    "Config",
    "Controller",
    "Interleaver",
    "Mediator",
    "STATE",
    "VLLM",
    "compare",
    "is_model_running",
    "refusing",
    "login",
    "ndif_status",
    "register",
    "status",
    "whoami",
]


class Config:
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


CONFIG = Config()


def _remote(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RemoteUnsupportedError(f"nnsight.{name}() talks to NDIF, which the shim never contacts")

    refuse.__name__ = name
    refuse.__doc__ = f"nnsight.{name}: needs NDIF; raises RemoteUnsupportedError."
    return refuse


status = _remote("status")

def ndif_status(*args: Any, **kwargs: Any) -> Any:
    """nnsight.ndif_status: deprecated for ``status()`` (warns, as nnsight does); needs NDIF, so refused."""
    warnings.warn(
        "ndif_status() is deprecated; use nnsight.status() instead.", NNsightDeprecationWarning, stacklevel=2
    )
    return status(*args, **kwargs)


is_model_running = _remote("is_model_running")
login = _remote("login")
whoami = _remote("whoami")
register = _remote("register")
compare = _remote("compare")


class VLLM:
    """``nnsight.modeling.vllm.VLLM``: refused — the shim runs the eager transformers forward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise VLLMUnsupportedError("the vLLM back end is not available through the TorchLens nnsight shim")


def _internal(name: str, where: str) -> type:
    """A class standing for an nnsight internal: importable, refused when used."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise InternalsUnsupportedError(
            f"{where}.{name} is part of nnsight's machinery, which the shim does not reproduce"
        )

    return type(name, (), {"__init__": __init__, "__doc__": f"``{where}.{name}``: refused (nnsight internal)."})


Interleaver = _internal("Interleaver", "nnsight.intervention.interleaver")
Mediator = _internal("Mediator", "nnsight.intervention.interleaver")
Controller = _internal("Controller", "nnsight.intervention.source")
Backend = _internal("Backend", "nnsight.tracing.backend")
# the key nnsight keeps its per-module `.source` state under in a module's __dict__
STATE = "__nnsight_source_state__"


def refusing(module: str, error: type[Exception], why: str) -> Any:
    """A module ``__getattr__`` under which every name of ``module`` is a refusal raising ``error``.

    For nnsight modules whose whole purpose is out of scope (remote serialization, tensor
    parallelism, vLLM): ``from nnsight.x import Name`` still ports, and using ``Name``
    (calling it, building it, subclassing it) raises ``error`` saying ``why``.
    """
    where = module.replace("torchlens_shims.nnsight", "nnsight")

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def refuse(self_or_arg: Any = None, *args: Any, **kwargs: Any) -> Any:
            raise error(f"{where}.{name}: {why}")

        return type(name, (), {"__init__": refuse, "__doc__": f"``{where}.{name}``: refused ({why})."})

    return __getattr__
