"""Indices into an axis of known length, with Python's meaning: ``-1`` is the last entry.

One owner for the rule every workflow argument that counts along an axis follows (layers,
sequence positions, a head's query rows): ``-n .. n-1`` are accepted and made non-negative,
anything else is refused, never wrapped (``positions=[10]`` on a 10-token prompt is not
position 0).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..errors import InvalidArgumentError, TorchLensError

__all__ = ["python_indices"]


def python_indices(values: int | Iterable[int], length: int, *, what: str, axis: str,
                   error: type[TorchLensError] = InvalidArgumentError, **fields: Any) -> list[int]:
    """``values`` as non-negative indices into an axis of ``length`` entries (``-1``: the last).

    Args:
        values: an int, or an iterable of ints (a 1-D integer tensor too).
        length: the axis' length.
        what: what one index names, for the message (``"position"``, ``"layer"``).
        axis: the axis in the user's terms (``"the prompt has 10 positions"``).
        error: the error class raised for an index out of range (a wrong type is always
            ``InvalidArgumentError``).
        **fields: structured fields of the error.

    Returns:
        the indices, in the order given, each in ``0 .. length-1``.

    Raises:
        InvalidArgumentError: an index that is not an int.
        ``error``: an index outside ``-length .. length-1``.
    """
    items = [values] if _is_index(values) else values
    if isinstance(items, torch.Tensor):
        items = items.tolist() if items.dim() == 1 and not items.is_floating_point() else [items]
    try:
        items = list(items)
    except TypeError:
        items = [values]
    wrong = [v for v in items if not _is_index(v)]
    if wrong:
        raise InvalidArgumentError(f"{what} indices are ints, got {wrong[:3]!r}",
                                   remedy=f"Pass ints (negative ones count from the end: -1 is the last {what}).")
    bad = [int(v) for v in items if not -length <= int(v) < length]
    if bad:
        raise error(
            f"{what} {bad[0] if len(bad) == 1 else bad} out of range: {axis} ({what}s 0 .. {length - 1}, or "
            f"-{length} .. -1 counting from the end)",
            remedy=f"Pick {what}s between {-length} and {length - 1}.", length=length, **{what: bad}, **fields)
    return [int(v) % length for v in items]


def _is_index(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, int) and not isinstance(value, bool)
