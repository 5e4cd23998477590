"""Weights of offloaded modules: recorded as references, not as a second copy.

A model dispatched by ``accelerate`` with offloading (``cpu_offload``, ``disk_offload``,
``device_map`` entries "cpu"/"disk" with ``offload_folder``) keeps the weights of an offloaded
module on the meta device between calls: its hook loads them from its ``weights_map`` right
before the module runs and sets them back to meta right after. The ops recorded during the
call read the loaded weights; holding them in the recorded arguments would keep a second copy
of every offloaded weight alive for as long as the trace lives. After the forward, each such
argument is replaced by an :class:`OffloadedWeight`, which loads the weight again, through the
same ``weights_map``, only while replay or validation runs the op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.records import INPUT, Deferred
from ..core.trace import Trace
from ..core.tree import flatten, unflatten

__all__ = ["OffloadedValue", "OffloadedWeight", "ValueOffload", "defer_offloaded_weights", "offload_hooks"]


class OffloadedWeight(Deferred):
    """A weight an offload hook holds in its ``weights_map``: loaded on demand, never kept."""

    __slots__ = ("weights_map", "key", "device", "shape", "dtype")

    def __init__(self, weights_map: Any, key: str, device: torch.device, shape: torch.Size,
                 dtype: torch.dtype) -> None:
        self.weights_map = weights_map
        self.key = key
        self.device = device
        self.shape = shape
        self.dtype = dtype

    def load(self) -> torch.Tensor:
        """The weight, read from the offload (memory-mapped file or CPU state dict) onto its device."""
        return self.weights_map[self.key].to(self.device)

    def __repr__(self) -> str:
        return f"OffloadedWeight({self.key!r}, {tuple(self.shape)}, {self.dtype})"


class OffloadedValue(Deferred):
    """An op value kept on another device (``offload_values="cpu"``), read back onto the op's own."""

    __slots__ = ("leaves", "spec", "devices")

    def __init__(self, leaves: list[Any], spec: Any, devices: list[torch.device | None]) -> None:
        self.leaves = leaves
        self.spec = spec
        self.devices = devices

    def load(self) -> Any:
        """The value on the device the op produced it on (replay runs there)."""
        leaves = [t.to(d) if d is not None else t for t, d in zip(self.leaves, self.devices)]
        return leaves[0] if self.spec is None else unflatten(leaves, self.spec)


class ValueOffload:
    """A capture sink that keeps each recorded value on ``device`` (usually "cpu") as it is produced."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)

    def put(self, key: str, value: Any, op: Any = None) -> OffloadedValue:  # op: unused, every value is moved
        leaves, spec = flatten(value)
        kept: list[Any] = []
        devices: list[torch.device | None] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                copy = leaf.detach().to(self.device)
                if copy.device == leaf.device and copy.data_ptr() == leaf.data_ptr():
                    copy = copy.clone()  # still the model's memory: later in-place ops would show
                kept.append(copy)
                devices.append(leaf.device)
            else:
                kept.append(leaf)
                devices.append(None)
        return OffloadedValue(kept, spec, devices)

    def close(self) -> None:
        """Nothing to finish: values are in memory on ``device``."""


def offload_hooks(model: nn.Module) -> dict[str, tuple[nn.Module, Any]]:
    """Modules whose offload hook loads their weights for each call: address -> (module, hook)."""
    found: dict[str, tuple[nn.Module, Any]] = {}
    for address, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        if hook is None:
            continue
        for h in getattr(hook, "hooks", None) or (hook,):  # a SequentialHook holds several
            if getattr(h, "offload", False) and getattr(h, "weights_map", None) is not None:
                found[address] = (module, h)
    return found


def _direct_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    found = {k: v for k, v in module._parameters.items() if v is not None}
    found.update((k, v) for k, v in module._buffers.items() if v is not None)
    return found


def _owner(address: str, hooks: dict[str, tuple[nn.Module, Any]]) -> str | None:
    """The offloaded module whose hook loads the weights of the module at ``address``."""
    a = address
    while True:
        if a in hooks:
            return a
        if not a:
            return None
        a = a.rpartition(".")[0]


def defer_offloaded_weights(trace: Trace, model: nn.Module) -> int:
    """Replace every recorded argument that is a weight an offload hook loaded by an
    :class:`OffloadedWeight`; return how many were replaced.

    A weight is recognised by the module of the op that read it (or one enclosing it with an
    offload hook): one of that module's own tensors, which is on the meta device again now,
    with the argument's shape and dtype (and, when several qualify, its values).
    """
    hooks = offload_hooks(model)
    if not hooks:
        return 0
    live = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}
    modules = dict(model.named_modules())
    replaced = 0
    for op in trace.ops:
        if op.flags & INPUT or not op.module:
            continue
        owner = _owner(op.module, hooks)
        if owner is None:
            continue
        hook_module, hook = hooks[owner]
        raw = op.args_spec is None
        leaves, spec = flatten((op.args, op.kwargs)) if raw else op.args_spec
        changed = False
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor) or leaf.is_meta or id(leaf) in live:
                continue
            if raw and trace.producer_ref(leaf, op.index) is not None:
                continue  # an activation, not a weight
            found = _find_weight(leaf, modules.get(op.module), op.module, owner, hook)
            if found is not None:
                leaves[i] = found
                changed = True
                replaced += 1
        if changed:
            if raw:
                op.args, op.kwargs = unflatten(leaves, spec)
            else:
                op.args_spec = (leaves, spec)
    return replaced


def _find_weight(leaf: torch.Tensor, module: nn.Module | None, address: str, owner: str,
                 hook: Any) -> OffloadedWeight | None:
    if module is None:
        return None
    prefix = address[len(owner) + 1:] + "." if address != owner else ""
    candidates = [prefix + name for name, t in _direct_tensors(module).items()
                  if t.is_meta and t.shape == leaf.shape and t.dtype == leaf.dtype]
    if len(candidates) > 1:  # a LayerNorm's weight and bias look alike: compare the values
        candidates = [k for k in candidates if _equal(hook.weights_map, k, leaf)]
    if len(candidates) != 1:
        return None
    return OffloadedWeight(hook.weights_map, candidates[0], leaf.device, leaf.shape, leaf.dtype)


def _equal(weights_map: Any, key: str, leaf: torch.Tensor) -> bool:
    try:
        stored = weights_map[key]
    except KeyError:
        return False
    return stored.shape == leaf.shape and torch.equal(stored.to(leaf.device), leaf)
