"""Several invokes, one forward: assembling the batch and scoping each block to its rows.

Every ``with tracer.invoke(x):`` adds its input as a group of rows (``[start,
size]``). The model's ``_batch`` combines the inputs; while the forward runs, a
block's reads are narrowed to its rows (``narrow``) and its replacements are
spliced back into the full batch (``widen``). Only dim 0 is scoped, and only
when two or more invokes contribute rows: a lone invoke *is* the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import SkipCoverageError
from .util import map_tensors

if TYPE_CHECKING:
    from .envoy import Envoy

__all__ = ["Batcher", "SkipParts"]


class SkipParts:
    """The per-invoke replacements of one batched ``.skip()``, gathered until all are in."""

    def __init__(self) -> None:
        self.parts: list[tuple[list, Any]] = []


def _concat(structures: list) -> Any:
    first = structures[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(structures, dim=0)
    if isinstance(first, (list, tuple)):
        combined = [_concat([s[i] for s in structures]) for i in range(len(first))]
        return type(first)(*combined) if hasattr(first, "_fields") else type(first)(combined)
    if isinstance(first, dict):
        merged = first.copy()
        for key in first:
            merged[key] = _concat([s[key] for s in structures])
        return merged
    return first


class Batcher:
    """Collects the invokes of one trace and scopes values to their rows."""

    def __init__(self, envoy: Envoy, kwargs: dict | None = None) -> None:
        self.envoy = envoy
        self.kwargs = kwargs or {}
        self.invokes: list[tuple[tuple, dict]] = []
        self.extra_kwargs: dict = {}
        self.total = 0

    def add(self, *inputs: Any, **kwargs: Any) -> list | None:
        """Record one input set; return its row group (``None`` for params only)."""
        size = self.envoy._batch_size(*inputs, **kwargs)
        if not size:
            self.extra_kwargs.update(kwargs)
            return None
        group = [self.total, size]
        self.total += size
        self.invokes.append((inputs, kwargs))
        return group

    @property
    def batching(self) -> bool:
        return len(self.invokes) > 1

    def assemble(self, fn: Any) -> tuple[tuple, dict]:
        args, kwargs = self.envoy._batch(self.invokes, fn)
        return args, {**kwargs, **self.extra_kwargs}

    def narrow(self, value: Any, group: list | None) -> Any:
        if group is None or not self.batching:
            return value
        start, size = group
        total = self.total

        def cut(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.dim() and tensor.shape[0] == total:
                view = tensor.narrow(0, start, size)
                # Lets a gradient read on this view find the batch tensor that is
                # actually part of the graph (see `backward`).
                view._tl_batch_view = True
                return view
            return tensor

        return map_tensors(value, cut)

    def widen(self, full: Any, group: list | None, edited: Any) -> Any:
        if group is None or not self.batching:
            return edited
        start, size = group
        total = self.total

        def merge(full_value: Any, edited_value: Any) -> Any:
            if isinstance(full_value, torch.Tensor):
                if not full_value.dim() or full_value.shape[0] != total:
                    return edited_value
                before = full_value.narrow(0, 0, start)
                after = full_value.narrow(0, start + size, total - start - size)
                return torch.cat([before, edited_value, after], dim=0)
            if isinstance(full_value, (list, tuple)):
                merged = [merge(f, e) for f, e in zip(full_value, edited_value)]
                if isinstance(full_value, tuple) and hasattr(full_value, "_fields"):
                    return type(full_value)(*merged)
                return type(full_value)(merged)
            if isinstance(full_value, dict):
                out = full_value.copy()
                for key in full_value:
                    out[key] = merge(full_value[key], edited_value[key])
                return out
            return edited_value

        return merge(full, edited)

    def gather_skip(self, running: Any, group: list | None, replacement: Any) -> Any:
        if group is None or not self.batching:
            return replacement
        if not isinstance(running, SkipParts):
            running = SkipParts()
        running.parts.append((group, replacement))
        return running

    def assemble_skip(self, running: Any) -> Any:
        if not isinstance(running, SkipParts):
            return running
        parts = sorted(running.parts, key=lambda part: part[0][0])
        covered = 0
        for (start, size), _ in parts:
            if start != covered:
                break
            covered += size
        if covered != self.total:
            raise SkipCoverageError(
                "a batched `.skip()` has to cover every row: a shared forward cannot run for only "
                "the rows an invoke left unskipped"
            )
        return _concat([replacement for _, replacement in parts])
