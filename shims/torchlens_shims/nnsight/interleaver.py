"""The model side of a run: module hooks hand each value to the parked workers.

A `Run` owns the workers of one traced call and the per-location visit counts.
A module's ``{path}.input`` reaches `Run.handle` through TorchLens's
`ModuleHooks` (a pre callback); its ``{path}.output`` is handed over by its gate
(below) as the forward returns — as real nnsight's controller does, inside the
module's own hooks — so a read costs no hook and keeps the module on PyTorch's
fast call path (a post hook is the fallback for a module whose gate was taken
out of its slot). `Run.handle` serves the workers parked there and returns the
value, replaced if a worker wrote it.

Hooks are attached lazily, per module, the first time a block asks for one of
its locations (or a cache subscribes to it): a hooked module leaves PyTorch's
fast call path, so hooking all of a 12-layer model to read one block would cost
more than the read. What makes lazy attachment exact is the *gate*: skipping a
module cannot be done from a hook (PyTorch binds ``forward`` before the pre hooks
run), so every module gets a pass-through gate in its instance ``forward`` slot
for the run, placed by TorchLens's `ForwardSlots`. The gate asks ``{path}.skip`` on every call — which also counts the
module's visits — so a module hooked late starts with the right visit counts,
and a module asked for while its own forward is already running (fast path, no
post hook to come) has its output handed over by its gate instead. Hooks
(`ModuleHooks`) and gates (`ForwardSlots`) are all removed when the run ends,
whatever happened inside it: the shim itself never touches a module's hooks or slots.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from greenlet import GreenletExit
from torch import nn
from torch.nn.modules import module as torch_module

from torchlens.capture.hooks import ForwardSlots, ModuleHooks

from ._unsupported import Interleaver, Mediator
from ._worker import BARRIER, Event, Pending, Worker
from .errors import BarrierError, OutOfOrderError

if TYPE_CHECKING:
    from .batching import Batcher

__all__ = [
    "NO_SKIP",
    "EarlyStopException",
    "Event",
    "HookSet",
    "Interleaver",
    "Mediator",
    "OutOfOrderError",
    "Pending",
    "Run",
    "Site",
    "Tree",
]

NO_SKIP = object()


class EarlyStopException(Exception):
    """Raised by ``tracer.stop()``; ends the forward early and is swallowed by the trace."""


class Run:
    """The workers of one traced call, fed location by location."""

    # Slots: every gate reads several of these on every module call.
    __slots__ = (
        "workers", "batcher", "counts", "parked", "observers", "thread", "owner", "hooksets",
        "hooked", "attached", "deliver", "once", "stack", "hooked_mid_call", "skipping", "drilled",
    )

    def __init__(self, workers: list[Worker], batcher: Batcher | None, hooksets: list[HookSet] = ()) -> None:
        self.workers = workers
        self.batcher = batcher
        self.counts: dict[str, int] = {}
        self.parked: set[str] = set()
        self.observers: dict[str, list] = {}
        self.thread = threading.get_ident()
        # The thread whose module calls this run serves: its own, or none while a
        # block calls a module off the record (`Envoy.__call__`).
        self.owner: int | None = self.thread
        self.hooksets = list(hooksets)
        self.hooked: set[str] = set()  # locations whose module hook is attached
        self.attached: list[ModuleHooks] = []
        # Modules whose gate hands their output over (id -> location); those in
        # `once` only for the call running now (a post hook serves the rest).
        self.deliver: dict[int, str] = {}
        self.once: set[int] = set()
        self.stack: list[int] = []  # modules whose forward is running (pushed by their gates)
        self.hooked_mid_call: set[int] = set()  # modules first hooked while their forward ran
        # `.source` operations drilled into this run (op path -> the instrumented callable
        # that call runs instead, and its Compiled): see `source.SourceOp.source`
        self.drilled: dict[str, tuple] = {}
        self.skipping: int | None = None  # module whose skip check is serving a block

    def ensure(self, location: str) -> None:
        """Make sure the module behind ``location`` (if it is one) is hooked for this run."""
        if location in self.hooked:
            return
        for hookset in self.hooksets:
            site = hookset.sites.get(location)
            if site is not None:
                hookset.attach(self, site, location)
                return

    def detach(self) -> None:
        """Remove every hook this run attached."""
        attached, self.attached = self.attached, []
        error = None
        for hooks in reversed(attached):
            try:
                hooks.__exit__(None, None, None)
            except BaseException as exc:  # noqa: BLE001 - remove the rest first
                error = error or exc
        self.hooked.clear()
        self.deliver.clear()
        self.once.clear()
        self.hooked_mid_call.clear()
        if error is not None:
            raise error

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
                    self.ensure(location)
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


class Site:
    """One module of a hook set, the locations it serves, and its reusable hooks and gate."""

    __slots__ = ("module", "input", "output", "skip", "hooks_in", "hooks_out", "gate", "body", "__weakref__")

    def __init__(self, module: nn.Module, location: str) -> None:
        self.module = module
        self.input = f"{location}.input"
        self.output = f"{location}.output"
        self.skip = f"{location}.skip"
        self.hooks_in: ModuleHooks | None = None
        self.hooks_out: ModuleHooks | None = None
        self.gate: Callable | None = None
        self.body: Callable | None = None  # what the gate runs: the forward, or its sourced copy


class Tree:
    """State shared by every envoy of one wrapped model: the run in progress, the hook sets."""

    def __init__(self) -> None:
        self.envoys: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.run: Run | None = None
        # id(module) -> its hook set, weakly: the envoy that ran it keeps it (see `drive`)
        self._hooksets: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        # id(module) -> (bound recompiled forward, its Compiled), see `source`
        self.sourced: dict[int, tuple[Any, Any]] = {}

    def source_installed(self, module: nn.Module) -> None:
        """A module was just sourced: if a run is going, its gate runs the new body from now on."""
        if self.run is None:
            return
        for hooks in self._hooksets.values():
            for site in hooks.all_sites:
                if site.module is module and site.body is not None:
                    site.body = self.sourced[id(module)][0]

    def hookset(self, module: nn.Module, path: str) -> HookSet:
        """The (cached) hook set for ``module`` addressed as ``path``, rebuilt if the tree changed."""
        hooks = self._hooksets.get(id(module))
        if hooks is None or hooks.module is not module or hooks.path != path or not hooks.current():
            hooks = self._hooksets[id(module)] = HookSet(self, module, path)
        return hooks


class HookSet:
    """Every module under ``module``: gates installed per run, hooks attached on demand."""

    def __init__(self, tree: Tree, module: nn.Module, path: str) -> None:
        # The tree owns its hook sets; a strong link back would be a cycle that keeps the
        # wrapped model alive until a cyclic GC pass (nnsight frees it by refcounting alone).
        self._tree = weakref.ref(tree)
        self.module = module
        self.path = path
        self.sites: dict[str, Site] = {}
        self.all_sites: list[Site] = []
        for address, submodule in module.named_modules():
            site = Site(submodule, path if not address else f"{path}.{address}")
            self.all_sites.append(site)
            self.sites[site.input] = site
            self.sites[site.output] = site
        # Each module's children as they were, to notice a tree edited since. Most
        # modules are leaves: for them "still no children" is one truth test, done
        # for all of them at C speed by `any`, so only the rest keep a snapshot.
        self._leaves = [site.module._modules for site in self.all_sites if not site.module._modules]
        self._shape = [
            (site.module._modules, tuple(site.module._modules.values()))
            for site in self.all_sites
            if site.module._modules
        ]
        self._slots = ForwardSlots()

    @property
    def tree(self) -> Tree:
        return self._tree()

    def current(self) -> bool:
        """Whether no module of the tree gained, lost or swapped a child since this was built."""
        if any(self._leaves):
            return False
        for children, snapshot in self._shape:
            if len(children) != len(snapshot) or tuple(children.values()) != snapshot:
                return False
        return True

    def __enter__(self) -> HookSet:
        # TorchLens's slot layer puts the gates in and guarantees they all come out.
        tree = self.tree
        sourced = tree.sourced
        slots = self._slots
        try:
            for site in self.all_sites:
                gate = site.gate
                if gate is None:
                    gate = site.gate = _gate(tree, site)
                forward = slots.install(site.module, gate)
                entry = sourced.get(id(site.module)) if sourced else None
                site.body = forward if entry is None else entry[0]
                gate.__wrapped__ = forward  # generate() reads the forward's signature
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._slots.restore()
        for site in self.all_sites:
            site.body = None

    def attach(self, run: Run, site: Site, location: str) -> None:
        """Hook ``site``'s input or output now, starting its count where the gate has it."""
        module = site.module
        mid = id(module)
        run.hooked.add(location)
        done = run.counts.get(site.skip, 0)
        if run.skipping == mid:  # inside its skip check: input passed, output to come
            running, inputs, outputs = True, done + 1, done
        elif mid in run.stack:  # inside its forward
            running, inputs, outputs = True, done, done - 1
        else:
            running, inputs, outputs = False, done, done
        # Did this call of the module take PyTorch's fast path (no hooks when it began)?
        fast = running and (mid in run.hooked_mid_call or not _has_hooks(module))
        if running:
            run.hooked_mid_call.add(mid)
        if location == site.input:
            run.counts[location] = inputs
            hooks = site.hooks_in
            if hooks is None:
                hooks = site.hooks_in = ModuleHooks(module)
                hooks.on_input("", _pre_hook(self.tree, location))
        else:
            run.counts[location] = outputs
            if module.__dict__.get("forward") is site.gate:
                # The gate is in place: it hands every output over itself, which
                # keeps the module on PyTorch's fast call path and costs no hook.
                run.deliver[mid] = location
                return
            hooks = site.hooks_out
            if hooks is None:
                hooks = site.hooks_out = ModuleHooks(module)
                hooks.on_output("", _post_hook(self.tree, location))
            if fast:
                # Its forward is running on PyTorch's fast path: no post hook will
                # fire for this call, so the gate hands the output over itself.
                run.deliver[mid] = location
                run.once.add(mid)
        hooks.reset_counts()
        hooks.__enter__()
        run.attached.append(hooks)


def _has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )


def _pre_hook(tree: Tree, location: str) -> Callable:
    get_ident = threading.get_ident
    tree_ref = weakref.ref(tree)  # hooks live in the tree's sites: no strong link back

    def on_input(info: Any, args: tuple, kwargs: dict) -> Any:
        run = tree_ref().run
        if run is None or run.owner != get_ident():
            return None
        value = (args, kwargs)
        result = run.handle(location, value)
        if result is value:
            return None
        new_args, new_kwargs = result  # any pair, as nnsight unpacks it
        return tuple(new_args), dict(new_kwargs)

    return on_input


def _post_hook(tree: Tree, location: str) -> Callable:
    get_ident = threading.get_ident
    tree_ref = weakref.ref(tree)

    def on_output(info: Any, args: tuple, kwargs: dict, output: Any) -> Any:
        run = tree_ref().run
        if run is None or run.owner != get_ident():
            return None
        result = run.handle(location, output)
        return None if result is output else result

    return on_output


def _gate(tree: Tree, site: Site) -> Callable:
    get_ident = threading.get_ident
    skip = site.skip
    mid = id(site.module)
    no_skip = NO_SKIP
    # The gate is kept on its site, which the tree keeps: weak links back, no cycle.
    tree_ref = weakref.ref(tree)
    site_ref = weakref.ref(site)

    def gate(*args: Any, **kwargs: Any) -> Any:
        run = tree_ref().run
        if run is None or run.owner != get_ident():
            return site_ref().body(*args, **kwargs)
        if skip in run.parked:
            run.skipping = mid
            output = run.handle(skip, no_skip)
            run.skipping = None
        else:  # nobody skips it: just count the visit
            counts = run.counts
            counts[skip] = counts.get(skip, 0) + 1
            output = no_skip
        if output is no_skip:
            stack = run.stack
            stack.append(mid)
            output = site_ref().body(*args, **kwargs)
            stack.pop()
        deliver = run.deliver
        if deliver:
            location = deliver.get(mid)
            if location is not None:
                if mid in run.once:
                    run.once.discard(mid)
                    del deliver[mid]
                output = run.handle(location, output)
        return output

    return gate
