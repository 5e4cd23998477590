"""``nnsight.tracing.tracer``: `Tracer` (``model.session()``), `save` and the capture errors."""

from __future__ import annotations

from ..errors import WithBlockNotFoundError
from ..saving import save
from ..tracer import ExitTracingException, Tracer, _not_found_message

__all__ = [
    "ExitTracingException",
    "Tracer",
    "WithBlockNotFoundError",
    "_not_found_message",
    "save",
]
