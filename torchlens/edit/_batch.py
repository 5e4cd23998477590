"""Replaying several forks of one trace together, their row recomputations stacked.

A sweep of edits (zero block ``i`` at the last position, for every ``i``; restore one clean
row per patching cell) replays each fork from its edit on, and a sliced replay recomputes
only a few rows per op. On a CPU a few rows of a ``linear`` cost what reading its weight
costs, whatever the row count: twelve forks each recomputing one row read every weight of
the blocks they reach twelve times. :class:`RowBatch` is the replay engine's strategy for it
(``edit/_engine``): the engine walks every fork in step, op by op; every fork whose op is
recomputed on some rows by a row rule (``linear``, ``addmm``, norms, elementwise ops ...; see
:mod:`torchlens.edit._slicing`) hands the call to it instead of making it, and once the op has
been offered for every fork the calls are run as one, their rows concatenated along the axis
the rule cut them on, then split back per fork.

Stacking changes BLAS blocking, not what is computed: results equal each fork replayed alone
to float rounding (the tolerance of sliced replay). Attention is not stacked (each fork's
queries read its own keys and values); an op whose calls do not line up (different
functions, arguments that differ other than along the cut axis) runs once per fork.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..core.records import Op
from ._engine import NOT_MINE, Engine, Strategy
from ._regions import Plan
from ._replay_run import Replayer
from ._slicing import StackedCall, collect_rows

__all__ = ["RowBatch"]

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


class RowBatch(Strategy):
    """Batched row groups across forks: each fork's row recomputation of an op is held back
    (:meth:`run_op`) and the calls of one op run stacked (:meth:`flush`).

    Declares what the one-fork ``rows`` strategy declares (it recomputes the same rows), and takes
    only row recomputations whose call it can hold: not attention (each fork reads its own keys).
    """

    name = "row batch"

    def __init__(self, engine: Engine, rows: Strategy) -> None:
        super().__init__(engine)
        self.rows = rows  # the ``rows`` strategy: the same rules decide which rows
        self.entries: list[_Entry] = []
        self._call: tuple[int, StackedCall] | None = None  # the call cannot() collected, for run_op

    def cannot(self, op: Op, runs: list[Replayer]) -> str | None:
        if op.func_name in UNSTACKED:
            return NOT_MINE
        why = self.rows.cannot(op, runs)
        if why is not None:
            return why
        plan = runs[0].plan(op)[0]
        if plan.kind != "rows":  # skipped, or a shape op mapping its rows: nothing to batch
            return NOT_MINE
        call = collect_rows(plan)
        if call is None:
            return NOT_MINE  # its rule builds the rows some other way than one call
        self._call = (id(runs[0]), call)
        return None

    def run_op(self, op: Op, runs: list[Replayer]) -> None:
        run = runs[0]
        _, call = self._call  # type: ignore[misc]  # (cannot() collected it for this run just before)
        self.entries.append(_Entry(run, op, run.plan(op)[0], run.row_base(op), call))

    def drop(self, run: Replayer) -> None:
        self.entries = [e for e in self.entries if e.replayer is not run]

    def close(self) -> None:
        self.entries, self._call = [], None

    def flush(self) -> None:
        """Run the held calls (stacked where they line up) and give each fork its rows."""
        entries, self.entries = self.entries, []
        if not entries:
            return
        stacked, note = None, ""
        if len(entries) > 1:
            lined = _line_up(entries)
            if isinstance(lined, str):
                self.engine.decline(self, [e.replayer for e in entries],
                                    f"op {entries[0].op.label} ({entries[0].op.func_name}): {lined}")
            else:
                stacked = _run_stacked(entries, *lined)
                note = f"stacked with {len(entries) - 1} other fork(s)"
        for k, entry in enumerate(entries):
            self.engine.each(entry.replayer, self._finish, entry, None if stacked is None else stacked[k], note)

    def _finish(self, entry: _Entry, rows: Any, note: str) -> None:
        run, op = entry.replayer, entry.op
        if rows is None:
            rows = entry.call.func(*entry.call.args, **entry.call.kwargs)
        if not run.finish_rows(op, entry.plan, entry.old, rows, note):
            self.engine.hand_on(self, op, [run], "its rule's rows do not fit the recorded value")


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
