"""The one input convention, shared by every entry point that runs a model.

An input is a tensor (the one positional argument), a tuple of positional inputs, or a
dict of keyword inputs; ``tl.trace(model, *args, **kwargs)`` also takes the model's
arguments directly. To pass a tuple or dict *itself* as the one positional argument,
wrap it in a tuple: ``(batch_dict,)``. Documented in docs/concepts.md, "Inputs".
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidArgumentError

__all__ = ["call_inputs", "split_inputs"]


def split_inputs(x: Any) -> tuple[tuple, dict]:
    """How a user's ``x`` / ``inputs=`` is passed to the model: a dict as keywords, a tuple as
    positional arguments, anything else as the single positional argument."""
    if isinstance(x, dict):
        return (), dict(x)
    if isinstance(x, tuple):
        return x, {}
    return (x,), {}


def call_inputs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``tl.trace(model, *args, **kwargs)`` under the one convention.

    One positional input is read as :func:`split_inputs` reads ``x`` (so
    ``tl.trace(model, {"input_ids": ids})`` equals ``tl.extract(model, {"input_ids": ids}, ...)``),
    and keywords given directly join it; several positional inputs pass as they are.

    Raises:
        InvalidArgumentError: a keyword is given both in the dict and directly.
    """
    if len(args) != 1:
        return args, kwargs
    args, from_dict = split_inputs(args[0])
    both = sorted(set(from_dict) & set(kwargs))
    if both:
        raise InvalidArgumentError(
            f"keyword input(s) {both} given twice: in the input dict and as keyword arguments",
            remedy="Give each keyword input once: in the dict, or as a keyword argument of tl.trace.",
        )
    return args, {**from_dict, **kwargs}
