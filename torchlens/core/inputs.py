"""The one input convention, shared by every entry point that runs a model."""

from __future__ import annotations

from typing import Any

__all__ = ["split_inputs"]


def split_inputs(x: Any) -> tuple[tuple, dict]:
    """How a user's ``x`` / ``inputs=`` is passed to the model: a dict as keywords, a tuple as
    positional arguments, anything else as the single positional argument."""
    if isinstance(x, dict):
        return (), dict(x)
    if isinstance(x, tuple):
        return x, {}
    return (x,), {}
