"""The one input convention, shared by every entry point that runs a model.

An input is a tensor (the one positional argument), a tuple of positional inputs, a
dict (any mapping, such as a tokenizer's output) of keyword inputs, or text: a string or
a list of strings, tokenized by :mod:`torchlens.core.text` with ``tokenizer=`` or the
model's ``tokenizer`` attribute. ``tl.trace(model, *args, **kwargs)`` also takes the
model's arguments directly. To pass a tuple or dict *itself* as the one positional
argument, wrap it in a tuple: ``(batch_dict,)``. Documented in docs/concepts.md, "Inputs".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..errors import InvalidArgumentError
from .text import is_text, text_inputs
from .tree import flatten, unflatten

__all__ = ["call_inputs", "input_tensors", "replace_input", "split_inputs"]


def split_inputs(x: Any, *, model: Any = None, tokenizer: Any = None) -> tuple[tuple, dict]:
    """How a user's ``x`` / ``inputs=`` is passed to the model: a mapping as keywords, a tuple as
    positional arguments, text as its token ids (and attention mask), anything else as the single
    positional argument.

    Raises:
        TokenizerRequiredError: ``x`` is text and neither ``tokenizer`` nor ``model.tokenizer`` is given.
        PaddingNotSupportedError: strings of different lengths for a forward without ``attention_mask``.
    """
    if type(x) is Tensor:  # the commonest input: one tensor (no abstract-class check)
        return (x,), {}
    if isinstance(x, Mapping):
        return (), dict(x)
    if isinstance(x, tuple):
        return x, {}
    if is_text(x):
        return text_inputs(x, model, tokenizer)
    return (x,), {}


def call_inputs(args: tuple, kwargs: dict, *, model: Any = None, tokenizer: Any = None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of ``tl.trace(model, *args, **kwargs)`` under the one convention.

    One positional input is read as :func:`split_inputs` reads ``x`` (so
    ``tl.trace(model, {"input_ids": ids})`` equals ``tl.extract(model, {"input_ids": ids}, ...)``,
    and ``tl.trace(model, "text", tokenizer=tok)`` tokenizes), and keywords given directly join
    it; several positional inputs pass as they are.

    Raises:
        InvalidArgumentError: a keyword is given both in the dict and directly.
        TokenizerRequiredError, PaddingNotSupportedError: as :func:`split_inputs`.
    """
    if len(args) != 1:
        return args, kwargs
    args, from_dict = split_inputs(args[0], model=model, tokenizer=tokenizer)
    both = sorted(set(from_dict) & set(kwargs))
    if both:
        raise InvalidArgumentError(
            f"keyword input(s) {both} given twice: in the input dict and as keyword arguments",
            remedy="Give each keyword input once: in the dict, or as a keyword argument of tl.trace.",
        )
    return args, {**from_dict, **kwargs}


def input_tensors(args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    """Every tensor a forward is given, with the label its input record takes: ``input_{key}``
    (``key`` the position or keyword), ``input_{key}_{j}`` for the ``j``-th tensor of a structured one."""
    found = []
    for key, value in [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items()):
        tensors = [t for t in flatten(value)[0] if isinstance(t, Tensor)]
        found += [(f"input_{key}" if len(tensors) == 1 else f"input_{key}_{j}", t) for j, t in enumerate(tensors)]
    return found


def replace_input(args: tuple, kwargs: dict, label: str, new: Tensor) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the input tensor labelled ``label`` (see :func:`input_tensors`) replaced by ``new``.

    Raises:
        InvalidArgumentError: no input tensor has that label.
    """
    args, kwargs = list(args), dict(kwargs)
    for key, value in [(i, a) for i, a in enumerate(args)] + list(kwargs.items()):
        leaves, spec = flatten(value)
        tensors = [i for i, t in enumerate(leaves) if isinstance(t, Tensor)]
        for j, i in enumerate(tensors):
            if (f"input_{key}" if len(tensors) == 1 else f"input_{key}_{j}") == label:
                leaves[i] = new
                replaced = unflatten(leaves, spec)
                if isinstance(key, int):
                    args[key] = replaced
                else:
                    kwargs[key] = replaced
                return tuple(args), kwargs
    raise InvalidArgumentError(f"the forward is given no input tensor {label!r}")
