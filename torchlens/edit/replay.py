"""Re-executing recorded ops: push an edit down the graph of a fork, or replay it all.

Shaped like ``torch.fx.Interpreter``: ``run_op`` rebuilds one op's arguments from the
values known so far (``initial`` values are the recorded ones) and calls its function;
an error while doing so names the op and the model line that issued it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ..core.inputs import split_inputs
from ..core.records import EDIT, GUARD, INPLACE, INPUT, RANDOM, ModuleCall, Op, build_args
from ..core.steps import REPLAY_MODES, Step
from ..core.trace import DataRead
from ..core.tree import Pending, clone_value, describe_shape, flatten, tensor_leaves
from ..errors import (
    EmptySelectionError,
    GuardChangedError,
    InvalidArgumentError,
    ReplayError,
    ReplayFellBack,
    ReplayNotExactError,
    ValueNotSavedError,
)
from ._execute import EVAL_REMEDY, REEXECUTE, ROW_VIEWS, UNINITIALISED, execute, refuse_reason
from ._guards import changed_choice, index_leaves, recompute_read, same_value, short
from ._regions import (
    WHOLE,
    Corner,
    Plan,
    ReplayLog,
    RowPatch,
    Rows,
    Touched,
    diff_region,
    edit_touches,
    join_touched,
    refine_corner,
    region_lookup,
    union,
)
from ._slicing import plan_op
from .edits import AppliedEdit, EditContext, apply_edit, count_changed, land_edit

__all__ = ["REPLAY_MODES", "Replayer", "Target", "check_against_forward", "replay_step", "unsaved_for_replay"]



class Target:
    """Where a step lands on the recorded graph: a module call's output or an op's output."""

    __slots__ = ("record", "position")

    def __init__(self, record: Op | ModuleCall) -> None:
        self.record = record
        self.position = record.op_end if isinstance(record, ModuleCall) else record.index + 1


def replay_step(fork, step: Step, *, model=None, inputs=None, check: bool = False, rerun=None,
                replay: str = "auto", sliced: bool = True):
    """Apply a (bound) replay step on ``fork``: push it down the recorded graph, or, with
    ``model`` and ``inputs``, re-execute the real forward through ``rerun`` (a capture function
    ``(model, args, kwargs, steps) -> Trace``) with the fork's whole recipe.

    When the edit changes a guard (a value the forward branched on, see ``torchlens.edit._guards``),
    ``replay`` decides: ``"strict"`` raises, ``"fallback"`` re-executes the real forward with the
    fork's recipe (the trace must hold its model), ``"auto"`` falls back when the model is there.
    A fallback warns (``ReplayFellBack``) and says so on the fork's applied edits (``how``).
    On any error the fork is left exactly as it was.

    With ``sliced`` (the default) each op downstream recomputes only the rows the edit can reach
    (``torchlens.edit._slicing``); the applied edit's ``replay`` log lists what was recomputed,
    and every op replayed whole because no rule could bound it, with the reason.

    Raises:
        InvalidArgumentError: only one of ``model``/``inputs`` given, or an unknown ``replay``.
        GuardChangedError: a guard changed and no fallback was allowed or possible.
        ReplayNotExactError: the recorded graph cannot reproduce the edit exactly.
        EmptySelectionError: the site matches nothing in the trace.
    """
    if replay not in REPLAY_MODES:
        raise InvalidArgumentError(f"replay= is one of {REPLAY_MODES}, got {replay!r}")
    if (model is None) != (inputs is None):
        raise InvalidArgumentError(
            "do(..., model=, inputs=) needs both the model and its inputs to re-execute",
            remedy="Pass both model= and inputs=, or neither to replay the recorded graph.",
        )
    if model is not None:
        args, kwargs = split_inputs(inputs, model=model, tokenizer=fork.tokenizer)  # text: the fork's tokenizer
        _reexecute(fork, step, model, args, kwargs, rerun, "re-executed (model= and inputs= given)")
        return fork
    fork.require_op_graph("replaying an edit")
    records = step.site.match(fork)
    if not records:
        raise EmptySelectionError(f"{step.site.describe()} matches nothing in this trace", site=step.site.describe())
    before = fork.fork_state()
    fork.changes.add_step(step)
    step = fork.recipe[-1]
    try:
        with torch.set_grad_enabled(fork.grad):
            Replayer(fork, sliced=sliced).push(step, [Target(r) for r in records])
    except GuardChangedError as exc:
        fork.changes.restore_fork(before, fork.unsaved_steps)
        if replay == "strict" or (replay == "auto" and fork.model is None):
            raise
        if fork.model is None:
            raise GuardChangedError(
                f"{exc.message}; replay='fallback' needs the model, and this trace holds none (it was loaded "
                "from disk)", remedy=REEXECUTE, **exc.fields) from exc
        reason = f"re-executed: {exc.message}"
        _reexecute(fork, step, fork.model, fork.args, fork.kwargs, rerun, reason)
        warnings.warn(f"fork {fork.name!r}: {reason}", ReplayFellBack, stacklevel=4)
        return fork
    except ValueNotSavedError as exc:
        fork.changes.restore_fork(before, fork.unsaved_steps)
        raise unsaved_for_replay(fork, step, exc) from None
    except BaseException:
        fork.changes.restore_fork(before, fork.unsaved_steps)
        raise
    if check:
        check_against_forward(fork)
    return fork


def unsaved_for_replay(fork, step: Step, first: ValueNotSavedError) -> ValueNotSavedError:
    """The error for a replay that met an op whose value ``save=`` did not keep (``first``): every op
    pushing ``step`` down ``fork`` reads and this trace lacks, at once, and re-execution as the remedy."""
    ops = fork.ops
    need: set[int] = set()
    changed: set[int] = set()
    start = len(ops)
    for record in step.site.match(fork):
        target = Target(record)
        start = min(start, target.position)
        edited = [r.index for r in record.out_refs if r is not None] if isinstance(record, ModuleCall) \
            else [record.index]
        need.update(edited)  # the edit receives the value it replaces
        changed.update(edited)
    for op in ops[start:]:  # each op the edit reaches reads its other arguments as recorded
        if not op.flags & INPUT and any(r.index in changed for r in op.parent_refs):
            changed.add(op.index)
            need.update(r.index for r in op.parent_refs if r.index not in changed)
    for read in fork.data_reads:  # a guard the edit reaches is recomputed from all it reads
        if read.position >= start and any(r.index in changed for r in read.refs):
            need.update(r.index for r in read.refs if r.index not in changed)
    missing = [ops[i].label for i in sorted(need) if not fork.has_value(i)]
    site = getattr(first, "site", None)
    if isinstance(site, str) and site not in missing:  # a read the walk above did not foresee
        missing.append(site)
    shown = ", ".join(repr(m) for m in missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
    return ValueNotSavedError(
        f"replaying {step.site.describe()} needs the values of {len(missing)} op(s) this trace did not keep "
        f"(save= left them out): {shown}",
        site=step.site.describe(), missing=missing,
        remedy="Re-execute the real forward instead, which needs no kept value: fork.do(site, edit, model=model, "
               "inputs=x). Or capture again keeping them: add the labels in this error's .missing to save= (a list of "
               "labels is a selector), or save=None to keep every value.",
    )


def _reexecute(fork, step: Step, model, args: tuple, kwargs: dict, rerun, how: str) -> None:
    """Make ``fork`` a real re-executed capture of its recipe plus ``step`` (recorded as ``how``)."""
    recipe = [*fork.recipe, step]
    fresh = rerun(model, args, kwargs, [s.for_capture() for s in [*fork.steps, *recipe]])
    fork.adopt(fresh, recipe)
    for applied in fork.edits:
        applied.how = how


def check_against_forward(fork) -> None:
    """Re-execute ``fork``'s recipe on its model; raise ``ReplayNotExactError`` if the output differs."""
    real = fork.run(fork.model)
    got = tensor_leaves(fork.output)
    want = tensor_leaves(real.output)
    for a, b in zip(got, want):
        if a.shape != b.shape or not torch.allclose(a, b, atol=1e-5, rtol=1e-4):
            err = (a - b).abs().max().item() if a.shape == b.shape else float("inf")
            raise ReplayNotExactError(
                f"replayed output differs from re-execution (max abs error {err:.3g})",
                remedy=REEXECUTE,
            )


class Replayer:
    """Pushes one new step down a fork's recorded graph, re-applying later steps it crosses."""

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
        self._stale = fork.stale_positions()  # op index -> position an in-place op overwrote it (usually empty)
        self._writes = bool(self._stale)  # some memory was written through another view: readers may depend on it
        self._watch: set[int] = set()
        # a RowBatch (torchlens.edit._batch) collecting row recomputations to run stacked with other forks'
        self.batch: Any = None

    def push(self, new_step: Step, new_targets: list[Target]) -> None:
        start = self.prepare(new_step, new_targets)
        for j in range(start, len(self.ops) + 1):
            self.visit(j)

    def prepare(self, new_step: Step, new_targets: list[Target]) -> int:
        """Plan pushing ``new_step`` (landing on ``new_targets``): the first position to :meth:`visit`.

        Each position from there to ``len(ops)`` (the end, where reads are checked) is then
        visited in order; :func:`torchlens.edit._batch.replay_many` visits several forks' replayers
        in step so their row recomputations run stacked.
        """
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
        return start

    def visit(self, j: int) -> None:
        """Apply the steps landing at position ``j``, check the data reads made before op ``j``,
        and recompute op ``j`` if the edit reaches it (``j == len(ops)``: the end)."""
        if j in self._steps_at:
            self._apply_steps(self._steps_at[j])
        reads = self._reads
        while self._read_i < len(reads) and reads[self._read_i].position <= j:
            self._check_read(reads[self._read_i])
            self._read_i += 1
        if j == len(self.ops):
            if self._writes:
                self._check_output_writes()
            return
        op = self.ops[j]
        if op.flags & INPUT or not self.changed:
            return
        changed = self.changed
        for r in op.parent_refs:
            if r.index in changed or (self._writes and self._written(r.index, j)):
                self._rerun(op)
                return

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

    def _rerun(self, op: Op) -> None:
        reason = refuse_reason(op)
        if reason is not None:
            raise ReplayNotExactError(
                f"{reason}; replay would not reproduce it", op_label=op.label, source=op.source,
                remedy=EVAL_REMEDY if op.flags & RANDOM else REEXECUTE,
            )
        j = op.index
        fork = self.fork
        written = False  # reads memory written through another view since: rebuilt whole (core.writes)
        for r in op.parent_refs if self._stale else ():
            stale = self._stale.get(r.index)
            if stale is not None and j > stale:
                write = fork.unreplayable_write(r.index)
                if write is not None:
                    raise ReplayNotExactError(
                        f"op {op.label} at {op.source} reads {self.ops[r.index].label} after {write.label} "
                        f"({write.func_name} at {write.source}) wrote into its memory through a view in a way replay "
                        "cannot lay out again (the view reinterprets the dtype, the memory may have moved, or the "
                        "trace was loaded from disk, which keeps no write layout)",
                        op_label=op.label, source=op.source, remedy=REEXECUTE,
                    )
                written = True
        plan = None
        if self.read is not None and j == self.read.index and self.read.compute(self, op):
            return
        if self.sliced and not written and not op.flags & (INPLACE | EDIT | GUARD) \
                and op.func_name not in UNINITIALISED:
            plan, args, kwargs, pending = self._plan(op)
            if plan.kind == "skip":
                return
            if plan.kind == "rows" and (self.batch is not None and self.batch.defer(self, op, plan)
                                        or self._rerun_rows(op, plan)):
                return
            if pending and op.func_name in ROW_VIEWS and self._rerun_view(op, plan, args, kwargs):
                return
            if pending:  # a whole-op call needs every argument built
                args, kwargs = build_args(op, lambda r: fork.seen_value(r, j))
        else:
            args, kwargs = build_args(op, lambda r: fork.seen_value(r, j))
        try:
            new = execute(op, args, kwargs)
        except ReplayError as exc:
            # An op that ran fine in the recorded forward fails on edited inputs: the edit
            # changed something (usually a shape) that the recorded arguments baked in.
            raise GuardChangedError(
                f"after the edit, op {op.label} ({op.func_name}) at {op.source} cannot be re-issued with its "
                f"recorded arguments ({exc.__cause__}); the edit changed something it baked in "
                f"(input shapes now {[describe_shape(a) for a in tensor_leaves((args, kwargs))]})",
                op_label=op.label,
                source=op.source,
                guard=op.func_name,
                recorded=None,
                new=None,
            ) from exc
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
                raise GuardChangedError(changed_choice(fork, op, old, fresh), op_label=op.label, source=op.source,
                                        guard=op.func_name, recorded=old, new=fresh)
        region = WHOLE if plan is None else plan.region
        if isinstance(region, Corner):  # did a causal mask leave the corner's extra block as it was?
            region = refine_corner(self._before(j), new, region)
        self._store(j, new, region)
        how = "fallback" if plan is not None and plan.reason else "full" if plan is None or region is WHOLE \
            else "mapped"
        self.log.entries.append((op.label, op.func_name, how, _rows_of(plan, new), plan.reason if plan else ""))

    def _plan(self, op: Op) -> tuple[Plan, tuple, dict, bool]:
        """How to recompute ``op`` from the changed regions of its parents (``_slicing.plan_op``),
        with the arguments rebuilt for it; changed parents stored as a :class:`RowPatch` stay
        unbuilt (the last item says whether any did), as the row rules read only their new rows."""
        fork, j, changed = self.fork, op.index, self.changed
        values: list[Any] = []
        refs: list[Any] = []

        def resolve(r):
            if r.index not in changed:
                return fork.seen_value(r, j)
            v = fork.seen_value(r, j, pending_ok=True)
            values.append(v)
            refs.append(r)
            return v

        args, kwargs = build_args(op, resolve)
        pending = any(isinstance(v, Pending) for v in values)
        return plan_op(op, args, kwargs, region_lookup(values, refs, self.regions)), args, kwargs, pending

    def _rerun_view(self, op: Op, plan: Plan, args: tuple, kwargs: dict) -> bool:
        """A shape op on a :class:`RowPatch` whose rows map to rows of its output (``plan.region``):
        apply it to the new rows alone (False: build the input and run it whole)."""
        region, x = plan.region, args[0] if args else None
        if not isinstance(region, Rows) or not isinstance(x, RowPatch) or not isinstance(op.shape, tuple) \
                or any(isinstance(a, RowPatch) for a in (*args[1:], *kwargs.values())):
            return False
        want = list(op.shape)
        want[region.axis] -= region.start
        if math.prod(want) != x.rows.numel():  # the new rows are not exactly the output's changed rows
            return False
        old = self.row_base(op)  # (None: its recorded value was not kept; the whole-op path builds it)
        if old is None:
            return False
        # view/reshape bake the sizes in their arguments: the rule mapped the rows, so reshape them
        rows = x.rows.reshape(want) if op.func_name in ("view", "reshape") else op.func(x.rows, *args[1:], **kwargs)
        if tuple(old.shape) != op.shape or not isinstance(rows, torch.Tensor) or list(rows.shape) != want:
            return False
        self._store(op.index, RowPatch(old, region.axis, region.start, rows), region)
        self.log.entries.append((op.label, op.func_name, "mapped", (region.axis, region.start, op.shape[region.axis]),
                                 ""))
        return True

    def _rerun_rows(self, op: Op, plan: Plan) -> bool:
        """Recompute only ``plan``'s rows of ``op``, kept beside its current value (False: do it whole)."""
        old = self.row_base(op)
        if old is None:
            return False
        return self.finish_rows(op, plan, old, plan.call())

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
        self._store(op.index, RowPatch(old, axis, start, rows), plan.region)
        self.log.entries.append((op.label, op.func_name, "rows", (axis, start, old.shape[axis]), note))
        return True

    def rerun_alone(self, op: Op) -> None:
        """Recompute ``op`` for this fork by itself (a stacked recomputation could not take it)."""
        batch, self.batch = self.batch, None
        try:
            self._rerun(op)
        finally:
            self.batch = batch

    def _store(self, j: int, new: Any, region: Any) -> None:
        fork = self.fork
        if j in self._watch and j not in self.previous:
            try:
                self.previous[j] = fork.value(j)
            except ValueNotSavedError:
                pass
        fork.changes.set_recomputed(j, new)
        self.regions[j] = region
        self.changed.add(j)

    def _before(self, index: int) -> Any:
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
            old_leaves = [None if r is None else _elem(self._before(r.index), r.elem) for r in call.out_refs]
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
        old = self._before(op.index)
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


def _rows_of(plan: Plan | None, new: Any) -> tuple[int, int, int] | None:
    region = plan.region if plan is not None else None
    if isinstance(region, Rows) and isinstance(new, torch.Tensor):
        return region.axis, region.start, new.shape[region.axis]
    return None
