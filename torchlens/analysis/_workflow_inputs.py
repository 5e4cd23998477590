"""What the analysis and patching workflows accept: a trace, or a model and inputs to capture."""

from __future__ import annotations

from typing import Any

from ..api import trace as capture
from ..core.trace import Trace
from ..errors import InvalidArgumentError

__all__ = ["as_trace", "model_of"]


def as_trace(model: Any, value: Any, what: str, tokenizer: Any = None) -> Trace:
    """``value`` as a trace: itself, or ``model`` run on it (token ids, or text through ``tokenizer``,
    else the model's ``tokenizer`` attribute: ``torchlens.core.text``).

    Raises:
        InvalidArgumentError: ``value`` is not a trace and ``model`` is None.
    """
    if isinstance(value, Trace):
        return value
    if model is None:
        raise InvalidArgumentError(f"{what} is not a trace, and no model= was given to capture it",
                                   remedy="Pass traces (tl.trace(model, ids)) or model= with input tensors or "
                                   "text (and tokenizer=).")
    return capture(model, value, tokenizer=tokenizer)


def model_of(*traces: Trace) -> Any:
    """The model of the first of ``traces`` that holds one.

    Raises:
        InvalidArgumentError: none holds a model (all loaded from disk).
    """
    for t in traces:
        if t.model is not None:
            return t.model
    raise InvalidArgumentError("these traces hold no model (loaded from disk?), so canonical sites cannot "
                               "be resolved", remedy="Capture the traces with tl.trace(model, ids).")
