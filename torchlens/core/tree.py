"""Flattening nested outputs (tuples, dicts, ModelOutput) into tensor leaves and back.

One place decides what counts as a container, so module outputs, op arguments and model
outputs are taken apart and rebuilt the same way everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "Pending", "clone_value", "describe_shape", "first_tensor", "flatten", "tensor_leaves", "unflatten",
    "unflatten_call",
]

Tensor = torch.Tensor


class Pending:
    """A value a fork stores unbuilt: ``resolve()`` builds it (replay stores recomputed rows over
    the recorded tensor this way, so a value nobody reads whole is never copied). A base class
    for subclasses to fill in; not an ``ABC``, as ``Trace.value`` checks every read against it."""

    __slots__ = ()

    def resolve(self) -> Any:
        """The value itself."""
        raise NotImplementedError(f"{type(self).__name__} must define resolve()")

    def held(self) -> list[Any]:
        """The tensors this unbuilt value keeps alive (what memory accounting counts)."""
        raise NotImplementedError(f"{type(self).__name__} must define held()")


def flatten(value: Any) -> tuple[list[Any], Any]:
    """Leaves and a spec; a bare tensor takes a fast path (the common module output)."""
    if type(value) is Tensor or isinstance(value, Tensor):
        return [value], None
    return pytree.tree_flatten(value)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    if spec is None:
        return leaves[0]
    return pytree.tree_unflatten(leaves, spec)


def unflatten_call(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` from the leaves and spec of ``flatten((args, kwargs))``.

    Replay rebuilds every op's arguments this way, so the common case (no nested containers
    among the arguments) skips the generic pytree walk, about six times slower per op.
    """
    if spec is not None and spec.type is tuple and spec.num_children == 2:
        a, k = spec.child(0), spec.child(1)
        # flat: every child is one node and one leaf (no nested, empty or None-holding container)
        if a.type is tuple and k.type is dict and a.num_leaves == a.num_children == a.num_nodes - 1 \
                and k.num_leaves == k.num_children == k.num_nodes - 1:
            n = a.num_children
            return tuple(leaves[:n]), dict(zip(k.context, leaves[n:]))
    return unflatten(leaves, spec)


def tensor_leaves(value: Any) -> list[Tensor]:
    leaves, _ = flatten(value)
    return [leaf for leaf in leaves if isinstance(leaf, Tensor)]


def first_tensor(value: Any) -> Tensor | None:
    """The first tensor leaf of a value (depth first), or None."""
    if isinstance(value, Tensor):
        return value
    return next((leaf for leaf in flatten(value)[0] if isinstance(leaf, Tensor)), None)


def clone_value(value: Any) -> Any:
    """A copy of a value whose tensor leaves are cloned (what an edit may change freely)."""
    if isinstance(value, Tensor):
        return value.clone()
    leaves, spec = flatten(value)
    return unflatten([leaf.clone() if isinstance(leaf, Tensor) else leaf for leaf in leaves], spec)


def describe_shape(value: Any) -> Any:
    """A printable shape for a tensor, or a tuple of shapes for a structure."""
    if isinstance(value, Tensor):
        return tuple(value.shape)
    if type(value) in (tuple, list) and all(type(t) is Tensor for t in value):  # a split's outputs: no tree walk
        return tuple(tuple(t.shape) for t in value) if len(value) != 1 else tuple(value[0].shape)
    leaves = tensor_leaves(value)
    if len(leaves) == 1:
        return tuple(leaves[0].shape)
    return tuple(tuple(t.shape) for t in leaves)
