"""Re-executing recorded ops: push an edit down the graph of a fork, or replay it all.

Shaped like ``torch.fx.Interpreter``: ``run_op`` rebuilds one op's arguments from the
values known so far (``initial`` values are the recorded ones) and calls its function;
an error while doing so names the op and the model line that issued it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.inputs import split_inputs
from ..core.records import EDIT, INPLACE, INPUT, NOT_REPLAYABLE, RANDOM, ModuleCall, Op, build_args
from ..core.steps import Step
from ..core.tree import clone_value, describe_shape, flatten, tensor_leaves
from ..errors import EmptySelectionError, InvalidArgumentError, ReplayError, ReplayNotExactError
from .edits import AppliedEdit, EditContext, apply_edit, count_changed

__all__ = ["REEXECUTE", "Replayer", "execute", "refuse_reason", "replay_step"]

REEXECUTE = "do(site, edit, model=model, inputs=x) re-executes the real forward instead."


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


class _Target:
    """Where a step lands on the recorded graph: a module call's output or an op's output."""

    __slots__ = ("record", "position")

    def __init__(self, record: Op | ModuleCall) -> None:
        self.record = record
        self.position = record.op_end if isinstance(record, ModuleCall) else record.index + 1


def replay_step(fork, step: Step, *, model=None, inputs=None, check: bool = False, rerun=None):
    """Apply a (bound) replay step on ``fork``: push it down the recorded graph, or, with
    ``model`` and ``inputs``, re-execute the real forward through ``rerun`` (a capture function
    ``(model, args, kwargs, steps) -> Trace``) with the fork's whole recipe.

    Raises:
        InvalidArgumentError: only one of ``model``/``inputs`` given.
        ReplayNotExactError: the recorded graph cannot reproduce the edit exactly.
        EmptySelectionError: the site matches nothing in the trace.
    """
    if (model is None) != (inputs is None):
        raise InvalidArgumentError(
            "do(..., model=, inputs=) needs both the model and its inputs to re-execute",
            remedy="Pass both model= and inputs=, or neither to replay the recorded graph.",
        )
    if model is not None:
        args, kwargs = split_inputs(inputs)
        recipe = [*fork.recipe, step]
        fresh = rerun(model, args, kwargs, [s.for_capture() for s in [*fork.steps, *recipe]])
        fork.adopt(fresh, recipe)
        return fork
    fork.require_op_graph("replaying an edit")
    records = step.site.match(fork)
    if not records:
        raise EmptySelectionError(f"{step.site.describe()} matches nothing in this trace", site=step.site.describe())
    fork.add_step(step)
    step = fork.recipe[-1]
    try:
        with torch.set_grad_enabled(fork.grad):
            Replayer(fork).push(step, [_Target(r) for r in records])
    except BaseException:
        fork.drop_last_step()
        raise
    if check:
        _check_against_forward(fork)
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
        fork.ensure_graph()
        self.ops = fork.ops
        self.changed: set[int] = set()

    def push(self, new_step: Step, new_targets: list[_Target]) -> None:
        fork = self.fork
        start = min(t.position for t in new_targets)
        plan: dict[int, list[tuple[Step, _Target, bool]]] = {}
        for step in fork.recipe:
            is_new = step is new_step
            targets = new_targets if is_new else [_Target(r) for r in step.site.match(fork)]
            for t in targets:
                if t.position >= start:
                    plan.setdefault(t.position, []).append((step, t, is_new))
        reads = [r for r in fork.data_reads if r.position >= start]
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
        fork = self.fork
        for r in op.parent_refs:
            stale = fork.stale_after(r.index)
            if stale is not None and j > stale:
                    raise ReplayNotExactError(
                        f"op {op.label} at {op.source} reads {self.ops[r.index].label} after an in-place op "
                        "overwrote memory it views; the recorded graph does not describe that read",
                        op_label=op.label, source=op.source,
                    )
        args, kwargs = build_args(op, lambda r: fork.seen_value(r, j))
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
        fork.set_recomputed(j, new)
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
            return EditContext(step.site.describe(), record.label, record.address, record.pass_index, record,
                               self.fork)
        return EditContext(step.site.describe(), record.label, record.module, record.module_pass, record,
                           self.fork)

    def _run_edits(self, value: Any, group, record, recompute: bool) -> Any:
        for step, _target, is_new in group:
            if not (recompute or is_new):
                continue
            before = value
            value = apply_edit(clone_value(value), step.edit, self._ctx(step, record))
            if is_new:
                self.fork.record_edit(
                    AppliedEdit(step.site.describe(), record.label, getattr(record, "pass_index", None)
                                if isinstance(record, ModuleCall) else record.module_pass,
                                count_changed(before, value))
                )
        return value

    def _apply_module(self, call: ModuleCall, group) -> None:
        fork = self.fork
        recompute = any(r is not None and r.index in self.changed for r in call.out_refs)
        if recompute or not fork.has_module_override(call.key):
            current = fork.unedited_module_output(call)
        else:
            current = fork.module_override(call.key)
        edited = self._run_edits(current, group, call, recompute)
        fork.set_module_output(call.key, edited)
        leaves, _ = flatten(edited)
        for ref, leaf in zip(call.out_refs, leaves):
            if ref is None:
                continue
            if ref.elem is not None:
                raise ReplayNotExactError(
                    f"the output of {call.key} is one element of a multi-output op; replay cannot swap it alone",
                    op_label=self.ops[ref.index].label,
                )
            fork.substitute(ref.index, call.op_end, leaf)
            self.changed.add(ref.index)

    def _apply_op(self, op: Op, group) -> None:
        recompute = op.index in self.changed
        edited = self._run_edits(self.fork.value(op.index), group, op, recompute)
        self.fork.set_value(op.index, edited)
        self.changed.add(op.index)
