"""``with loss.backward():`` — read and replace gradients as autograd produces them.

Inside a trace body, ``with metric.backward():`` lifts its own body out and runs
the real backward with that body as a worker: reading ``t.grad`` attaches a
one-shot autograd hook to ``t`` and parks until the gradient flowing into ``t``
arrives; assigning ``t.grad = g`` replaces it for the rest of the backward.
Gradients come in reverse forward order, so they must be read in that order.

``Tensor.backward`` is wrapped when the first shim trace runs (`install`); the
wrapper only does anything different when its call is the header of a ``with``
statement, and defers to the wrapper it found (real nnsight's, when both are
loaded) otherwise.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from types import CodeType
from typing import Any

import torch

from . import _saving, _worker
from ._blocks import BlockScope, find_block, snapshot
from .errors import NoGradientError
from .interleaver import Run
from .tracer import Tracer, push_result

__all__ = ["BackwardTracer", "install", "restore"]

_TORCH_BACKWARD = inspect.unwrap(torch.Tensor.backward)
_displaced: Any = None
_local = threading.local()


def _grad_property(run: Run, seen: set[int], handles: list) -> property:
    original = torch._C.TensorBase.grad

    def watch(tensor: torch.Tensor) -> None:
        key = id(tensor)
        if key in seen:
            return
        seen.add(key)
        location = f"{key}.grad"
        if getattr(tensor, "_tl_batch_view", False) and tensor._base is not None:
            # A batched invoke's rows are a view that is not itself in the graph:
            # hook the batch tensor and cut this view's part out of its gradient.
            base = tensor._base
            geometry = (tensor.shape, tensor.stride(), tensor.storage_offset())

            def on_base_grad(grad: torch.Tensor) -> torch.Tensor:
                try:
                    part = grad.as_strided(*geometry)
                    served = run.handle(location, part)
                    if served is part:
                        return grad
                    updated = grad.clone()
                    updated.as_strided(*geometry).copy_(served)
                    return updated
                finally:
                    handle.remove()

            handle = base.register_hook(on_base_grad)
        else:

            def on_grad(grad: torch.Tensor) -> torch.Tensor:
                try:
                    return run.handle(location, grad)
                finally:
                    handle.remove()

            handle = tensor.register_hook(on_grad)
        handles.append(handle)

    def getter(tensor: torch.Tensor) -> Any:
        if getattr(_local, "run", None) is not run or not _worker.in_worker():
            return original.__get__(tensor)
        watch(tensor)
        return _worker.read(f"{id(tensor)}.grad")

    def setter(tensor: torch.Tensor, value: Any) -> None:
        if getattr(_local, "run", None) is not run or not _worker.in_worker():
            original.__set__(tensor, value)
            return
        watch(tensor)
        _worker.write(f"{id(tensor)}.grad", value)

    return property(getter, setter)


class BackwardTracer(Tracer):
    """The ``with tensor.backward(...):`` block: runs the real backward beside its body."""

    def __init__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.tensor = tensor
        self.args = args
        self.kwargs = kwargs

    def execute(self, code: CodeType) -> None:
        if not self.tensor.requires_grad:
            raise NoGradientError(
                "this tensor does not require grad, so a backward block cannot produce gradients: the "
                "forward ran without gradient tracking (torch.no_grad(), inference mode or generate())"
            )
        frame = self._frame
        body = _worker.Worker(code, BlockScope(snapshot(frame), {}, frame.f_globals))
        run = Run([body], None)
        seen: set[int] = set()
        handles: list = []
        had_own = "grad" in torch.Tensor.__dict__
        previous = torch.Tensor.__dict__.get("grad")
        torch.Tensor.grad = _grad_property(run, seen, handles)
        outer_run = getattr(_local, "run", None)
        _local.run = run
        try:
            try:
                run.start()
                # Hooks must fire on this thread, where the worker lives.
                with torch.autograd.set_multithreading_enabled(False):
                    _TORCH_BACKWARD(self.tensor, *self.args, **self.kwargs)
                run.finish()
            finally:
                run.cancel()
            push_result(frame, body.scope)
        finally:
            _local.run = outer_run
            if had_own:
                torch.Tensor.grad = previous
            else:
                del torch.Tensor.grad
            for handle in handles:
                handle.remove()


def _make_backward() -> Any:
    @functools.wraps(_TORCH_BACKWARD)
    def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "delegating", False):
            return _TORCH_BACKWARD(tensor, *args, **kwargs)
        ours = _saving.depth() > 0 or _displaced is None or _displaced is _TORCH_BACKWARD
        if ours and find_block(sys._getframe(1)) is not None:
            return BackwardTracer(tensor, *args, **kwargs)
        if _displaced is None or _displaced is _TORCH_BACKWARD:
            return _TORCH_BACKWARD(tensor, *args, **kwargs)
        _local.delegating = True
        try:
            return _displaced(tensor, *args, **kwargs)
        finally:
            _local.delegating = False

    backward._tl_shim = True
    return backward


_backward = _make_backward()


def install() -> Any:
    """Put the shim's ``Tensor.backward`` on top; return what it displaced (to `restore`).

    Called as every run starts. Alone, the shim's wrapper then stays installed
    (``with loss.backward():`` works anywhere from the first run on); beside real
    nnsight, whose wrapper finds its caller by frame depth and so cannot be called
    through another wrapper, `restore` takes it off again when the run ends.
    """
    global _displaced
    current = torch.Tensor.backward
    if current is _backward:
        return None
    _displaced = current
    torch.Tensor.backward = _backward
    return current


def restore(previous: Any) -> None:
    """Undo a per-run `install` that displaced another library's wrapper (real nnsight's)."""
    if previous is not None and previous is not _TORCH_BACKWARD and torch.Tensor.backward is _backward:
        torch.Tensor.backward = previous
