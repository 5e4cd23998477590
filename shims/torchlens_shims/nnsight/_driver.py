"""Driving one traced call: inputs in, workers beside the forward, the model left as it was.

`drive` is the single place a run starts and ends. It assembles the (batched)
inputs, attaches the gates and lazy hooks for the model and any standalone
modules (a generator), starts the workers, calls the model, serves
``tracer.result``, reports workers still waiting, and — whatever happened —
unwinds the workers and removes every gate and hook.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _saving, backward
from .errors import InvokeError
from .interleaver import EarlyStopException, Run
from .util import map_tensors

if TYPE_CHECKING:
    from ._worker import Worker
    from .batching import Batcher
    from .envoy import Envoy

__all__ = ["drive"]


def drive(
    envoy: Envoy,
    fn: Any,
    args: tuple,
    kwargs: dict,
    *,
    workers: list[Worker] | None = None,
    batcher: Batcher | None = None,
) -> Any:
    """Call ``fn(*assembled inputs)`` with ``workers`` (and the envoy's stored edits) beside it."""
    if batcher is None:
        batcher = envoy._batcher_class(envoy, kwargs)
    batcher.add(*args, **kwargs)
    args, kwargs = batcher.assemble(fn)
    device = envoy.device
    if device is not None:
        args, kwargs = map_tensors((args, kwargs), lambda tensor: tensor.to(device))
    if isinstance(fn, str):
        fn = getattr(envoy._module, fn)
    tree = envoy._tree
    if tree.run is not None:
        raise InvokeError("this model is already running a trace; a trace cannot start inside another")
    _saving.ensure_mounted()
    hooksets = [tree.hookset(envoy._module, envoy.path)]
    hooksets += [tree.hookset(module, path) for module, path in envoy._standalone_modules()]
    # The tree keeps hook sets weakly (it is shared by every envoy, and a held child envoy
    # must not keep the model alive); the envoy that runs them keeps them for the next run.
    object.__setattr__(envoy, "_hooksets", hooksets)
    run = Run([edit.spawn() for edit in envoy._edits] + list(workers or ()), batcher, hooksets)
    result = None
    entered: list = []
    displaced = backward.install()
    try:
        for hooks in hooksets:
            hooks.__enter__()
            entered.append(hooks)
        tree.run = run
        try:
            run.start()
            try:
                result = fn(*args, **kwargs)
                run.handle("result", result)
            except EarlyStopException:
                pass  # tracer.stop(): the forward ends here, what was read is kept
            tree.run = None
            run.finish()
        except EarlyStopException:
            pass  # a block stopped before the model started
    finally:
        tree.run = None
        try:
            run.cancel()
        finally:
            try:
                run.detach()
            finally:
                for hooks in reversed(entered):
                    hooks.__exit__(None, None, None)
                backward.restore(displaced)
    return result
