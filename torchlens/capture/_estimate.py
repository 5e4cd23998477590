"""How many bytes an in-memory capture would hold, known before the forward runs.

The capture runs once under ``FakeTensorMode``: parameters and inputs become fake tensors
(shapes, dtypes and devices, no memory, no compute), every op is recorded as it would be, and
the values the trace would keep (``save=`` applied) are summed, each storage once. A forward
whose Python reads tensor data (``.item()``, ``bool(t)``, data-dependent shapes) cannot run on
fake tensors: then there is no estimate, and the capture falls back to checking its resident
size during the forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..core.records import INPUT
from ..core.trace import Trace
from ..core.tree import flatten, unflatten

__all__ = ["Estimate", "estimate_capture", "kept_bytes"]


class Estimate:
    """What the pass over shapes found: ``nbytes`` of values kept, or why it could not run."""

    __slots__ = ("nbytes", "n_ops", "failure")

    def __init__(self, nbytes: int | None, n_ops: int, failure: str | None) -> None:
        self.nbytes = nbytes
        self.n_ops = n_ops
        self.failure = failure  # None: the estimate ran

    def __repr__(self) -> str:
        if self.nbytes is None:
            return f"Estimate(failed: {self.failure})"
        return f"Estimate({self.nbytes / 2**20:.1f} MiB over {self.n_ops} ops)"


def estimate_capture(model: nn.Module, args: tuple, kwargs: dict,
                     run: Callable[[tuple, dict], Trace]) -> Estimate:
    """Run ``run(args, kwargs)`` (a capture of ``model``) on fake tensors and sum the bytes its trace keeps.

    The model is left as it was: module tensors a forward assigns while it runs (caches built
    on first use) are put back, so no fake tensor stays on the model.

    Args:
        model: the model ``run`` captures.
        args: its positional inputs (tensors are passed on as fake tensors of the same shapes).
        kwargs: its keyword inputs.
        run: the capture, with no sink and no memory limit (it must not write anywhere).

    Returns:
        an :class:`Estimate`; ``nbytes`` is None when the model cannot run on fake tensors.
    """
    before = _module_tensors(model)
    try:
        # Parameters and buffers become fake where an op reads them: the model itself is not touched.
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            leaves, spec = flatten((args, kwargs))
            fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in leaves]
            shadow = run(*unflatten(fake, spec))
    except Exception as exc:  # noqa: BLE001 - whatever stops the pass over shapes, the real capture decides
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return Estimate(None, 0, f"{type(exc).__name__}: {first}")
    finally:
        _restore_module_tensors(model, before)
    return Estimate(kept_bytes(shadow), len(shadow.ops), None)


def kept_bytes(trace: Trace) -> int:
    """Bytes of the values ``trace`` holds besides its inputs (each storage once; fake tensors too)."""
    seen: set[int] = set()
    total = 0
    values = [op._out for op in trace.ops if op.saved and not op.flags & INPUT]
    values += [c._out for c in trace.calls if c._out is not None]
    for value in values:
        for t in flatten(value)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta and not isinstance(t, FakeTensor):
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            key = storage._cdata  # the storage itself (a fake tensor's has no data pointer)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _module_tensors(model: nn.Module) -> dict[tuple[int, str, str], tuple[nn.Module, Any]]:
    """Every tensor a module holds (parameters, buffers, plain attributes), by identity."""
    found: dict[tuple[int, str, str], tuple[nn.Module, Any]] = {}
    for module in model.modules():
        for where in ("_parameters", "_buffers"):
            for name, t in getattr(module, where).items():
                found[(id(module), where, name)] = (module, t)
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor):
                found[(id(module), "__dict__", name)] = (module, value)
    return found


def _restore_module_tensors(model: nn.Module, before: dict[tuple[int, str, str], tuple[nn.Module, Any]]) -> None:
    """Put back every module tensor the fake pass replaced, and drop the ones it added."""
    after = _module_tensors(model)
    for key, (module, value) in after.items():
        old = before.get(key)
        if old is not None and old[1] is value:
            continue
        _, where, name = key
        table = getattr(module, where) if where != "__dict__" else vars(module)
        if old is None:
            table.pop(name, None)  # created during the pass (a cache built on fake tensors)
        else:
            table[name] = old[1]
    for key, (module, value) in before.items():
        if key not in after:  # removed during the pass
            _, where, name = key
            table = getattr(module, where) if where != "__dict__" else vars(module)
            table[name] = value
