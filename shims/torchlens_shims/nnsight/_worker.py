"""A lifted block running as a cooperative worker fed by the model's forward.

Each block (a trace body, an invoke body, a stored edit) runs in its own
greenlet. It runs until it asks for a value the model has not produced yet,
then *parks*: it switches back to whoever resumed it (the model side, inside a
module hook) naming a `Pending` request — read a location, replace it, skip a
module, or wait at a barrier. When the forward reaches that location the run
resumes the worker with the value, and the worker runs on to its next request.

Because the worker and the model take strict turns on one thread there are no
locks; a worker asking for something the model already went past simply stays
parked until the run ends, which is when it is told (``OutOfOrderError``).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

from greenlet import getcurrent, greenlet

from .errors import NotInterleavingError

if TYPE_CHECKING:
    from ._blocks import BlockScope
    from .interleaver import Run

__all__ = [
    "BARRIER",
    "Event",
    "SKIP",
    "SWAP",
    "VALUE",
    "Pending",
    "Worker",
    "current",
    "held_view",
    "hold_view",
    "in_worker",
    "read",
    "request",
    "skip",
    "wait_at_barrier",
    "write",
]

VALUE = "value"
SWAP = "swap"
SKIP = "skip"
BARRIER = "barrier"


class Event:
    """The kinds of request a parked block makes (nnsight's ``interleaver.Event``)."""

    VALUE = VALUE
    SWAP = SWAP
    SKIP = SKIP
    BARRIER = BARRIER


class Pending(NamedTuple):
    """What a parked worker waits for: ``kind`` at ``location``, its ``occurrence``-th visit."""

    kind: str
    location: str | None
    occurrence: int | None = None
    value: Any = None

    def __str__(self) -> str:
        return f"{self.location}.i{self.occurrence}"


class Worker:
    """One block's greenlet and its bookkeeping for one run.

    ``iteration`` is the occurrence a request is pinned to: ``0`` (the first visit)
    unless ``tracer.iter`` moved it, ``None`` once relaxed (the next visit the
    model has not made yet). ``group`` is the block's ``[start, size]`` rows in a
    batched forward, or ``None`` for a whole-batch block.
    """

    __slots__ = (
        "code", "scope", "group", "replay", "run", "glet", "pending", "iteration", "base",
        "caches", "held", "__weakref__",
    )

    def __init__(self, code: Any, scope: BlockScope, group: list | None = None, replay: bool = False):
        self.code = code
        self.scope = scope
        self.group = group
        self.replay = replay
        self.run: Run | None = None
        self.glet: greenlet | None = None
        self.pending: Pending | None = None
        self.iteration: int | None = 0
        self.base: dict[str, int] = {}
        self.caches: list = []
        # an eproperty view waiting to be written back: (eprop, location, occurrence, view, fn)
        self.held: tuple | None = None

    # -- model side -------------------------------------------------------------
    def _main(self) -> None:
        scope = self.scope.fork() if self.replay else self.scope
        exec(self.code, scope)
        _flush(self)

    @property
    def alive(self) -> bool:
        return bool(self.glet)

    def start(self, run: Run) -> None:
        """Create the greenlet and run the block up to its first request."""
        self.run = run
        self.iteration = 0
        self.base = dict(run.counts)
        self.caches = []
        self.held = None
        glet = greenlet(self._main)
        glet.shim_worker = weakref.ref(self)
        self.glet = glet
        self.pending = self.resume()

    def resume(self, *args: Any) -> Any:
        """Switch into the worker; return what it parks on next (``None`` when done)."""
        glet = self.glet
        glet.parent = getcurrent()
        try:
            return glet.switch(*args)
        except BaseException as error:
            # Keep the block's own frames before the model's stack piles on top.
            try:
                if getattr(error, "_shim_block_tb", None) is None:
                    error._shim_block_tb = error.__traceback__
            except AttributeError:
                pass
            finally:
                # this frame is in the error's traceback: holding the error here would be a
                # cycle keeping the block's values (and the model) alive until a GC pass
                del error
            raise

    def throw(self, error: BaseException) -> Any:
        glet = self.glet
        glet.parent = getcurrent()
        return glet.throw(error)

    def occurrence(self, location: str) -> int:
        """How many times the model reached ``location`` since this worker started."""
        return self.run.counts.get(location, 0) - self.base.get(location, 0)

    def wanted(self, location: str) -> int:
        return self.iteration if self.iteration is not None else self.occurrence(location)

    def serve(self, location: str, value: Any) -> Any:
        """Answer every request this worker makes at this visit of ``location``."""
        pending = self.pending
        if pending is None or pending.location != location:
            return value
        occurrence = self.occurrence(location)
        batcher = self.run.batcher
        while pending is not None and pending.location == location and pending.occurrence == occurrence:
            if self.iteration and pending.occurrence == self.iteration:
                # The first hit of a pinned step > 0 relaxes the pin, so the rest
                # of that step's requests follow the model in order (a held view's
                # write-back, swapped in at an earlier step, is no hit of this one).
                self.iteration = None
            kind = pending.kind
            if kind == VALUE:
                served = value if batcher is None else batcher.narrow(value, self.group)
                self.pending = self.resume(served)
            elif kind == SWAP:
                value = pending.value if batcher is None else batcher.widen(value, self.group, pending.value)
                self.pending = self.resume()
            elif kind == SKIP:
                value = (
                    pending.value if batcher is None else batcher.gather_skip(value, self.group, pending.value)
                )
                self.pending = self.resume()
            else:  # pragma: no cover - barriers name no location
                break
            pending = self.pending
        return value


# -- block side -------------------------------------------------------------------


def current(what: str) -> Worker:
    """The worker whose block is running now, or a NotInterleavingError naming ``what``."""
    ref = getattr(getcurrent(), "shim_worker", None)
    worker = ref() if ref is not None else None
    if worker is None:
        raise NotInterleavingError(f"cannot access `{what}` outside of interleaving")
    return worker


def in_worker() -> bool:
    return getattr(getcurrent(), "shim_worker", None) is not None


def _flush(worker: Worker) -> None:
    """Swap a held eproperty view back in at the visit it was read at (the model still waits there)."""
    held = worker.held
    if held is not None:
        worker.held = None
        _, location, occurrence, _, fn = held
        getcurrent().parent.switch(Pending(SWAP, location, occurrence, fn()))


def hold_view(eprop: Any, location: str, view: Any, fn: Any) -> None:
    """Keep ``view`` (read through ``eprop``) to write back with ``fn()`` before the block's next request."""
    worker = current(location)
    worker.held = (eprop, location, worker.wanted(location), view, fn)


def held_view(eprop: Any, location: str) -> tuple | None:
    """``(view,)`` when the running block still holds a view of this read, else ``None``."""
    worker = current(location)
    held = worker.held
    if held is not None and held[0] is eprop and held[1] == location and held[2] == worker.wanted(location):
        return (held[3],)
    return None


def request(kind: str, location: str, value: Any = None) -> Any:
    """Park the running block until the model serves ``kind`` at ``location``."""
    worker = current(location)
    if worker.held is not None:
        _flush(worker)
    worker.run.ensure(location)
    occurrence = worker.wanted(location)
    return getcurrent().parent.switch(Pending(kind, location, occurrence, value))


def read(location: str) -> Any:
    return request(VALUE, location)


def write(location: str, value: Any) -> None:
    request(SWAP, location, value)


def skip(location: str, value: Any) -> None:
    request(SKIP, location, value)


def wait_at_barrier() -> None:
    worker = current("barrier")
    if worker.held is not None:
        _flush(worker)
    getcurrent().parent.switch(Pending(BARRIER, None))
