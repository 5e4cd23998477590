"""The replay engine: one loop over the recorded ops, one ``run_op`` seam, a chain of strategies.

Shaped like ``torch.fx.Interpreter``: :meth:`Engine.run` walks the recorded graph once, position
by position, for every fork it replays (a *run*, :class:`~torchlens.edit.replay.Replayer`: the
fork's steps, changed values, data reads and replay log). At each op some runs reach (they read a
value their edit changed), :meth:`Engine.run_op` offers the op to the strategies in order; each
strategy is one way of recomputing an op (see ``docs/replay-engine.md`` for the table):

* ``read``: only the elements a patching metric reads of the final ``linear`` (``edit/reads``);
* ``sweep``: the changed rows of several fresh forks stacked, the op run once on all of them
  (``edit/_sweep``);
* ``row batch``: each fork's changed rows, collected across forks and run as one call
  (``edit/_batch``);
* ``rows``: the changed rows of one fork (``edit/_slicing``'s rules);
* ``whole``: the whole value of one fork, from its recorded arguments.

A strategy says *before it runs* what it cannot do for this op (:meth:`Strategy.cannot`); the
engine records each refusal with its reason in the fork's replay record (``ReplayLog.decisions``,
``TORCHLENS_STRICT_FALLBACKS=1`` makes it raise, see ``edit/_fallbacks``) and offers the op to
the next. A refusal that is no fallback (the op is simply not of the strategy's kind, say an
in-place op for ``rows``) is the empty reason :data:`NOT_MINE`, not recorded. What no strategy
can do (an op drawing random numbers) fails the fork with ``ReplayNotExactError``. Re-execution,
the last way, is the caller's: a fork whose edit changes a guard is handed back with its
``GuardChangedError`` and ``replay_step`` decides (``replay=``).

No fallback is a caught exception. An error while replaying one fork fails that fork alone (it is
restored and its error handed back in its place); an unexpected error inside a strategy working
on several forks at once propagates, every fork restored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._collector import GcPause
from ..core.records import INPUT, RANDOM, Op
from ..core.steps import Step
from ..errors import ReplayFallbackError, ReplayNotExactError, TorchLensError
from ._execute import EVAL_REMEDY, REEXECUTE, refuse_reason
from ._fallbacks import declare
from ._replay_run import Replayer, Target

__all__ = ["NOT_MINE", "Engine", "Strategy"]

NOT_MINE = ""  # a refusal that is no fallback: the op is not of this strategy's kind (not recorded)


class Strategy:
    """One way of recomputing an op, offered each op some runs reach (:meth:`Engine.run_op`).

    Subclasses set ``name`` (as the replay record names it) and implement :meth:`cannot` and
    :meth:`run_op`; a strategy working on several runs at once also :meth:`groups` them, and one
    holding work back runs it in :meth:`flush`.
    """

    name = ""
    alone = True  # it recomputes an op for one run at a time (an error there is that run's); False: several

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def groups(self, op: Op, runs: list[Replayer]) -> list[list[Replayer]]:
        """The groups of ``runs`` this strategy would recompute ``op`` for, each in one go (a run
        in none is passed on untouched). Default: each run alone."""
        return [[r] for r in runs]

    def cannot(self, op: Op, runs: list[Replayer]) -> str | None:
        """Why this strategy cannot recompute ``op`` for ``runs`` (None: it can; :data:`NOT_MINE`:
        not its kind of op, no fallback). Asked before :meth:`run_op`, changes nothing."""
        raise NotImplementedError

    def run_op(self, op: Op, runs: list[Replayer]) -> None:
        """Recompute ``op`` for ``runs``: store each run's new value and log it."""
        raise NotImplementedError

    def flush(self) -> None:
        """Run what :meth:`run_op` held back (called once every op of a position is offered)."""

    def release(self, runs: list[Replayer]) -> None:
        """This strategy refused ``runs``: forget any state it keeps for them."""

    def drop(self, run: Replayer) -> None:
        """``run`` failed (its fork is restored): forget it."""

    def close(self) -> None:
        """The walk is over: let go of every run (state kept per run can hold forks in a cycle)."""


class Engine:
    """Replays one bound step per fork (``forks[i]`` gets ``steps[i]``, landing on ``targets[i]``)
    down the recorded graph in one walk; the forks share one trace's records.

    ``outcome[i]`` is fork ``i``'s run, or the error its replay met (the fork then restored).
    """

    def __init__(self, forks: Sequence[Any], steps: Sequence[Step], targets: Sequence[list[Target]], *,
                 sliced: bool = True, read: Any = None) -> None:
        self.forks = list(forks)
        self.runs: list[Replayer] = []
        self.outcome: list[Any] = []
        self.live: dict[Replayer, int] = {}  # run -> its fork's index, while it replays
        self._active: list[Replayer] = []
        self.chain: list[Strategy] = []
        self._handed: set[Replayer] = set()  # runs the strategy running an op handed on (hand_on)
        for i, (fork, step, found) in enumerate(zip(forks, steps, targets)):
            run = Replayer(fork, sliced=sliced, read=read)
            run.saved = fork.fork_state()
            fork.changes.add_step(step)
            self.runs.append(run)
            self.outcome.append(run)
            self.live[run] = i
            self.each(run, run.prepare, fork.recipe[-1], found)
        self._active = [r for r in self.runs if r in self.live]
        self._rewrites = any(r.rewrites for r in self.runs)  # some fork's memory was written through a view

    # -- the loop --------------------------------------------------------------------------------

    def run(self, build: Callable[[Engine], list[Strategy]]) -> list[Any]:
        """Walk the graph once for every live run, offering each op some reach to the strategies
        ``build(self)`` gives (in order; a strategy may prepare there, e.g. land every edit).

        Returns:
            per fork, its run (the fork holds its edit) or the error its replay met (the fork is
            as it was).
        """
        with GcPause():  # every record made meanwhile stays reachable from a fork (``torchlens._collector``)
            return self._run(build)

    def _run(self, build: Callable[[Engine], list[Strategy]]) -> list[Any]:
        try:
            chain = self.chain = build(self)
            holding = [s for s in chain if type(s).flush is not Strategy.flush]  # (those that hold work back)
            live = self._active
            if live:
                ops, end = live[0].ops, len(live[0].ops)
                alone = all(s.alone and type(s).groups is Strategy.groups for s in chain)
                with torch.set_grad_enabled(any(r.fork.grad for r in live)):
                    due = min(r.due for r in live)  # the next position where some run's step lands or read is checked
                    for j in range(min(r.start for r in live), end + 1):
                        if due <= j:
                            for r in self._active:  # (a failed run leaves: the list is replaced, not changed)
                                if r.due <= j:
                                    self.each(r, r.before, j)
                            due = min((r.due for r in self._active), default=math.inf)
                        if j == end:
                            for r in self._active:
                                self.each(r, r.finish)
                            break
                        op = ops[j]
                        if op.flags & INPUT:
                            continue
                        parents = None
                        reaching = []
                        for r in self._active:
                            if r.changed and r.start <= j:
                                if parents is None:
                                    parents = {ref.index for ref in op.parent_refs}
                                if r.reaches(op, parents):
                                    reaching.append(r)
                        if reaching:
                            if alone and len(reaching) == 1 and not self._rewrites:
                                self._run_alone(op, reaching)
                            else:
                                self.run_op(op, reaching)
                        for strategy in holding:
                            strategy.flush()
        except BaseException:  # interrupted, or an unexpected error: no fork is left half replayed
            for r in self.active():
                self.restore(r)
            raise
        finally:
            # the strategies hold the engine (and through it every fork and run): let go of them, so
            # the forks and their trace are freed when the caller drops them, not at the next GC
            for strategy in self.chain:
                strategy.close()
            self.chain = []
        return self.outcome

    def run_op(self, op: Op, runs: list[Replayer], after: Strategy | None = None) -> None:
        """Recompute ``op`` for ``runs``: the first strategy (of the chain, or of those after
        ``after``) that can takes each; each refusal is recorded with its reason."""
        why = refuse_reason(op)
        pending = runs
        if why or self._rewrites:
            for r in runs:
                reason = why or (r.refusal(op) if r.rewrites else None)
                if reason:
                    self.each(r, _refuse, op, reason)
            pending = [r for r in runs if r in self.live]
        chain = self.chain if after is None else self.chain[self.chain.index(after) + 1:]
        for strategy in chain:
            if not pending:
                return
            rest: list[Replayer] = []
            seen: set[Replayer] = set()
            for group in strategy.groups(op, pending):
                seen.update(group)
                reason = strategy.cannot(op, group)
                if reason is None:
                    if strategy.alone:
                        self.each(group[0], strategy.run_op, op, group)
                    else:
                        self.each_of(group, strategy.run_op, op, group)
                    name, handed = strategy.name, self._handed
                    for r in group:
                        if handed and r in handed:  # handed on mid-run: the strategy that finished the op counted it
                            handed.discard(r)
                            continue
                        chosen = r.log.chosen
                        chosen[name] = chosen.get(name, 0) + 1
                    continue
                if reason:
                    self.decline(strategy, group, f"op {op.label} ({op.func_name}): {reason}")
                strategy.release(group)
                rest += group
            # (``seen`` holds runs of ``pending``: as many means every one was offered)
            pending = ([r for r in rest if r in self.live] if rest else []) \
                + ([r for r in pending if r not in seen] if len(seen) < len(pending) else [])
        for r in pending:  # (the last strategy, ``whole``, takes every op the engine did not refuse)
            self.each(r, _refuse, op, f"op {op.label} ({op.func_name}) at {op.source}: no replay strategy takes it")

    def _run_alone(self, op: Op, runs: list[Replayer]) -> None:
        """:meth:`run_op` for one run when every strategy of the chain works on one run at a time
        and its memory was not written through a view (the common single-fork replay): the same
        offers, refusals and record, without grouping."""
        why = refuse_reason(op)
        run = runs[0]
        if why:
            self.each(run, _refuse, op, why)
            return
        for strategy in self.chain:
            reason = strategy.cannot(op, runs)
            if reason is None:
                self.each(run, strategy.run_op, op, runs)
                if run not in self.live:  # it failed: its fork is restored, its error handed back
                    return
                if run in self._handed:  # it handed the op on: the strategy that finished it counted it
                    self._handed.discard(run)
                    return
                chosen = run.log.chosen
                chosen[strategy.name] = chosen.get(strategy.name, 0) + 1
                return
            if reason:
                self.decline(strategy, runs, f"op {op.label} ({op.func_name}): {reason}")
            strategy.release(runs)
            if run not in self.live:
                return
        self.each(run, _refuse, op, f"op {op.label} ({op.func_name}) at {op.source}: no replay strategy takes it")

    def hand_on(self, strategy: Strategy, op: Op, runs: list[Replayer], reason: str) -> None:
        """``strategy`` found, running ``op``, that it cannot finish it for ``runs`` (``reason``):
        record that and offer the op to the strategies after it."""
        self.decline(strategy, runs, f"op {op.label} ({op.func_name}): {reason}")
        self.run_op(op, runs, after=strategy)
        self._handed.update(runs)  # (after: the strategy that finished it counts it, this one not)

    def decline(self, strategy: Strategy, runs: list[Replayer], reason: str) -> None:
        """Record in each run's replay record that ``strategy`` refused it, and why.

        Raises:
            ReplayFallbackError: ``TORCHLENS_STRICT_FALLBACKS`` is set.
        """
        decision = declare(strategy.name, reason)
        for r in runs:
            r.log.decisions.append(decision)

    # -- runs ------------------------------------------------------------------------------------

    def active(self) -> list[Replayer]:
        """The runs still replaying, in order."""
        return self._active

    def each(self, run: Replayer, work: Any, *args: Any) -> None:
        """``work(*args)`` for ``run`` alone: an error fails that run (its fork restored, the error
        handed back in its place); a strict-mode fallback propagates."""
        try:
            work(*args)
        except ReplayFallbackError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed back as that fork's error (its outcome)
            self.fail(run, exc)

    def each_of(self, runs: list[Replayer], work: Any, *args: Any) -> None:
        """``work(*args)`` for several runs at once: a typed replay error fails each of them; any
        other error propagates (a bug in a strategy is never hidden by a slower path)."""
        try:
            work(*args)
        except ReplayFallbackError:
            raise
        except TorchLensError as exc:  # which run met it is not known: each fails with it (and replays alone)
            for r in runs:
                if r in self.live:
                    self.fail(r, exc)

    def fail(self, run: Replayer, exc: BaseException) -> None:
        """``run``'s replay met ``exc``: restore its fork and hand the error back in its place."""
        i = self.live.get(run)
        if i is None:
            return
        self.restore(run)
        self.outcome[i] = exc
        for strategy in self.chain:
            strategy.drop(run)

    def restore(self, run: Replayer) -> None:
        i = self.live.pop(run)
        self._active = [r for r in self._active if r is not run]
        fork = self.forks[i]
        fork.changes.restore_fork(run.saved, fork.unsaved_steps)


def _refuse(op: Op, reason: str) -> None:
    raise ReplayNotExactError(f"{reason}; replay would not reproduce it", op_label=op.label, source=op.source,
                              remedy=EVAL_REMEDY if op.flags & RANDOM else REEXECUTE)
