"""Replaying several forks of one trace together, their row recomputations stacked.

A sweep of edits (zero block ``i`` at the last position, for every ``i``; restore one clean
row per patching cell) replays each fork from its edit on, and a sliced replay recomputes
only a few rows per op. On a CPU a few rows of a ``linear`` cost what reading its weight
costs, whatever the row count: twelve forks each recomputing one row read every weight of
the blocks they reach twelve times. :func:`push_together` walks the forks' replayers in step,
op by op; every fork whose op is recomputed on some rows by a row rule (``linear``,
``addmm``, norms, elementwise ops ...; see :mod:`torchlens.edit._slicing`) hands over the call
instead of making it (:class:`RowBatch`), and the calls of one op are run as one, their rows
concatenated along the axis the rule cut them on, then split back per fork.

Stacking changes BLAS blocking, not what is computed: results equal each fork replayed alone
to float rounding (the tolerance of sliced replay). Attention is not stacked (each fork's
queries read its own keys and values); an op whose calls do not line up (different
functions, arguments that differ other than along the cut axis) runs once per fork.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from ..core.records import Op
from ..core.steps import Step
from ..core.sweeping import check_batch_size
from ..errors import EmptySelectionError, GuardChangedError, InvalidArgumentError, ValueNotSavedError
from ._fallbacks import declare
from ._regions import Plan
from ._slicing import StackedCall, collect_rows
from ._sweep import sweep
from .replay import REPLAY_MODES, Replayer, Target, check_against_forward, replay_step, unsaved_for_replay

__all__ = ["RowBatch", "push_all", "push_together", "replay_many"]

# Each fork's queries attend to its own keys, values and mask: stacking their rows would mix forks.
UNSTACKED = frozenset({"scaled_dot_product_attention"})
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_NO = object()  # a slot whose values cannot be stacked


class _Entry(NamedTuple):
    replayer: Replayer
    op: Op
    plan: Plan
    old: torch.Tensor
    call: StackedCall


class RowBatch:
    """The row recomputations of one op, handed over by several forks' replayers
    (:meth:`defer`) and run stacked (:meth:`flush`)."""

    def __init__(self) -> None:
        self.entries: list[_Entry] = []

    def defer(self, replayer: Replayer, op: Op, plan: Plan) -> bool:
        """Take ``replayer``'s recomputation of ``plan``'s rows of ``op`` (False: it runs it now)."""
        if op.func_name in UNSTACKED:
            return False
        old = replayer.row_base(op)
        if old is None:
            return False
        call = collect_rows(plan)
        if call is None:
            return False
        self.entries.append(_Entry(replayer, op, plan, old, call))
        return True

    def drop(self, replayer: Replayer) -> None:
        """Forget what ``replayer`` handed over (its fork failed and was restored)."""
        self.entries = [e for e in self.entries if e.replayer is not replayer]

    def flush(self, failed: Callable[[Replayer, BaseException], None]) -> None:
        """Run the held calls (stacked where they line up) and give each replayer its rows;
        an error while finishing one fork's op goes to ``failed(replayer, error)``."""
        entries, self.entries = self.entries, []
        if not entries:
            return
        stacked, note = None, ""
        if len(entries) > 1:
            lined = _line_up(entries)
            if isinstance(lined, str):
                decision = declare("row batch", f"op {entries[0].op.label} ({entries[0].op.func_name}): {lined}")
                for e in entries:
                    e.replayer.log.decisions.append(decision)
            else:
                stacked = _run_stacked(entries, *lined)
                note = f"stacked with {len(entries) - 1} other fork(s)"
        for k, entry in enumerate(entries):
            try:
                rows = stacked[k] if stacked is not None else entry.call.func(*entry.call.args, **entry.call.kwargs)
                if rows is None or not entry.replayer.finish_rows(entry.op, entry.plan, entry.old, rows, note):
                    entry.replayer.rerun_alone(entry.op)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, which restores that fork
                failed(entry.replayer, exc)


def _line_up(entries: list[_Entry]) -> tuple[list[Any], dict[str, Any]] | str:
    """The arguments of one call for every entry, each fork's rows concatenated along the cut
    axis (a string: why their calls do not line up)."""
    calls = [e.call for e in entries]
    first = calls[0]
    axis = entries[0].plan.region.axis
    if any(c.func is not first.func or len(c.args) != len(first.args) or c.kwargs.keys() != first.kwargs.keys()
           for c in calls):
        return "the forks' calls have other functions or arguments"
    if any(e.op is not entries[0].op or e.plan.region.axis != axis for e in entries):
        return "the forks cut other ops or axes"
    args = [_stack_slot(values, calls) for values in zip(*(c.args for c in calls))]
    kwargs = {key: _stack_slot([c.kwargs[key] for c in calls], calls) for key in first.kwargs}
    if any(v is _NO for v in (*args, *kwargs.values())):
        return "an argument differs between the forks other than along the cut axis"
    return args, kwargs


def _run_stacked(entries: list[_Entry], args: list[Any], kwargs: dict[str, Any]) -> list[Any]:
    """The one call :func:`_line_up` built, its output split back per entry (an entry's None:
    its op is recomputed whole, as ``finish_rows`` would refuse rows of another shape)."""
    axis = entries[0].plan.region.axis
    sizes = [e.old.shape[axis] - e.plan.region.start for e in entries]
    out = entries[0].call.func(*args, **kwargs)
    if not isinstance(out, torch.Tensor) or out.dim() <= axis or out.shape[axis] != sum(sizes):
        return [None] * len(entries)
    return list(out.split(sizes, dim=axis))


def _stack_slot(values: Sequence[Any], calls: list[StackedCall]) -> Any:
    """One argument for the stacked call from each fork's: the same object, equal plain values,
    or tensors cut along the same axis and equal elsewhere (concatenated along it)."""
    v0 = values[0]
    if all(v is v0 for v in values):
        return v0
    if all(isinstance(v, torch.Tensor) for v in values):
        axes = {c.axes.get(id(v)) for v, c in zip(values, calls)}
        if len(axes) != 1 or None in axes:
            return _NO
        a = axes.pop()
        for v in values:
            if v.dim() != v0.dim() or v.dtype != v0.dtype or v.device != v0.device \
                    or any(x != y for d, (x, y) in enumerate(zip(v.shape, v0.shape)) if d != a):
                return _NO
        return torch.cat(list(values), a)
    if all(_plain(v) for v in values) and all(v == v0 for v in values):
        return v0
    return _NO


def _plain(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def push_together(forks: Sequence[Any], steps: Sequence[Step], *, read: Any = None,
                  decisions: Sequence[Sequence[tuple[str, str]]] | None = None) -> list[Any]:
    """Push ``steps[i]`` (a bound replay step) down ``forks[i]``, every fork of the same trace,
    op by op in step, row recomputations stacked (:class:`RowBatch`).

    A fork whose replay raises is restored to what it was and its error returned in its place;
    the others go on.

    Args:
        forks: fresh forks of one trace (or forks sharing its records).
        steps: one bound replay step per fork.
        read: an ``OutputRead`` (``torchlens.edit.reads``) every fork computes only part of.
        decisions: per fork, the ``(strategy, reason)`` fallbacks that led here, for its replay record.

    Returns:
        per fork, its :class:`~torchlens.edit.replay.Replayer` (the fork now holds the edit),
        or the exception its replay raised (the fork is as it was).

    Raises:
        EmptySelectionError: a step's site matches nothing (raised before any fork changes).
    """
    targets = []
    for fork, step in zip(forks, steps):
        fork.require_op_graph("replaying an edit")
        records = step.site.match(fork)
        if not records:
            raise EmptySelectionError(f"{step.site.describe()} matches nothing in this trace",
                                      site=step.site.describe())
        targets.append([Target(r) for r in records])
    batch = RowBatch()
    outcome: list[Any] = [None] * len(forks)
    active: dict[int, tuple[Replayer, int]] = {}
    before = {}
    by_replayer: dict[int, int] = {}

    def failed(replayer: Replayer, exc: BaseException) -> None:
        i = by_replayer[id(replayer)]
        if i not in active:
            return
        del active[i]
        batch.drop(replayer)
        fork = forks[i]
        fork.changes.restore_fork(before[i], fork.unsaved_steps)
        outcome[i] = exc

    for i, (fork, step) in enumerate(zip(forks, steps)):
        before[i] = fork.fork_state()
        fork.changes.add_step(step)
        replayer = Replayer(fork, sliced=True, read=read)
        if decisions is not None:
            replayer.log.decisions.extend(decisions[i])
        replayer.batch = batch
        by_replayer[id(replayer)] = i
        outcome[i] = replayer
        try:
            active[i] = (replayer, replayer.prepare(fork.recipe[-1], targets[i]))
        except Exception as exc:  # noqa: BLE001 - that fork alone fails: its error is handed back in its place
            active[i] = (replayer, 0)
            failed(replayer, exc)
    if not active:
        return outcome
    n = max(len(r.ops) for r, _ in active.values())
    try:
        with torch.set_grad_enabled(any(f.grad for f in forks)):
            for j in range(min(start for _, start in active.values()), n + 1):
                for replayer, start in list(active.values()):
                    if start <= j <= len(replayer.ops):  # (forks of one trace share its ops)
                        try:
                            replayer.visit(j)
                        except Exception as exc:  # noqa: BLE001 - that fork alone fails: its error is handed back in its place
                            failed(replayer, exc)
                batch.flush(failed)
    except BaseException as exc:  # interrupted: no fork is left half replayed
        for replayer, _ in list(active.values()):
            failed(replayer, exc)
        raise
    return outcome


def push_all(forks: Sequence[Any], steps: Sequence[Step], *, read: Any = None, one_pass: bool = True) -> list[Any]:
    """:func:`push_together`, but fresh forks whose edits change the same rows as others first
    go down the graph in one pass per group (:func:`torchlens.edit._sweep.sweep`); the forks no
    sweep covers are then pushed in step. ``one_pass=False`` skips the sweep (forks that
    already hold edits: a sweep takes fresh forks only).

    Returns:
        per fork, its replayer or the exception its replay raised, as :func:`push_together`.
    """
    declined: dict[int, str] = {}
    got = sweep(forks, steps, read=read, declined=declined) if one_pass else None
    if got is None:
        got = [None] * len(forks)
    rest = [k for k, r in enumerate(got) if r is None]
    if rest:
        why = [[("sweep", declined[k])] if k in declined else [] for k in rest]
        for k, r in zip(rest, push_together([forks[k] for k in rest], [steps[k] for k in rest], read=read,
                                            decisions=why)):
            got[k] = r
    return got


def replay_many(forks: Sequence[Any], steps: Sequence[Sequence[Step]], *, rerun: Any, replay: str = "auto",
                check: bool = False, batch_size: int | None = None, collect_errors: bool = False) -> list[Any]:
    """Replay ``steps[i]`` (bound replay steps, in order) on ``forks[i]`` (fresh forks of one
    trace), ``batch_size`` forks at a time in step (:func:`push_together`: the first step of
    every fork together, then the second of those that have one ...). A fork whose edit changes
    a guard is handled alone, as ``fork.do(..., replay=replay)`` would (``rerun`` re-executes
    for a fallback).

    With ``collect_errors`` a fork's error does not stop the others: that fork is left as it was
    before its failing step (its later steps are not applied) and the error is returned in its place.

    Returns:
        the forks, each holding its edits; with ``collect_errors``, per fork the error its replay
        met (None: every step applied).

    Raises:
        InvalidArgumentError: an unknown ``replay`` or a ``batch_size`` below 1.
        GuardChangedError: a guard changed and no fallback was allowed or possible.
        ReplayNotExactError: the recorded graph cannot reproduce an edit exactly.
        EmptySelectionError: a site matches nothing in the trace.
    """
    if replay not in REPLAY_MODES:
        raise InvalidArgumentError(f"replay= is one of {REPLAY_MODES}, got {replay!r}")
    check_batch_size(batch_size)
    size = batch_size or max(1, len(forks))
    errors: list[BaseException | None] = [None] * len(forks)
    for k in range(0, len(forks), size):
        chunk = range(k, min(k + size, len(forks)))
        for r in range(max((len(steps[i]) for i in chunk), default=0)):
            now = [i for i in chunk if len(steps[i]) > r and errors[i] is None]
            # fresh forks first go in one pass per group changing the same rows (_sweep), the rest in step
            pushed = push_all([forks[i] for i in now], [steps[i][r] for i in now], one_pass=r == 0)
            for i, got in zip(now, pushed):
                err = _outcome(forks[i], steps[i][r], got, rerun, replay, collect_errors)
                if err is not None:
                    if not collect_errors:
                        raise err
                    errors[i] = err
        if check:
            for i in chunk:
                if errors[i] is None:
                    check_against_forward(forks[i])
    return errors if collect_errors else list(forks)


def _outcome(fork: Any, step: Step, got: Any, rerun: Any, replay: str, collect: bool) -> BaseException | None:
    """The error pushing ``step`` down ``fork`` ended with (``got``: what :func:`push_all` gave
    it), after a changed guard is handled alone, as ``fork.do(..., replay=replay)`` would."""
    if isinstance(got, GuardChangedError):
        if not collect:
            replay_step(fork, step, rerun=rerun, replay=replay)  # alone: falls back or raises
            return None
        try:
            replay_step(fork, step, rerun=rerun, replay=replay)
        except Exception as exc:  # noqa: BLE001 - handed back as that fork's error (collect_errors)
            return exc
        return None
    if isinstance(got, ValueNotSavedError):
        return unsaved_for_replay(fork, step, got)
    return got if isinstance(got, BaseException) else None
