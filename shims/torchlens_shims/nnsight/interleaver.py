"""The model side of a run: module hooks hand each value to the parked workers.

A `Run` owns the workers of one traced call and the per-location visit counts.
`HookSet` attaches TorchLens's `ModuleHooks` to every module of a tree for the
duration of the call; each module call reports ``{path}.input`` (pre hook) and
``{path}.output`` (post hook) to `Run.handle`, which serves the workers parked
there and returns the value, replaced if a worker wrote it.

Skipping a module cannot be done from a hook (PyTorch binds ``forward`` before
the pre hooks run), so `HookSet` also puts a pass-through gate in each module's
instance ``forward`` slot while the run lasts, asking ``{path}.skip`` before the
real forward; both the hooks and the gates are removed when the run ends,
whatever happened inside it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from greenlet import GreenletExit
from torch import nn

from torchlens.capture.hooks import ModuleHooks

from .errors import BarrierError, OutOfOrderError
from .worker import BARRIER, Worker

if TYPE_CHECKING:
    from .batching import Batcher

NO_SKIP = object()


class EarlyStopException(Exception):
    """Raised by ``tracer.stop()``; ends the forward early and is swallowed by the trace."""


class Run:
    """The workers of one traced call, fed location by location."""

    def __init__(self, workers: list[Worker], batcher: Batcher | None) -> None:
        self.workers = workers
        self.batcher = batcher
        self.counts: dict[str, int] = {}
        self.parked: set[str] = set()
        self.observers: dict[str, list] = {}
        self.suspended = 0
        self.thread = threading.get_ident()

    def start(self) -> None:
        """Run every block up to its first request, then index who waits where."""
        for worker in self.workers:
            if worker.glet is None:
                worker.start(self)
        self.reindex()

    def reindex(self) -> None:
        self.observers = {}
        for worker in self.workers:
            for cache in worker.caches:
                for location, selected in cache.subscriptions().items():
                    self.observers.setdefault(location, []).append((worker, cache, selected))
        self._reindex_parked()

    def _reindex_parked(self) -> None:
        self.parked = {
            pending.location
            for worker in self.workers
            if (pending := worker.pending) is not None and pending.location is not None
        }

    def _ready(self, location: str) -> list[Worker]:
        return [
            worker
            for worker in self.workers
            if (pending := worker.pending) is not None
            and pending.location == location
            and pending.occurrence == worker.occurrence(location)
        ]

    def handle(self, location: str, value: Any) -> Any:
        """Serve this visit of ``location`` to the workers waiting for it; return the value."""
        occurrence = self.counts.get(location, 0)
        observers = self.observers.get(location)
        if location not in self.parked and not observers:
            self.counts[location] = occurrence + 1
            return value
        served = False
        stopped = None
        # Serving one worker can release another into waiting here (a barrier),
        # so keep going until nobody is left for this visit.
        while ready := self._ready(location):
            served = True
            for worker in ready:
                try:
                    value = worker.serve(location, value)
                except EarlyStopException as stop:
                    # Finish the visit (count, cache, serve the others) first.
                    stopped = stop
                    worker.pending = None
        if served:
            self._reindex_parked()
        self.counts[location] = occurrence + 1
        batcher = self.batcher
        if batcher is not None:
            value = batcher.assemble_skip(value)
        if observers:
            for worker, cache, selected in observers:
                seen = value if batcher is None else batcher.narrow(value, worker.group)
                cache.record(selected, seen)
        if stopped is not None:
            raise stopped
        return value

    def finish(self) -> None:
        """The call returned: tell every worker still parked why it will never be served."""
        for worker in self.workers:
            if not worker.alive:
                continue
            error, warning = _dangling(worker)
            try:
                worker.throw(error)
            except BaseException as thrown:
                if warning is None or thrown is not error:
                    raise
                warnings.warn(warning, stacklevel=2)

    def cancel(self) -> None:
        """Unwind any worker still parked (the forward raised) and drop every reference."""
        for worker in self.workers:
            if worker.alive:
                try:
                    worker.throw(GreenletExit())
                except BaseException as thrown:  # noqa: BLE001 - the run's own error matters more
                    warnings.warn(
                        f"an intervention block raised {thrown!r} while it was being unwound at the "
                        "end of the run; reported here so it cannot hide the error that ended the run",
                        stacklevel=2,
                    )
            worker.glet = None
            worker.run = None
        self.observers = {}
        self.parked = set()


def _dangling(worker: Worker) -> tuple[BaseException, str | None]:
    pending = worker.pending
    if pending is None or pending.kind == BARRIER:
        return (
            BarrierError("a barrier was never reached by every block it waits for; check its count"),
            None,
        )
    error = OutOfOrderError(
        f"'{pending}' was requested but the model already ran past it",
        location=pending.location,
        occurrence=pending.occurrence,
    )
    if worker.iteration == 0:
        return error, None
    return error, (
        f"'{pending}' was never reached: the loop asked for a step the run did not make, so it was "
        "cut short — values saved inside the loop are kept, and the statements after it did not "
        "run. An open `tracer.iter[:]` / `tracer.all()` loop ends this way by design. To hold a "
        "generation to a bounded loop's count, pass `min_new_tokens=`; put what follows the loop "
        "in a separate `tracer.invoke()`."
    )


class Tree:
    """State shared by every envoy of one wrapped model: the run in progress, the hooks."""

    def __init__(self) -> None:
        import weakref

        self.envoys: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.run: Run | None = None
        self._hooksets: dict[int, HookSet] = {}

    def hookset(self, module: nn.Module, path: str) -> HookSet:
        """The (cached) hooks for ``module`` addressed as ``path``, rebuilt if it changed."""
        names = [(name, id(mod)) for name, mod in module.named_modules()]
        hooks = self._hooksets.get(id(module))
        if hooks is None or hooks.names != names or hooks.module is not module or hooks.path != path:
            hooks = self._hooksets[id(module)] = HookSet(self, module, path, names)
        return hooks


class HookSet:
    """ModuleHooks on every submodule of ``module`` plus skip gates, reused across runs."""

    def __init__(self, tree: Tree, module: nn.Module, path: str, names: list) -> None:
        self.module = module
        self.path = path
        self.names = names
        self.hooks = ModuleHooks(module)
        self.gated: list[tuple[nn.Module, str]] = []
        for address, submodule in module.named_modules():
            location = path if not address else f"{path}.{address}"
            self.hooks.on_input(address, _pre_hook(tree, f"{location}.input"))
            self.hooks.on_output(address, _post_hook(tree, f"{location}.output"))
            self.gated.append((submodule, f"{location}.skip"))
        self._saved: list[tuple[nn.Module, bool, Any]] = []
        self._tree = tree

    def __enter__(self) -> HookSet:
        self.hooks.reset_counts()
        self.hooks.__enter__()
        try:
            tree = self._tree
            for submodule, location in self.gated:
                own = submodule.__dict__
                had = "forward" in own
                self._saved.append((submodule, had, own.get("forward")))
                own["forward"] = _gate(tree, location, submodule.forward)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            for submodule, had, previous in reversed(self._saved):
                if had:
                    submodule.__dict__["forward"] = previous
                else:
                    submodule.__dict__.pop("forward", None)
            self._saved.clear()
        finally:
            self.hooks.__exit__(*exc)


def _pre_hook(tree: Tree, location: str) -> Callable:
    def on_input(info: Any, args: tuple, kwargs: dict) -> Any:
        run = tree.run
        if run is None or run.suspended or run.thread != threading.get_ident():
            return None
        value = (args, kwargs)
        result = run.handle(location, value)
        return None if result is value else result

    return on_input


def _post_hook(tree: Tree, location: str) -> Callable:
    def on_output(info: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        run = tree.run
        if run is None or run.suspended or run.thread != threading.get_ident():
            return None
        result = run.handle(location, output)
        return None if result is output else result

    return on_output


def _gate(tree: Tree, location: str, forward: Callable) -> Callable:
    import functools

    @functools.wraps(forward)
    def gate(*args: Any, **kwargs: Any) -> Any:
        run = tree.run
        if run is None or run.suspended or run.thread != threading.get_ident():
            return forward(*args, **kwargs)
        replacement = run.handle(location, NO_SKIP)
        if replacement is NO_SKIP:
            return forward(*args, **kwargs)
        return replacement

    return gate
