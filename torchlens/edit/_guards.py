"""Guards: the values a forward branched on, recomputed and compared when replaying.

A guard is a read of tensor data into Python (``bool(x.sum() > 0)``, ``.item()``,
``.tolist()``: a :class:`~torchlens.core.trace.DataRead`) or the index-valued output of an op
that chooses what runs next (``topk`` indices picking experts, ``nonzero``, one-argument
``where``: ops flagged ``GUARD``), and more generally the shape of every recomputed op. While
a guard's value is unchanged, the rest of the recorded graph is still the path the model
would take, so replay continues exactly; when it changes, replay stops (or falls back to
re-executing the real forward) and says which guard changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ..core.records import INPUT, Op, Ref
from ..core.trace import DataRead
from ..core.tree import tensor_leaves, unflatten
from ..errors import GuardChangedError

__all__ = ["changed_choice", "index_leaves", "recompute_read", "same_value", "short"]


def same_value(a: Any, b: Any) -> bool:
    """Whether two guard values are the same (NaN equals NaN; tensors and arrays elementwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                or a.dtype != b.dtype:
            return False
        if torch.equal(a, b):
            return True
        return a.is_floating_point() and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(),
                                                                                           b.nan_to_num())
    if hasattr(a, "shape") and hasattr(b, "shape"):  # NumPy arrays (Tensor.numpy(), __array__)
        return a.shape == b.shape and bool((a == b).all())
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b) and type(a) is type(b)
    except (TypeError, ValueError, RuntimeError):
        return False


def index_leaves(value: Any) -> list[torch.Tensor]:
    """The integer and boolean tensors of an op's output: the part a guard op decides with."""
    return [t for t in tensor_leaves(value) if not t.is_floating_point() and not t.is_complex()]


def recompute_read(read: DataRead, resolve: Callable[[Ref], Any]) -> Any:
    """The value ``read`` gives on the values ``resolve`` returns for its recorded tensors.

    Raises:
        GuardChangedError: the read was not recorded with its function (a trace loaded from
        disk), or it fails on the new values.
    """
    if read.func is None or read.args_spec is None:
        raise GuardChangedError(
            f"the edit reaches a data-dependent read ({read.name}) at {read.source} whose value this trace did not "
            "record, so replay cannot check that the model would take the same path",
            guard=read.name, source=read.source, recorded=None, new=None,
        )
    leaves, spec = read.args_spec
    args, kwargs = unflatten([resolve(leaf) if type(leaf) is Ref else leaf for leaf in leaves], spec)
    try:
        return read.func(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the read itself fails on edited values: the path changed
        raise GuardChangedError(
            f"after the edit, the data-dependent read {read.name}() at {read.source} fails ({exc})",
            guard=read.name, source=read.source, recorded=read.seen, new=None,
        ) from exc


def short(value: Any, limit: int = 80) -> str:
    """A one-line rendering of a guard value for messages."""
    if isinstance(value, torch.Tensor):
        text = f"tensor{tuple(value.shape)} {value.flatten()[:8].tolist()}" + ("..." if value.numel() > 8 else "")
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."



_ROUTING_WORDS = ("router", "gate", "moe", "expert")


def changed_choice(trace: Any, op: Op, old: list[torch.Tensor], new: list[torch.Tensor]) -> str:
    """What a guard op's changed indices chose, in the terms of the model at hand: what a capture-time
    edit that recorded the op says (``edit.describe_choice(trace, op, seen)``: a TopK feature dictionary's
    selection), a generated token (the op picks along the vocabulary of the model's token embedding:
    greedy decoding, top-k), the experts a router picks (the op runs inside a routing module), or else
    what runs next."""
    where = f"{op.func_name} at {op.source}, op {op.label}"
    seen = f"recorded {short(old[0] if old else None)}, now {short(new[0] if new else None)}"
    for step in getattr(trace, "steps", None) or ():
        describe = getattr(step.edit, "describe_choice", None)
        said = describe(trace, op, f"{where}: {seen}") if callable(describe) else None
        if said:
            return said
    if _picks_along(trace, op) in _token_vocabularies(trace):
        return (f"the edit changes the generated token ({where} picks along the vocabulary: {seen}); the tokens "
                "after it, and every step that reads them, would differ")
    module = op.module or ""
    if any(word in module.lower() for word in _ROUTING_WORDS):
        return f"the edit changes which experts the router at {module} picks ({where}: {seen})"
    return f"the edit changes the indices {where} chose, which decide what runs next: {seen}"


def _picks_along(trace: Any, op: Op) -> int | None:
    """The size of the last dimension of ``op``'s first tensor argument (what it picks among)."""
    ref = next((leaf for leaf in op.args_spec[0] if type(leaf) is Ref), None) if op.args_spec else None
    shape = None if ref is None or ref.elem is not None else trace.ops[ref.index].shape
    return shape[-1] if isinstance(shape, tuple) and shape and isinstance(shape[-1], int) else None


def _token_vocabularies(trace: Any) -> set[int]:
    """The row counts of the embedding tables the model looks its input tokens up in (their indices
    come from the model's inputs, possibly through ops such as ``cat``; positions do not)."""
    ops = trace.ops
    sizes: set[int] = set()
    for op in ops:
        if op.func_name != "embedding" or not op.args_spec:
            continue
        leaves = op.args_spec[0]
        ref = next((leaf for leaf in leaves if type(leaf) is Ref), None)
        table = next((leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() == 2), None)
        if ref is None or table is None or table.shape[0] in sizes:
            continue
        todo, seen = [ref.index], set()
        while todo and len(seen) < 256:  # tokens reach their embedding in a few ops (ids, cat, slicing)
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            if ops[i].flags & INPUT:
                sizes.add(table.shape[0])
                break
            todo.extend(r.index for r in ops[i].parent_refs or ())
    return sizes
