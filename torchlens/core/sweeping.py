"""``with trace.sweep():`` — forks edited in a plain loop, replayed together.

Inside the block, ``fork.do(site, edit)`` on a fork of the trace binds and checks the step,
then returns at once: the edit is queued, not replayed. Every queued fork is replayed in one
batched pass (the machinery of ``Trace.forks``: fresh forks whose edits change the same rows
walk the recorded graph once, their rows stacked per op) when the block ends, or as soon as
any of them is read, whichever comes first. Results equal each fork replayed alone (to float
rounding, as ``Trace.forks``).

A fork's own state (its values, substitutions, module outputs, recipe and applied edits: its
``changes``, a :class:`~torchlens.core.changes.ForkValues`) is held behind a :class:`SettledAttribute`
attribute: reading it on a queued fork first replays the block's queue. An edit that fails
when its fork is replayed leaves that fork as it was before the edit (and drops the later
edits queued on it); its error is raised once, at the first read of that fork, or when the
block ends if no read raised it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import EmptySelectionError, InvalidArgumentError
from .services import services
from .steps import REPLAY_MODES, Step

if TYPE_CHECKING:
    from .fork import Fork
    from .trace import Trace

__all__ = ["SettledAttribute", "SweepBlock", "check_batch_size"]


def check_batch_size(batch_size: Any) -> None:
    """Refuse a ``batch_size=`` (forks replayed together) that is not None or a whole number >= 1.

    Raises:
        InvalidArgumentError: anything else.
    """
    if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                   or batch_size < 1):
        raise InvalidArgumentError(f"batch_size= is a whole number of forks >= 1 (or None: all), got {batch_size!r}")


class SettledAttribute:
    """The fork attribute holding its own state (``changes``): reading it on a fork whose edits a sweep
    block queued replays the queue first (and raises the error a queued edit of that fork met)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, fork: Any, owner: type | None = None) -> Any:
        if fork is None:
            return self
        d = fork.__dict__
        if d.get("_deferred") is not None:
            settle(fork)
        return d[self.name]

    def __set__(self, fork: Any, value: Any) -> None:
        fork.__dict__[self.name] = value


def settle(fork: Fork) -> None:
    """Replay the sweep block queue ``fork`` waits on; raise the error its own queued edit met."""
    pending = fork.__dict__["_deferred"]
    if isinstance(pending, SweepBlock):
        pending.settle()
        pending = fork.__dict__["_deferred"]
    if isinstance(pending, BaseException):
        fork.__dict__["_deferred"] = None  # raised once, as fork.do would have
        raise pending


class _Queued:
    __slots__ = ("fork", "steps", "replay", "done")

    def __init__(self, fork: Fork, replay: str, done: int) -> None:
        self.fork = fork
        self.steps: list[Step] = []
        self.replay = replay
        self.done = done  # how many recipe steps the fork held when its first edit was queued


class SweepBlock:
    """The context ``trace.sweep()`` returns: queues ``fork.do`` on forks of ``trace`` and
    replays the queue together (see the module docstring)."""

    def __init__(self, trace: Trace, batch_size: int | None = None) -> None:
        check_batch_size(batch_size)
        self.trace = trace
        self.batch_size = batch_size
        self._queue: dict[int, _Queued] = {}
        self._failed: list[Fork] = []  # forks whose queued edit failed, until their error is raised
        self._used = False

    @property
    def queued(self) -> int:
        """How many forks wait to be replayed."""
        return len(self._queue)

    def __enter__(self) -> SweepBlock:
        if self._used:
            raise InvalidArgumentError("this sweep block was already entered; a block is entered once",
                                       remedy="Open a new one: with trace.sweep(): ...")
        if self.trace._sweeping is not None:
            raise InvalidArgumentError(
                f"trace {self.trace.name!r} is already in a sweep block; sweep blocks on one trace do not nest",
                remedy="Queue every fork in the outer block (forks of other traces may open their own).")
        self._used = True
        self.trace._sweeping = self
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.trace._sweeping = None
        if exc_type is not None:
            return False  # the queue is replayed lazily, at the first read of one of its forks
        self.settle()
        for fork in self._failed:  # the first queued edit's error no read raised yet
            if isinstance(fork.__dict__["_deferred"], BaseException):
                self._failed = []
                settle(fork)
        return False

    def defer(self, fork: Fork, step: Step, replay: str) -> Fork:
        """Queue ``step`` (bound, replay phase) on ``fork`` (a fork of this block's trace)."""
        if replay not in REPLAY_MODES:
            raise InvalidArgumentError(f"replay= is one of {REPLAY_MODES}, got {replay!r}")
        fork.require_op_graph("replaying an edit")
        if not step.site.match(fork):
            raise EmptySelectionError(f"{step.site.describe()} matches nothing in this trace",
                                      site=step.site.describe())
        queued = self._queue.get(id(fork))
        if queued is not None and queued.replay != replay:  # one replay= per fork's batch: replay the queue first
            self.settle()
            queued = None
        if queued is None:
            done = len(fork.recipe)  # (settles an earlier block's queue the fork waits on)
            queued = self._queue[id(fork)] = _Queued(fork, replay, done)
            fork.__dict__["_deferred"] = self
        queued.steps.append(step)
        return fork

    def settle(self) -> None:
        """Replay every queued fork, together; each fork whose edit failed keeps its error, raised
        at its first read (or when the block ends)."""
        queue = list(self._queue.values())
        self._queue = {}
        for q in queue:
            q.fork.__dict__["_deferred"] = None
        by_mode: dict[str, list[_Queued]] = {}
        for q in queue:
            by_mode.setdefault(q.replay, []).append(q)
        for mode, group in by_mode.items():
            try:
                errors = services().replay_many([q.fork for q in group], [q.steps for q in group], check=False,
                                                replay=mode, batch_size=self.batch_size, collect_errors=True)
            except BaseException:
                # interrupted (or a bug): the forks not fully replayed wait again with the steps they lack
                for q in (q for g in by_mode.values() for q in g):
                    rest = q.steps[len(q.fork.recipe) - q.done:]
                    if q.fork.__dict__["_deferred"] is None and rest:
                        q.steps = rest
                        q.done = len(q.fork.recipe)
                        self._queue[id(q.fork)] = q
                        q.fork.__dict__["_deferred"] = self
                raise
            for q, err in zip(group, errors):
                if err is not None:
                    q.fork.__dict__["_deferred"] = err
                    self._failed.append(q.fork)
            by_mode[mode] = []  # done: an interruption of a later mode leaves these alone
