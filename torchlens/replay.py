"""Re-executing recorded ops: push an edit down the graph of a fork, or replay it all.

Shaped like ``torch.fx.Interpreter``: ``run_op`` rebuilds one op's arguments from the
values known so far (``initial`` values are the recorded ones) and calls its function;
an error while doing so names the op and the model line that issued it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .core.records import EDIT, INPLACE, INPUT, NOT_REPLAYABLE, RANDOM, ModuleCall, Op, Ref
from .core.selectors import Selector, as_selector
from .core.tree import describe_shape, flatten, tensor_leaves, unflatten
from .edits import AppliedEdit, EditContext, When, apply_edit, check_edit, count_changed
from .errors import InvalidArgumentError, ReplayError, ReplayNotExactError

REEXECUTE = "do(site, edit, model=model, inputs=x) re-executes the real forward instead."


class Step:
    """One (site, edit) of a fork's recipe."""

    def __init__(self, selector: Selector, edit: Any) -> None:
        self.selector = selector
        self.edit = edit

    def as_when(self) -> When:
        return When(self.selector, self.edit)

    def __repr__(self) -> str:
        return f"Step({self.selector.describe()}, {getattr(self.edit, 'name', type(self.edit).__name__)})"


def build_args(op: Op, resolve: Callable[[Ref], Any]) -> tuple[tuple, dict]:
    leaves, spec = op.args_spec
    leaves = [resolve(leaf) if type(leaf) is Ref else leaf for leaf in leaves]
    args, kwargs = unflatten(leaves, spec)
    return args, kwargs


def execute(op: Op, args: tuple, kwargs: dict) -> Any:
    """Call an op's function; in-place ops work on a clone so recorded values stay intact."""
    if op.flags & INPLACE:
        if "out" in kwargs and isinstance(kwargs["out"], torch.Tensor):
            target = kwargs["out"] = kwargs["out"].clone()
        else:
            target = args[0].clone()
            args = (target, *args[1:])
        result = op.func(*args, **kwargs)
        return target if result is None or result is target else result
    try:
        return op.func(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - re-raised with the op and its model line
        raise ReplayError(
            f"re-executing op {op.label} ({op.func_name}) issued at {op.source} failed: {exc}",
            op_label=op.label,
            source=op.source,
            remedy=REEXECUTE,
        ) from exc


def refuse_reason(op: Op) -> str | None:
    if op.flags & RANDOM:
        return f"op {op.label} ({op.func_name}) at {op.source} draws random numbers"
    if op.flags & NOT_REPLAYABLE or op.func is None:
        return f"op {op.label} ({op.func_name}) at {op.source} cannot be re-issued from its recorded arguments"
    return None


def _clone_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    leaves, spec = flatten(value)
    return unflatten([leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


class _Target:
    """Where a step lands on the recorded graph: a module call's output or an op's output."""

    __slots__ = ("record", "position")

    def __init__(self, record: Op | ModuleCall) -> None:
        self.record = record
        self.position = record.op_end if isinstance(record, ModuleCall) else record.index + 1


def do_on_fork(fork, site: Any, edit: Any, *, model=None, inputs=None, check: bool = False):
    check_edit(edit)
    selector = as_selector(site)
    if fork.model is not None:
        from .capture.request import normalize

        selector = normalize(fork.model, selector)  # same meaning as in tl.when (every pass of a module)
    if (model is None) != (inputs is None):
        raise InvalidArgumentError(
            "do(..., model=, inputs=) needs both the model and its inputs to re-execute",
            remedy="Pass both model= and inputs=, or neither to replay the recorded graph.",
        )
    if model is not None:
        return _reexecute(fork, Step(selector, edit), model, inputs)
    if fork.engine == "hooks":
        raise ReplayNotExactError(
            "this trace was served by module hooks alone and holds no op graph to replay",
            remedy="Re-execute with do(site, edit, model=model, inputs=x), or capture with tl.trace(model, x) "
            "(without a module-only save= next to intervene=) to get the graph.",
        )
    records = selector.match(fork)
    if not records:
        from .errors import EmptySelectionError

        raise EmptySelectionError(f"{selector.describe()} matches nothing in this trace", site=selector.describe())
    step = Step(selector, edit)
    fork.recipe.append(step)
    try:
        with torch.set_grad_enabled(fork.grad):
            Replayer(fork).push(step, [_Target(r) for r in records])
    except BaseException:
        fork.recipe.pop()
        raise
    if check:
        _check_against_forward(fork)
    return fork


def _reexecute(fork, step: Step, model, inputs):
    from .api import trace as _trace
    from .capture.request import split_inputs

    args, kwargs = split_inputs(inputs)
    recipe = [*fork.recipe, step]
    steps = list(fork.steps) + [s.as_when() for s in recipe]
    fresh = _trace(model, *args, intervene=steps, **kwargs)
    parent, name = fork.parent, fork.name
    fork.__dict__.update(fresh.__dict__)
    fork.parent, fork.name = parent, name
    fork.steps = list(parent.steps)
    fork.recipe = recipe
    fork._values, fork._subst, fork._overrides = {}, {}, {}
    return fork


def _check_against_forward(fork) -> None:
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

    def __init__(self, fork) -> None:
        self.fork = fork
        fork._ensure_graph()
        self.ops = fork.ops
        self.changed: set[int] = set()

    def value_for(self, ref: Ref, consumer: int) -> Any:
        sub = self.fork._subst.get(ref.index)
        if sub is not None and consumer >= sub[0]:
            v = sub[1]
        else:
            v = self.fork.value(ref.index)
        return v if ref.elem is None else v[ref.elem]

    def push(self, new_step: Step, new_targets: list[_Target]) -> None:
        fork = self.fork
        start = min(t.position for t in new_targets)
        plan: dict[int, list[tuple[Step, _Target, bool]]] = {}
        for step in fork.recipe:
            is_new = step is new_step
            targets = new_targets if is_new else [_Target(r) for r in step.selector.match(fork)]
            for t in targets:
                if t.position >= start:
                    plan.setdefault(t.position, []).append((step, t, is_new))
        reads = [r for r in fork.data_reads if r[0] >= start]
        read_i = 0
        n = len(self.ops)
        for j in range(start, n + 1):
            if j in plan:
                self._apply_steps(plan[j])
            while read_i < len(reads) and reads[read_i][0] <= j:
                pos, ref, code, lineno, name = reads[read_i]
                if ref is not None and ref.index in self.changed:
                    raise ReplayNotExactError(
                        f"the edit reaches a data-dependent read ({name}) at {code.co_filename}:{lineno}: "
                        "control flow may change",
                        op_label=self.ops[ref.index].label,
                        source=f"{code.co_filename}:{lineno}",
                    )
                read_i += 1
            if j == n:
                break
            op = self.ops[j]
            if op.flags & INPUT or not self.changed:
                continue
            if not any(r.index in self.changed for r in op.parent_refs):
                continue
            self._rerun(op)

    def _rerun(self, op: Op) -> None:
        reason = refuse_reason(op)
        if reason is not None:
            raise ReplayNotExactError(
                f"{reason}; replay would not reproduce it", op_label=op.label, source=op.source
            )
        j = op.index
        stale = self.fork._stale
        if stale:
            for r in op.parent_refs:
                if r.index in stale and j > stale[r.index]:
                    raise ReplayNotExactError(
                        f"op {op.label} at {op.source} reads {self.ops[r.index].label} after an in-place op "
                        "overwrote memory it views; the recorded graph does not describe that read",
                        op_label=op.label, source=op.source,
                    )
        args, kwargs = build_args(op, lambda r: self.value_for(r, j))
        try:
            new = execute(op, args, kwargs)
        except ReplayError as exc:
            # An op that ran fine in the recorded forward fails on edited inputs: the edit
            # changed something (usually a shape) that the recorded arguments baked in.
            raise ReplayNotExactError(
                f"after the edit, op {op.label} ({op.func_name}) at {op.source} cannot be re-issued with its "
                f"recorded arguments ({exc.__cause__}); the edit changed something it baked in "
                f"(input shapes now {[describe_shape(a) for a in tensor_leaves((args, kwargs))]})",
                op_label=op.label,
                source=op.source,
            ) from exc
        if op.saved and not op.flags & EDIT:
            old_shape = describe_shape(op._out)
            if describe_shape(new) != old_shape:
                raise ReplayNotExactError(
                    f"after the edit, op {op.label} at {op.source} produces shape {describe_shape(new)} "
                    f"instead of the recorded {old_shape}; later ops may have baked in the old shape",
                    op_label=op.label,
                    source=op.source,
                )
        self.fork._values[j] = new
        self.changed.add(j)

    def _apply_steps(self, entries: list[tuple[Step, _Target, bool]]) -> None:
        by_record: dict[int, list[tuple[Step, _Target, bool]]] = {}
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
            return EditContext(step.selector.describe(), record.label, record.address, record.pass_index, record,
                               self.fork)
        return EditContext(step.selector.describe(), record.label, record.module, record.module_pass, record,
                           self.fork)

    def _run_edits(self, value: Any, group, record, recompute: bool) -> Any:
        for step, _target, is_new in group:
            if not (recompute or is_new):
                continue
            before = value
            value = apply_edit(_clone_value(value), step.edit, self._ctx(step, record))
            if is_new:
                self.fork.edits.append(
                    AppliedEdit(step.selector.describe(), record.label, getattr(record, "pass_index", None)
                                if isinstance(record, ModuleCall) else record.module_pass,
                                count_changed(before, value))
                )
        return value

    def _apply_module(self, call: ModuleCall, group) -> None:
        fork = self.fork
        recompute = any(r is not None and r.index in self.changed for r in call.out_refs)
        if recompute or call.key not in fork._overrides:
            current = self._unedited_module_out(call)
        else:
            current = fork._overrides[call.key]
        edited = self._run_edits(current, group, call, recompute)
        fork._overrides[call.key] = edited
        leaves, _ = flatten(edited)
        for ref, leaf in zip(call.out_refs, leaves):
            if ref is None:
                continue
            if ref.elem is not None:
                raise ReplayNotExactError(
                    f"the output of {call.key} is one element of a multi-output op; replay cannot swap it alone",
                    op_label=self.ops[ref.index].label,
                )
            fork._subst[ref.index] = (call.op_end, leaf)
            self.changed.add(ref.index)

    def _unedited_module_out(self, call: ModuleCall) -> Any:
        raw = call._out
        leaves, spec = flatten(raw)
        for i, ref in enumerate(call.out_refs):
            if ref is not None:
                v = self.fork.value(ref.index)
                leaves[i] = v if ref.elem is None else v[ref.elem]
        return unflatten(leaves, spec)

    def _apply_op(self, op: Op, group) -> None:
        recompute = op.index in self.changed
        edited = self._run_edits(self.fork.value(op.index), group, op, recompute)
        self.fork._values[op.index] = edited
        self.fork._subst.pop(op.index, None)
        self.changed.add(op.index)
