"""One fork's run through the replay engine: what it pushes, changed and logged.

:class:`Replayer` holds the fork's side of a replay (its steps, the values it changed and
their regions, the data reads it checks, its replay log); :class:`Target` is where a step
lands. The engine (``edit/_engine``) walks the graph and its strategies recompute the ops.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.records import ModuleCall, Op, build_args
from ..core.steps import Step
from ..core.trace import DataRead
from ..core.tree import Pending, clone_value, flatten
from ..errors import GuardChangedError, ReplayNotExactError, ValueNotSavedError
from ._execute import REEXECUTE
from ._guards import recompute_read, same_value, short
from ._regions import (
    Plan,
    ReplayLog,
    RowPatch,
    Touched,
    diff_region,
    edit_touches,
    join_touched,
    region_lookup,
    union,
)
from ._slicing import plan_op
from .edits import AppliedEdit, EditContext, apply_edit, count_changed, land_edit

__all__ = ["Replayer", "Target"]


class Target:
    """Where a step lands on the recorded graph: a module call's output or an op's output."""

    __slots__ = ("record", "position")

    def __init__(self, record: Op | ModuleCall) -> None:
        self.record = record
        self.position = record.op_end if isinstance(record, ModuleCall) else record.index + 1


class Replayer:
    """One fork's run through the replay engine (:class:`~torchlens.edit._engine.Engine`): the
    steps it pushes, what it changed so far (``changed``, ``regions``), the data reads it checks,
    and its replay log. How each op is recomputed is the strategies' concern
    (``torchlens.edit._strategies``); this class holds the fork's side of it."""

    def __init__(self, fork, *, sliced: bool = True, read: Any = None) -> None:
        self.fork = fork
        parent = getattr(fork, "parent", None)
        if parent is not None:  # the records are shared: built once on the parent, later forks copy its flag
            parent.ensure_graph()
        # an OutputRead (torchlens.edit.reads): ``read.compute(self, op)`` computes only part of op ``read.index``
        self.read = read
        self.read_value: torch.Tensor | None = None  # what ``read`` names, when computed alone
        fork.ensure_graph()
        self.ops = fork.ops
        self.changed: set[int] = set()
        self.sliced = sliced
        self.regions: dict[int, Any] = {}  # op index -> changed region of its new value (see _slicing)
        self.previous: dict[int, Any] = {}  # op index -> its value on the fork before this push
        self.log = ReplayLog(sliced)
        self.start = 0  # the first position the engine visits for this run (set by prepare)
        self.saved: Any = None  # the fork's state before this push (the engine restores it on failure)
        self._stale = fork.stale_positions()  # op index -> position an in-place op overwrote it (usually empty)
        self._writes = bool(self._stale)  # some memory was written through another view: readers may depend on it
        self.rewrites = self._writes
        self.due = math.inf  # the next position where a step lands or a data read is checked
        self._watch: set[int] = set()
        self._planned: tuple[int, Plan, tuple, dict, bool] | None = None  # the last op planned, see plan()
        self._set = fork.changes.set_recomputed  # (a fork keeps its one ForkValues: store writes through it)

    def prepare(self, new_step: Step, new_targets: list[Target]) -> int:
        """Plan pushing ``new_step`` (landing on ``new_targets``): the first position the engine
        visits (:meth:`before` each position from there to ``len(ops)``, the end)."""
        fork = self.fork
        start = min(t.position for t in new_targets)
        plan: dict[int, list[tuple[Step, Target, bool]]] = {}
        for step in fork.recipe:
            is_new = step is new_step
            targets = new_targets if is_new else [Target(r) for r in step.site.match(fork)]
            for t in targets:
                if t.position >= start:
                    plan.setdefault(t.position, []).append((step, t, is_new))
        self._steps_at = plan
        # the ops whose value before this push a step may compare against (_before): the rest need no record
        self._watch = {r.index for entries in plan.values() for _, t, _ in entries
                       for r in (t.record.out_refs if isinstance(t.record, ModuleCall) else [t.record])
                       if r is not None}
        self._reads = [r for r in fork.data_reads if r.position >= start]
        self._read_i = 0
        self.start = start
        self._set_due()
        return start

    def _set_due(self) -> None:
        reads = self._reads
        self.due = min(min(self._steps_at, default=math.inf),
                       reads[self._read_i].position if self._read_i < len(reads) else math.inf)

    def before(self, j: int) -> None:
        """What happens at position ``j`` before op ``j`` runs: the steps landing there are
        applied and the data reads made before op ``j`` checked (raises GuardChangedError
        when the edit changes one)."""
        entries = self._steps_at.pop(j, None)
        if entries is not None:
            self._apply_steps(entries)
        reads = self._reads
        while self._read_i < len(reads) and reads[self._read_i].position <= j:
            self._check_read(reads[self._read_i])
            self._read_i += 1
        self._set_due()

    def steps_at(self, j: int) -> list[tuple[Step, Target, bool]]:
        """The steps (with where they land, and whether each is the new one) still to apply at position ``j``."""
        return self._steps_at.get(j, [])

    def landings(self) -> int:
        """How many places the steps still to apply land on."""
        return sum(len(entries) for entries in self._steps_at.values())

    def land(self, j: int) -> list[tuple[Step, Target, bool]]:
        """Apply now the steps landing at position ``j`` (a sweep lands every fork's edit before
        the walk); :meth:`before` will not apply them again. Returns them."""
        entries = self._steps_at.pop(j)
        self._set_due()
        self._apply_steps(entries)
        return entries

    def reaches(self, op: Op, parents: set[int]) -> bool:
        """Whether the edit reaches ``op`` (whose parents' op indices are ``parents``): it reads a
        value this push changed (or memory an in-place op it reached wrote through another view)."""
        changed = self.changed
        if not changed:
            return False
        if not self._writes:
            return not changed.isdisjoint(parents)
        for r in op.parent_refs:
            if r.index in changed or (self._writes and self._written(r.index, op.index)):
                return True
        return False

    def finish(self) -> None:
        """At the end of the graph: refuse a returned tensor the edit reaches that an in-place op
        wrote in a way replay cannot lay out again."""
        if self._writes:
            self._check_output_writes()

    def refusal(self, op: Op) -> str | None:
        """Why no strategy can recompute ``op`` for this fork (None: some can): it reads memory an
        in-place op wrote through a view in a way replay cannot lay out again."""
        for r in op.parent_refs if self._stale else ():
            stale = self._stale.get(r.index)
            if stale is not None and op.index > stale:
                write = self.fork.unreplayable_write(r.index)
                if write is not None:
                    return (f"op {op.label} at {op.source} reads {self.ops[r.index].label} after {write.label} "
                            f"({write.func_name} at {write.source}) wrote into its memory through a view in a way "
                            "replay cannot lay out again (the view reinterprets the dtype, the memory may have moved, "
                            "or the trace was loaded from disk, which keeps no write layout)")
        return None

    def rewritten(self, op: Op) -> bool:
        """Whether ``op`` reads memory written through another view since its recording (it is
        then rebuilt whole: ``core.writes``)."""
        for r in op.parent_refs if self._stale else ():
            stale = self._stale.get(r.index)
            if stale is not None and op.index > stale:
                return True
        return False

    def plan(self, op: Op) -> tuple[Plan, tuple, dict, bool]:
        """How to recompute ``op`` from the changed regions of its parents (``_slicing.plan_op``),
        with the arguments rebuilt for it; changed parents stored as a :class:`RowPatch` stay
        unbuilt (the last item says whether any did), as the row rules read only their new rows.
        Kept until the next op is planned: several strategies ask for the same op."""
        got = self._planned
        if got is not None and got[0] == op.index:
            return got[1:]  # type: ignore[return-value]
        fork, j, changed = self.fork, op.index, self.changed
        values: list[Any] = []
        refs: list[Any] = []
        pending = [False]

        def resolve(r):
            if r.index not in changed:
                return fork.seen_value(r, j)
            v = fork.seen_value(r, j, pending_ok=True)
            values.append(v)
            refs.append(r)
            if isinstance(v, Pending):
                pending[0] = True
            return v

        args, kwargs = build_args(op, resolve)
        plan = plan_op(op, args, kwargs, region_lookup(values, refs, self.regions))
        pending = pending[0]
        self._planned = (j, plan, args, kwargs, pending)
        return plan, args, kwargs, pending

    def planned(self, op: Op) -> Plan | None:
        """The plan a strategy made for ``op`` on this fork (None: none planned it)."""
        got = self._planned
        return got[1] if got is not None and got[0] == op.index else None

    def built_args(self, op: Op) -> tuple[tuple, dict]:
        """``op``'s arguments, every value built whole (the planned ones when none was a RowPatch)."""
        got = self._planned
        if got is not None and got[0] == op.index and not got[4]:
            return got[2], got[3]
        j = op.index
        return build_args(op, lambda r: self.fork.seen_value(r, j))

    def _check_output_writes(self) -> None:
        """Refuse when the edit reaches a tensor the model returned after an in-place op wrote into
        its memory in a way replay cannot lay out again: the fork would return the recorded one."""
        fork, end = self.fork, len(self.ops)
        for ref in fork.output_refs:
            if ref is None or fork.stale_after(ref.index) is None:
                continue
            write = fork.unreplayable_write(ref.index)
            if write is not None and (ref.index in self.changed or self._written(ref.index, end)
                                      or write.index in self.changed):
                raise ReplayNotExactError(
                    f"the model returns {self.ops[ref.index].label}, which the edit reaches, after {write.label} "
                    f"({write.func_name} at {write.source}) wrote into its memory in a way replay cannot lay out "
                    "again (the op may move the memory, as out= can, or the view reinterprets the dtype)",
                    op_label=self.ops[ref.index].label, source=write.source, remedy=REEXECUTE,
                )

    def _written(self, index: int, position: int) -> bool:
        """Whether an in-place op the edit reached wrote into op ``index``'s memory through
        another view before ``position`` (a reader there sees the write: it is recomputed)."""
        return any(w in self.changed for w in self.fork.writes_between(index, index + 1, position))

    def _check_read(self, read: DataRead) -> None:
        """A data read the edit reaches: recompute it; unchanged, the recorded path still holds."""
        if not any(r.index in self.changed or (self._writes and self._written(r.index, read.position))
                   for r in read.refs):
            return
        fork = self.fork
        new = recompute_read(read, lambda r: fork.seen_value(r, read.position))
        if not same_value(new, read.seen):
            raise GuardChangedError(
                f"the edit changes a value the forward branched on: {read.name}() at {read.source} saw "
                f"{short(read.seen)}, the edited run sees {short(new)}",
                guard=read.name, source=read.source, recorded=read.seen, new=new,
            )

    def row_base(self, op: Op) -> torch.Tensor | None:
        """The tensor new rows of ``op`` are kept beside (None: not a saved tensor; recompute whole)."""
        try:
            old = self.fork.value(op.index)
        except ValueNotSavedError:
            return None
        return old if isinstance(old, torch.Tensor) else None

    def finish_rows(self, op: Op, plan: Plan, old: torch.Tensor, rows: Any, note: str = "") -> bool:
        """Keep ``rows``, the recomputed rows ``plan.region`` of ``op``, beside ``old`` (False: they
        are not exactly those rows; the caller recomputes the op whole). ``note`` goes in the log."""
        axis, start = plan.region
        if not isinstance(rows, torch.Tensor) or rows.dtype != old.dtype or rows.dim() != old.dim():
            return False
        have, want = rows.shape, old.shape
        if have[axis] != want[axis] - start or have[:axis] != want[:axis] or have[axis + 1:] != want[axis + 1:]:
            return False
        # kept unbuilt: the next row rule reads ``rows`` alone, a whole read builds it once
        self.store(op.index, RowPatch(old, axis, start, rows), plan.region)
        self.log.entries.append((op.label, op.func_name, "rows", (axis, start, old.shape[axis]), note))
        return True

    def store(self, j: int, new: Any, region: Any) -> None:
        """Op ``j``'s new value on the fork, changed in ``region``."""
        if j in self._watch and j not in self.previous:
            try:
                self.previous[j] = self.fork.value(j)
            except ValueNotSavedError:
                pass
        self._set(j, new)
        self.regions[j] = region
        self.changed.add(j)

    def value_before(self, index: int) -> Any:
        """Op ``index``'s value on the fork before this push (None: not saved)."""
        if index in self.previous:
            return self.previous[index]
        try:
            return self.fork.value(index)
        except ValueNotSavedError:
            return None

    def _apply_steps(self, entries: list[tuple[Step, Target, bool]]) -> None:
        by_record: dict[int, list[tuple[Step, Target, bool]]] = {}
        for entry in entries:
            by_record.setdefault(id(entry[1].record), []).append(entry)
        for group in by_record.values():
            record = group[0][1].record
            if isinstance(record, ModuleCall):
                self._apply_module(record, group)
            else:
                self._apply_op(record, group)

    def _ctx(self, step: Step, record) -> EditContext:
        if isinstance(record, ModuleCall):
            return EditContext(step.site.describe(), record.label, record.address, record.pass_index, record,
                               self.fork)
        return EditContext(step.site.describe(), record.label, record.module, record.module_pass, record,
                           self.fork)

    def _run_edits(self, value: Any, group, record, recompute: bool) -> tuple[Any, Touched | None]:
        """``value`` with the group's edits applied, and the rows they declared they may change
        (:func:`edit_touches`; None: unknown, or nothing applied)."""
        touched: Touched | None = None
        first = True
        for step, _target, is_new in group:
            if not (recompute or is_new):
                continue
            before = value
            value = apply_edit(clone_value(value), step.edit, self._ctx(step, record))
            rows = edit_touches(step.edit, before)
            touched, first = (rows if first else join_touched(touched, rows)), False
            if is_new:
                land_edit(self.fork.changes, step.edit,
                          AppliedEdit(step.site.describe(), record.label, getattr(record, "pass_index", None)
                                      if isinstance(record, ModuleCall) else record.module_pass,
                                      count_changed(before, value, rows), "replayed", before=before,
                                      replay=self.log))
        return value, touched

    def _apply_module(self, call: ModuleCall, group) -> None:
        fork = self.fork
        recompute = any(r is not None and r.index in self.changed for r in call.out_refs)
        if recompute or not fork.has_module_override(call.key):
            current = fork.unedited_module_output(call)
        else:
            current = fork.module_override(call.key)
        if fork.has_module_override(call.key):
            old_leaves = flatten(fork.module_override(call.key))[0]
        else:
            old_leaves = [None if r is None else _elem(self.value_before(r.index), r.elem) for r in call.out_refs]
        edited, _ = self._run_edits(current, group, call, recompute)
        fork.changes.set_module_output(call.key, edited)
        leaves, _ = flatten(edited)
        for ref, leaf, old in zip(call.out_refs, leaves, old_leaves):
            if ref is None:
                continue
            # consumers after the module see the edit, those inside it the recomputed value
            self.regions[ref.index] = union(self.regions.get(ref.index) if ref.index in self.changed else None,
                                            diff_region(old, leaf))
            if ref.elem is not None:
                raise ReplayNotExactError(
                    f"the output of {call.key} is one element of a multi-output op; replay cannot swap it alone",
                    op_label=self.ops[ref.index].label,
                )
            fork.changes.substitute(ref.index, call.op_end, leaf)
            self.changed.add(ref.index)

    def _apply_op(self, op: Op, group) -> None:
        recompute = op.index in self.changed
        old = self.value_before(op.index)
        current = self.fork.value(op.index)
        edited, touched = self._run_edits(current, group, op, recompute)
        self.fork.changes.set_value(op.index, edited)
        # the edits' declared rows bound the comparison only when they edited ``old`` itself
        touched = touched if current is old else None
        self.regions[op.index] = union(self.regions.get(op.index) if recompute else None,
                                       diff_region(old, edited, touched))
        self.changed.add(op.index)


def _elem(value: Any, elem: int | None) -> Any:
    return value if elem is None or value is None else value[elem]
