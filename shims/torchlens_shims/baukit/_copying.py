"""What a Trace keeps of an activation: the object itself, or a detached and/or cloned copy.

The three flags decide what a later in-place change of the model's tensor does to the
retained value (baukit's semantics, reproduced exactly for tensors):

* none set - the very object the module produced; later in-place edits show through.
* ``detach`` - a view sharing storage, cut from the graph; in-place edits still show.
* ``clone`` - a fresh copy (still on the graph unless ``detach``); nothing shows.
* ``retain_grad`` - the original tensor is marked to keep its ``.grad`` (detach is
  then ignored, as in baukit), and a clone is made if ``clone`` is also set.

Deviations, because transformers 5 outputs hold things baukit never met: ``None``
entries, cache objects and other non-tensor leaves pass through unchanged (baukit
fails an assertion); namedtuples are rebuilt field by field (baukit's ``type(x)(list)``
raises); ``retain_grad`` skips integer/bool tensors, which cannot hold a gradient.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["recursive_copy"]


def _copy_tensor(x: torch.Tensor, clone: Any, detach: Any, retain_grad: Any) -> torch.Tensor:
    if retain_grad:
        if x.is_floating_point() or x.is_complex():
            if not x.requires_grad:
                x.requires_grad = True
            x.retain_grad()
    elif detach:
        x = x.detach()
    if clone:
        x = x.clone()
    return x


def recursive_copy(x: Any, clone: Any = None, detach: Any = None, retain_grad: Any = None) -> Any:
    """``x`` with every tensor inside dicts/lists/tuples detached, cloned or marked as asked."""
    if not (clone or detach or retain_grad):
        return x
    if isinstance(x, torch.Tensor):
        return _copy_tensor(x, clone, detach, retain_grad)

    def again(value: Any) -> Any:
        return recursive_copy(value, clone=clone, detach=detach, retain_grad=retain_grad)

    if isinstance(x, dict):
        return type(x)({k: again(v) for k, v in x.items()})
    if isinstance(x, tuple) and hasattr(type(x), "_fields") and hasattr(type(x), "_make"):
        return type(x)._make(again(v) for v in x)
    if isinstance(x, (list, tuple)):
        return type(x)([again(v) for v in x])
    return x
