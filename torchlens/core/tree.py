"""Flattening nested outputs (tuples, dicts, ModelOutput) into tensor leaves and back.

One place decides what counts as a container, so module outputs, op arguments and model
outputs are taken apart and rebuilt the same way everywhere.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "Pending", "Withheld", "clone_value", "describe_shape", "first_tensor", "flatten", "held_tensors",
    "replace_held", "tensor_leaves", "unflatten", "unflatten_call",
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
        # flat kwargs: every child is one node and one leaf (no nested, empty or None-holding container)
        if a.type is tuple and k.type is dict and k.num_leaves == k.num_children == k.num_nodes - 1:
            n = a.num_leaves
            if n == a.num_children == a.num_nodes - 1:  # flat args too
                return tuple(leaves[:n]), dict(zip(k.context, leaves[n:]))
            args = _shallow_args(a, leaves)
            if args is not None:
                return args, dict(zip(k.context, leaves[n:]))
    return unflatten(leaves, spec)


# Containers of leaves an op's argument may be (a shape, a list of tensors to cat), each rebuilt as pytree does.
_SHALLOW = {t: pytree.SUPPORTED_NODES[t].unflatten_fn for t in (tuple, list, torch.Size) if t in pytree.SUPPORTED_NODES}


def _shallow_args(spec: Any, leaves: list[Any]) -> tuple | None:
    """The positional arguments of ``spec`` (a tuple's), each a leaf or a tuple, list or shape
    of leaves, rebuilt as ``pytree.tree_unflatten`` does (None: some argument is nested deeper)."""
    out = []
    i = 0
    for c in spec.children():
        if c.type is None:  # a leaf
            out.append(leaves[i])
            i += 1
            continue
        m = c.num_children
        build = _SHALLOW.get(c.type)
        if build is None or not c.num_leaves == m == c.num_nodes - 1:
            return None
        out.append(build(leaves[i:i + m], c.context))
        i += m
    return tuple(out)


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


# How deep held_tensors looks inside an object flatten keeps whole: an encoder-decoder cache holds
# its tensors four steps down (self_attention_cache, layers, 0, keys).
_HELD_DEPTH = 5
_NOT_WALKED = (torch.nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType, torch.dtype,
               torch.device, str, bytes)


def held_tensors(value: Any) -> list[tuple[tuple, Tensor]]:
    """The tensors an object ``flatten`` keeps whole holds (a KV cache: its layers' keys and
    values), each with its path: ``("a", name)`` an attribute, ``("i", key)`` an item of a list,
    tuple or dict. Empty for a tensor, a number or an object holding no tensor."""
    found: list[tuple[tuple, Tensor]] = []
    seen: set[int] = set()

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, Tensor):
            found.append((path, node))
            return
        if len(path) >= _HELD_DEPTH or id(node) in seen or isinstance(node, _NOT_WALKED):
            return
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            items: Any = enumerate(node)
        elif isinstance(node, dict):
            items = node.items()
        else:
            attrs = getattr(node, "__dict__", None)
            if not attrs:
                return
            for name, child in attrs.items():
                walk(child, (*path, ("a", name)))
            return
        for key, child in items:
            walk(child, (*path, ("i", key)))

    if not isinstance(value, Tensor) and value is not None and not isinstance(value, (int, float, bool, complex)):
        walk(value, ())
    return found


def replace_held(value: Any, new: dict[tuple, Any]) -> Any:
    """A copy of ``value`` with the tensor at each path of ``new`` (paths as :func:`held_tensors`
    gives them) replaced by ``new[path]``. Every object and container on a path is copied, so the
    copy and ``value`` share tensors only: growing one (a cache's ``update``) never grows the other."""
    if () in new:
        return new[()]
    # the paths as a tree: step -> (the new tensor, None) at a path's end, else (None, the steps below)
    tree: dict[tuple, Any] = {}
    for path, tensor in new.items():
        node = tree
        for step in path[:-1]:
            node = node.setdefault(step, (None, {}))[1]
        node[path[-1]] = (tensor, None)
    memo: dict[int, Any] = {}

    def rebuilt(node: Any, steps: dict[tuple, Any]) -> Any:
        if id(node) in memo:
            return memo[id(node)]
        if isinstance(node, tuple):
            items = list(node)
            for (_, key), (tensor, below) in steps.items():
                items[key] = tensor if below is None else rebuilt(node[key], below)
            out = type(node)(*items) if hasattr(node, "_fields") else type(node)(items)
        else:
            out = copy.copy(node)
            for (kind, key), (tensor, below) in steps.items():
                if kind == "a":
                    setattr(out, key, tensor if below is None else rebuilt(getattr(node, key), below))
                else:
                    out[key] = tensor if below is None else rebuilt(node[key], below)
        memo[id(node)] = out
        return out

    return rebuilt(value, tree)


class Withheld:
    """Stands where a fork cannot give an object's edited contents (a KV cache whose tensors replay cannot
    rebuild): reading anything of it raises ``error``, which says why, instead of handing out stale values."""

    __slots__ = ("kind", "error")

    def __init__(self, obj: Any, error: Exception) -> None:
        self.kind = type(obj).__name__
        self.error = error

    def __getattr__(self, name: str) -> Any:
        raise self.error

    def __getitem__(self, key: Any) -> Any:
        raise self.error

    def __iter__(self) -> Any:
        raise self.error

    def __len__(self) -> int:
        raise self.error

    def __repr__(self) -> str:
        return f"<withheld {self.kind}: {self.error.args[0].splitlines()[0]}>"
