"""The replay strategies that recompute an op for one fork: only what a metric reads
(:class:`PartialRead`), the changed rows (:class:`ChangedRows`), the whole value
(:class:`WholeValue`). The engine (``edit/_engine``) offers them each op in that order, after
the strategies working on several forks at once (``edit/_sweep``, ``edit/_batch``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.records import EDIT, GUARD, INPLACE, Op
from ..core.tree import describe_shape, tensor_leaves
from ..errors import GuardChangedError, ReplayError
from ._engine import NOT_MINE, Strategy
from ._execute import ROW_VIEWS, UNINITIALISED, execute
from ._guards import changed_choice, index_leaves, same_value
from ._regions import WHOLE, Corner, Plan, RowPatch, Rows, refine_corner
from ._replay_run import Replayer

__all__ = ["ChangedRows", "PartialRead", "WholeValue", "check_path", "reissue"]


class PartialRead(Strategy):
    """Of the op a patching metric reads (``edit/reads.OutputRead``), only the row and columns it
    reads: one row of the LM head's ``linear``, not the whole vocabulary for every position."""

    name = "read"

    def __init__(self, engine: Any, read: Any) -> None:
        super().__init__(engine)
        self.read = read

    def cannot(self, op: Op, runs: list[Replayer]) -> str | None:
        if op.index != self.read.index:
            return NOT_MINE
        why = self.read.cannot(runs[0], op)
        return None if why is None else f"partial read: {why}"

    def run_op(self, op: Op, runs: list[Replayer]) -> None:
        self.read.compute(runs[0], op)


class ChangedRows(Strategy):
    """Only the rows of ``op`` the edit can reach (``edit/_slicing``'s per-op rules), kept beside
    its recorded value (a :class:`RowPatch`); a shape op maps a RowPatch's new rows alone; an op
    reading only unchanged rows is skipped."""

    name = "rows"

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        # what cannot() found for the op it accepted, for run_op: (op index, run, recorded value or view rows)
        self._ready: tuple[int, Replayer, Any] | None = None

    def cannot(self, op: Op, runs: list[Replayer]) -> str | None:
        run = runs[0]
        if not run.sliced or op.flags & (INPLACE | EDIT | GUARD) or op.func_name in UNINITIALISED:
            return NOT_MINE  # always recomputed whole: an in-place op writes its whole target
        if run.rewritten(op):
            return "it reads memory written through another view since: rebuilt whole"
        plan, args, kwargs, pending = run.plan(op)
        if plan.kind == "skip":
            return None
        if plan.kind == "rows":
            base = run.row_base(op)
            if base is None:
                return "its recorded value was not kept"
            self._ready = (op.index, run, base)
            return None
        if pending and op.func_name in ROW_VIEWS:
            found = _view_rows(run, op, plan, args, kwargs)
            if found is not None:
                self._ready = (op.index, run, found)
                return None
        return plan.reason or NOT_MINE  # (no reason: its inputs changed whole, nothing to slice)

    def close(self) -> None:
        self._ready = None

    def run_op(self, op: Op, runs: list[Replayer]) -> None:
        run = runs[0]
        plan, args, kwargs, _ = run.plan(op)
        if plan.kind == "skip":
            return
        ready, self._ready = self._ready, None
        found = ready[2] if ready is not None and ready[0] == op.index and ready[1] is run else None
        if plan.kind == "rows":
            base = found if found is not None else run.row_base(op)
            if not run.finish_rows(op, plan, base, plan.call()):
                self.engine.hand_on(self, op, runs, "its rule's rows do not fit the recorded value")
            return
        old, want = found if found is not None else _view_rows(run, op, plan, args, kwargs)
        x, region = args[0], plan.region
        # view/reshape bake the sizes in their arguments: the rule mapped the rows, so reshape them
        rows = x.rows.reshape(want) if op.func_name in ("view", "reshape") else op.func(x.rows, *args[1:], **kwargs)
        if not isinstance(rows, torch.Tensor) or list(rows.shape) != want:
            self.engine.hand_on(self, op, runs, "the shape op's new rows are not the rows it maps")
            return
        run.store(op.index, RowPatch(old, region.axis, region.start, rows), region)
        run.log.entries.append((op.label, op.func_name, "mapped", (region.axis, region.start, op.shape[region.axis]),
                                ""))


def _view_rows(run: Replayer, op: Op, plan: Plan, args: tuple, kwargs: dict) -> tuple[torch.Tensor, list] | None:
    """For a shape op on a :class:`RowPatch` whose rows map to rows of its output (``plan.region``):
    its recorded value and the shape of its new rows (None: it must be built and run whole)."""
    region, x = plan.region, args[0] if args else None
    if not isinstance(region, Rows) or not isinstance(x, RowPatch) or not isinstance(op.shape, tuple) \
            or any(isinstance(a, RowPatch) for a in (*args[1:], *kwargs.values())):
        return None
    want = list(op.shape)
    want[region.axis] -= region.start
    if math.prod(want) != x.rows.numel():  # the new rows are not exactly the output's changed rows
        return None
    old = run.row_base(op)  # (None: its recorded value was not kept; the whole-op path builds it)
    if old is None or tuple(old.shape) != op.shape:
        return None
    return old, want


class WholeValue(Strategy):
    """The whole value of ``op``, re-issued from its recorded arguments with the fork's values.

    Takes every op the engine did not refuse. The new value must have the recorded shape and, for
    an op the forward branched on (``GUARD``), the recorded choice: otherwise the fork fails with
    ``GuardChangedError`` (the edit changed the path; ``replay_step`` may re-execute).
    """

    name = "whole"

    def cannot(self, op: Op, runs: list[Replayer]) -> str | None:
        return None

    def run_op(self, op: Op, runs: list[Replayer]) -> None:
        run = runs[0]
        args, kwargs = run.built_args(op)
        new = reissue(op, args, kwargs)
        check_path(run, op, new)
        plan = run.planned(op)
        region = WHOLE if plan is None else plan.region
        if isinstance(region, Corner):  # did a causal mask leave the corner's extra block as it was?
            region = refine_corner(run.value_before(op.index), new, region)
        run.store(op.index, new, region)
        how = "fallback" if plan is not None and plan.reason else "full" if plan is None or region is WHOLE \
            else "mapped"
        run.log.entries.append((op.label, op.func_name, how, _rows_of(plan, new), plan.reason if plan else ""))


def reissue(op: Op, args: tuple, kwargs: dict) -> Any:
    """``execute(op, ...)``; an op that ran fine in the recorded forward but fails on edited inputs
    means the edit changed something (usually a shape) its recorded arguments baked in."""
    try:
        return execute(op, args, kwargs)
    except ReplayError as exc:
        raise GuardChangedError(
            f"after the edit, op {op.label} ({op.func_name}) at {op.source} cannot be re-issued with its "
            f"recorded arguments ({exc.__cause__}); the edit changed something it baked in "
            f"(input shapes now {[describe_shape(a) for a in tensor_leaves((args, kwargs))]})",
            op_label=op.label, source=op.source, guard=op.func_name, recorded=None, new=None,
        ) from exc


def check_path(run: Replayer, op: Op, new: Any) -> None:
    """Raise GuardChangedError when ``new`` shows the edited run leaves the recorded path: another
    shape than recorded, or another choice at an op the forward branched on."""
    if not op.flags & EDIT:
        old_shape = op.shape
        if old_shape is not None and describe_shape(new) != old_shape:
            raise GuardChangedError(
                f"after the edit, op {op.label} ({op.func_name}) at {op.source} produces shape "
                f"{describe_shape(new)} instead of the recorded {old_shape}: the path depends on the data",
                op_label=op.label, source=op.source, guard=op.func_name, recorded=old_shape,
                new=describe_shape(new),
            )
    if op.flags & GUARD and op.saved:
        old, fresh = index_leaves(op.out), index_leaves(new)
        if len(old) != len(fresh) or not all(same_value(a, b) for a, b in zip(old, fresh)):
            raise GuardChangedError(changed_choice(run.fork, op, old, fresh), op_label=op.label, source=op.source,
                                    guard=op.func_name, recorded=old, new=fresh)


def _rows_of(plan: Plan | None, new: Any) -> tuple[int, int, int] | None:
    region = plan.region if plan is not None else None
    if isinstance(region, Rows) and isinstance(new, torch.Tensor):
        return region.axis, region.start, new.shape[region.axis]
    return None
