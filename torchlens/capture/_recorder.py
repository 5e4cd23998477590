"""The function-mode engine's recorder: one ``Op`` per torch call, module context from ``ModuleHooks``.

A ``TorchFunctionMode`` is thread-local and patches nothing, so two threads can record
two models at once. The per-call path is kept short: classification is cached per
function, the common op (one tensor out, no flag, nothing watching ops one by one) is noted
as a row and made a record later, with the rows before it, in one loop (``flush``), with
its line left as an instruction offset until read, raw arguments are kept as they are and
only resolved into ``args_spec`` when someone asks (replay, parents, ``save=``), and
outputs are copied only when an in-place op is about to overwrite a recorded value (copy
on write, ``_cow``). Where an op came from is ``_provenance``'s; module calls are ``_calls``'s.

With ``save=`` or ``store=`` the capture is *transient*: arguments are linked to their
producers at once, values the selector does not keep are held weakly (freed when the forward
frees them), and kept values go to the sink (disk) as they are produced. Ops a dispatcher
issues (accelerate moving activations between devices) are flagged ``DISPATCH`` and labelled
``dispatch_*`` so the model's own ops keep the labels they have undispatched.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..core.builder import TraceBuilder
from ..core.records import (
    ALIAS_MUTATION,
    DISPATCH,
    EDIT,
    GUARD,
    INPLACE,
    LAZY_LINES,
    NOT_REPLAYABLE,
    RANDOM,
    ModuleCall,
    Op,
    line_at,
)
from ..core.selectors import Selector
from ..core.steps import Step
from ..core.tree import clone_value, flatten, unflatten
from ..edit.edits import AppliedEdit, EditContext, apply_edit, count_changed, land_edit
from ..errors import CaptureMemoryError, StopCapture
from ._calls import NO_CALL, ModuleCalls
from ._classify import info_for
from ._cow import CopyOnWrite
from ._memory import CHECK_EVERY, CHECK_MASK, CHECK_SHIFT, resident_bytes
from ._provenance import DISPATCHER_DIRS, INTERNAL, is_dispatcher, source_of
from ._splice import SpliceTools

__all__ = ["EditApplier", "FlatOutputs", "Recorder"]


class FlatOutputs:
    """A torch function whose output nests tensors in containers (``torch.histogramdd``: the
    histogram and a list of bin edges), called the same way but giving its tensors as one flat
    tuple, in ``torch.utils._pytree`` order: what the trace records for the op and what replay
    recomputes, so each tensor is one output of the op (``Ref.elem``)."""

    __slots__ = ("func",)

    def __init__(self, func: Any) -> None:
        self.func = func

    def __call__(self, *args: Any, **kwargs: Any) -> tuple:
        return tuple(flatten(self.func(*args, **kwargs))[0])

    def __repr__(self) -> str:
        return f"FlatOutputs({getattr(self.func, '__name__', self.func)!r})"

Tensor = torch.Tensor
# Functions whose calls need none of the per-call checks (in place, random, guard): the op
# path looks them up here first.
_PLAIN: dict[Any, Any] = {}
# What calls return that is never recorded (``x.size()``, ``x.dtype``, ``x.dim()`` ...); a read of
# tensor data into Python (``item``, ``__bool__``) is told apart by its function, not its result.
_PLAIN_VALUES = frozenset({torch.Size, int, float, bool, torch.dtype, torch.device, str, type(None)})
_getframe = sys._getframe


def _is_plain(info) -> bool:
    return not (info.inplace or info.inplace_pos is not None or info.random or info.training_pos is not None
                or info.name == "scaled_dot_product_attention" or info.guard)


class EditApplier:
    """The function of a capture-time EDIT op: re-applies the edit when replay re-runs it."""

    def __init__(self, when: Step, spec: Any, ctx: EditContext) -> None:
        self.when = when
        self.spec = spec
        self.ctx = ctx
        self.__name__ = "edit"

    def __call__(self, *leaves: Any) -> Any:
        value = unflatten(list(leaves), self.spec)
        edited = apply_edit(clone_value(value), self.when.edit, self.ctx)
        if self.spec is None:
            return edited
        return tuple(flatten(edited)[0])


class Recorder(TorchFunctionMode, CopyOnWrite, ModuleCalls):
    """Records every torch function / tensor method call made while it is active."""

    def __init__(self, build: TraceBuilder, op_steps: list[Step] | None = None, until: Any = None, *,
                 save: Selector | None = None, grad: bool = False, sink: Any = None,
                 max_bytes: int | None = None, module_steps: dict[str, list[tuple[int | None, Step]]] | None = None,
                 stops: dict[str, int | None] | None = None) -> None:
        super().__init__()
        # Capture-time edits of module outputs by address, (pass or None, step) each, and the
        # modules whose return stops the forward (``until=``), by address and pass (None: any).
        self.module_steps = module_steps or {}
        self.stops = stops or {}
        # The process may grow by max_bytes during the capture; checked every CHECK_EVERY ops
        # (a read of the resident size, ~10 us), so the check costs nothing per op.
        self.max_bytes = max_bytes
        self.rss0 = resident_bytes() if max_bytes is not None else None
        # With store=, each kept value is copied to ``sink`` (a disk store) as it is produced.
        self.sink = sink
        self.transient = save is not None or sink is not None
        # With save=, values the selector does not ask for are held weakly (freed when the forward
        # frees them): the peak is bounded, not only what is kept.
        self.save = save
        self.grad = grad  # hook every kept output so a backward leaves its gradient on the trace
        self.build = build  # writes the graph
        self.trace = trace = build.trace  # the trace being built (read by edits, selectors)
        self.trace_ref = weakref.ref(trace)
        self.ops = build.ops
        self.counters: dict[str, int] = {}
        self.stack: list[ModuleCall] = []
        self.top: Any = NO_CALL  # stack[-1], or the context of ops outside every module
        self.paused = False
        self.op_steps = op_steps or []
        self.until = until
        self.storage: dict[int, list[int]] | None = None
        self.stale: dict[int, int] = {}
        self.alias_writes: dict[int, list] = {}  # op index -> writes through other views into its memory
        self.ghosts: dict[int, list] = {}  # storage key -> copied records whose memory later writes may reach
        self.unsettled: list[tuple[ModuleCall, list, Any]] = []  # module outputs kept unrebuilt (``settle``)
        self.random: list[Op] = []  # ops that drew random numbers (flagged RANDOM): the capture warns
        # Ops recorded inline are noted as rows first, made records by ``flush`` (``add_rows``).
        self.pending: list[tuple] = []
        self.add_rows = build.add_recorded_tensor_ops
        self.lean = False
        self._update_lean()

    # -- labels and provenance -------------------------------------------------------------
    def label(self, stem: str) -> str:
        n = self.counters.get(stem, 0) + 1
        self.counters[stem] = n
        return f"{stem}_{n}"

    @staticmethod
    def source() -> tuple[Any, int]:
        """The model's code and line that made the current call (skips source(), _data_read(), __torch_function__)."""
        code, line, lasti = source_of(sys._getframe(3))
        return code, line if lasti < 0 else line_at(code, lasti)

    # -- the hot path --------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args) if kwargs is None else func(*args, **kwargs)
        try:
            info = _PLAIN.get(func)
        except TypeError:  # an unhashable callable: classified on each call by info_for
            info = None
        if info is not None and (kwargs is None or "out" not in kwargs):
            # the common op: none of the checks apply (torch passes no kwargs to most calls: no
            # dict is made for them until a record keeps one)
            out = func(*args) if kwargs is None else func(*args, **kwargs)
            kind = type(out)
            if kind is not Tensor and kind in _PLAIN_VALUES and not info.data_read:
                return out  # a size, a dtype ...: nothing to record
            if kwargs is None:
                kwargs = {}
            flags, inplace, target = 0, False, None
        else:
            if kwargs is None:
                kwargs = {}
            info = info_for(func)
            flags, inplace, target = self._checks(func, info, args, kwargs)
            out = func(*args, **kwargs)
            kind = type(out)

        if kind is Tensor and not flags and self.lean:
            # The common record, inlined: one tensor out, no flag (dropout in eval mode has none),
            # not a dispatcher's, no feature that looks at each op as it is made.
            caller = _getframe(1)
            code = caller.f_code
            internal = INTERNAL.get(id(code))
            if internal is False:  # called from the model's own line
                if LAZY_LINES:
                    line, lasti = None, caller.f_lasti
                else:
                    line, lasti = caller.f_lineno, -1
            elif internal and not (DISPATCHER_DIRS and is_dispatcher(code)):  # torch's own code
                code, line, lasti = source_of(caller)
            else:
                internal = None  # a frame not seen yet, or a dispatcher's: the general record
            if internal is not None:
                if list in map(type, args):  # a list may be appended to later by the model: keep our own
                    args = tuple(list(a) if type(a) is list else a for a in args)
                # Noted as a row; ``flush`` makes the records, many at once, before anything reads
                # them (a general record, a data read, copy on write, an edit, the forward's end).
                pending = self.pending
                pending.append((func, info, out, self.top, code, line, lasti, args, kwargs))
                if len(pending) >= CHECK_EVERY:
                    self.flush()
                return out

        if inplace and out is None:
            out = target
        if isinstance(out, Tensor):
            return self._record(func, info, out, args, kwargs, flags, None)
        if type(out) in (tuple, list) or isinstance(out, tuple):
            if out and all(isinstance(x, Tensor) or x is None for x in out):
                return self._record(func, info, out, args, kwargs, flags, True)
            leaves, spec = flatten(out)
            if any(isinstance(x, Tensor) for x in leaves) and all(isinstance(x, Tensor) or x is None for x in leaves):
                # tensors nested in containers (histogramdd's (hist, [edges ...])): recorded as the op's
                # flat outputs, re-issued the same way, so what reads any of them is seen to depend on it
                flat = tuple(leaves)
                got = self._record(FlatOutputs(func), info, flat, args, kwargs, flags, True)
                return out if got is flat else unflatten(list(got), spec)
            if not info.data_read:  # tolist() returns Python numbers: a data read, recorded below
                return out
        if info.data_read:
            self._data_read(func, info.name, args, kwargs, out)
        return out

    def flush(self) -> None:
        """Make the records of the ops noted as rows since the last flush (see ``__torch_function__``)."""
        pending = self.pending
        if not pending:
            return
        before = len(self.ops)
        self.add_rows(pending, self.counters, self.trace_ref)
        pending.clear()
        if self.rss0 is not None and before >> CHECK_SHIFT != len(self.ops) >> CHECK_SHIFT:
            self._check_memory()  # once every CHECK_EVERY ops, as the general record checks

    def _update_lean(self) -> None:
        """Whether an op may take the inlined record: nothing watches ops one by one (a bounded or
        disk-backed capture, gradients, copy on write after an in-place op, edits, ``until=``)."""
        self.lean = not (self.transient or self.grad or self.storage is not None or self.op_steps
                         or self.until is not None)

    def _checks(self, func, info, args: tuple, kwargs: dict) -> tuple[int, bool, Any]:
        """The flags of a call about to run (in place, random, guard) and the tensor it writes in place.

        Copies what an in-place op is about to overwrite first (copy on write). A function that
        never needs any of this is remembered in ``_PLAIN``, so its next calls skip the checks.
        """
        if _is_plain(info):
            try:
                _PLAIN[func] = info
            except TypeError:
                pass
        target = None
        flags = 0
        inplace = info.inplace
        if not inplace:
            pos = info.inplace_pos
            if pos is not None:
                inplace = kwargs.get("inplace", args[pos] if len(args) > pos else False) is True
            if not inplace and "out" in kwargs and kwargs["out"] is not None:
                inplace = True
        if inplace:
            flags |= INPLACE
            target = kwargs.get("out") if kwargs.get("out") is not None else (args[0] if args else None)
            out_arg = target is not None and target is kwargs.get("out")
            # out=(values, indices) and the _foreach_*_ ops mutate several tensors at once.
            several = isinstance(target, (tuple, list))
            for k, t in enumerate((target,) if isinstance(target, Tensor) else target if several else ()):
                if isinstance(t, Tensor) and self._before_inplace(t, info.name, out_arg, k if several else None):
                    flags |= ALIAS_MUTATION
            if several and self.targets_overlap(target):
                flags |= NOT_REPLAYABLE  # replay writes its targets apart: the order of their writes is lost
        if info.random:
            flags |= RANDOM
        elif info.training_pos is not None:
            pos = info.training_pos
            if kwargs.get("training", args[pos] if len(args) > pos else True):
                flags |= RANDOM
        elif info.name == "scaled_dot_product_attention" and kwargs.get("dropout_p", 0.0):
            flags |= RANDOM
        if info.guard and (info.name != "where" or len(args) + len(kwargs) == 1):
            flags |= GUARD
        return flags, inplace, target

    def _record(self, func, info, out, args, kwargs, flags, multi) -> Any:
        """Record one op in general (the inlined common case aside): tuple outputs, flags, a
        dispatcher's moves, ops from TorchLens's or torch's own frames, per-op features."""
        if self.pending:
            self.flush()
        build = self.build
        ops = self.ops
        index = len(ops)
        caller = sys._getframe(2)  # skip _record(), __torch_function__
        code = caller.f_code
        if INTERNAL.get(id(code)) is False:  # called from the model's own line (never a dispatcher's): no walk
            line, lasti = (None, caller.f_lasti) if LAZY_LINES else (caller.f_lineno, -1)
        else:
            code, line, lasti = source_of(caller)
            if DISPATCHER_DIRS and is_dispatcher(caller.f_code):
                # A dispatcher's move of an activation is kept (the model reads its output: an edit
                # must propagate through it) under its own stem; its weight on/offloads are not ops.
                if not any(self.build.producer_ref(t, index) is not None for t in _tensor_args(args, kwargs)):
                    return out
                flags |= DISPATCH
        stack = self.stack
        if stack:
            call = stack[-1]
            module, module_pass = call.address, call.pass_index
        else:
            module, module_pass = "", 1
        if list in map(type, args):  # a list may be appended to later by the model: keep it as it is now
            args = tuple(list(a) if type(a) is list else a for a in args)
        stem = info.stem if not flags & DISPATCH else "dispatch_" + info.stem
        n = self.counters.get(stem, 0) + 1
        self.counters[stem] = n
        label = f"{stem}_{n}"
        # A list the model is handed may be changed in place later: the record keeps its own.
        value = list(out) if multi and type(out) is list else out
        op = Op(index, label, func, info.name, value, module, module_pass, code, line, args, kwargs, flags,
                self.trace_ref, lasti)
        if flags & RANDOM:
            self.random.append(op)
        if not self.transient:
            build.add_recorded_op(op, multi)
        else:
            keep = bool(flags & GUARD) or self.save is None or self.save.matches_op(op)
            build.add_transient_op(op, multi, keep)
            if keep and self.sink is not None and not flags & GUARD:  # guard values stay: replay compares them
                build.spill(index, self.sink)
        if not index & CHECK_MASK and self.rss0 is not None:
            self._check_memory()
        if self.grad:
            self._hook_grad(op)
        if self.storage is not None:
            self._index_storage(op)
        if self.op_steps:
            out = self._apply_op_steps(op, out)
        if self.until is not None and self.until.matches_op(op):
            raise StopCapture(op.label)
        return out

    def _check_memory(self) -> None:
        """Stop the capture before memory runs out: the process grew by more than ``max_bytes``."""
        grown = resident_bytes() - self.rss0
        if grown > self.max_bytes:
            raise CaptureMemoryError(
                f"the capture grew this process by {grown / 2**20:.0f} MiB after {len(self.ops)} ops, more than "
                f"max_bytes={self.max_bytes / 2**20:.0f} MiB; the forward was stopped before memory ran out",
                grown=grown, max_bytes=self.max_bytes,
            )

    def _keep(self, index: int) -> None:
        """Keep op ``index``'s value after all (a saved module returned it), on disk with store=."""
        build = self.build
        build.keep_value(index)
        op = self.ops[index]
        if not op.saved:
            return
        if self.sink is not None:
            build.spill(index, self.sink)
        elif self.storage is not None:  # copy on write protects it from now on
            self._index_storage(op)
        if self.grad:
            self._hook_grad(op)

    def _hook_grad(self, op: Op) -> None:
        """Leave the gradient of each output tensor that requires one on the trace, when a backward runs."""
        out = self._live_out(op) if op.saved else None
        leaves = ((None, out),) if isinstance(out, Tensor) else enumerate(out) if out is not None else ()
        store = self.build.store_grad
        with torch._C.DisableTorchFunction():  # our hook, not an op of the model
            for elem, t in leaves:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(_keep_grad, store, op.index, elem))

    def _data_read(self, func: Any, name: str, args: tuple, kwargs: dict, seen: Any) -> None:
        """Record a read of tensor data into Python (a guard): what was read, from which ops,
        and the value the forward saw, so replay can recompute it and compare."""
        if self.pending:
            self.flush()
        position = len(self.ops)
        leaves, spec = flatten((args, kwargs))
        ref = None
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                found = self.build.producer_ref(leaf, position)
                if found is not None:
                    leaves[i] = found
                    ref = ref or found
        if DISPATCHER_DIRS and is_dispatcher(sys._getframe(2).f_code):
            return  # a dispatcher looking at a tensor (its device, its pointer), not the model branching
        code, lineno = self.source()
        self.build.record_data_read(position, ref, code, lineno, name, func=func, args_spec=(leaves, spec), seen=seen)

    # -- capture-time edits --------------------------------------------------------------------
    def _edit_op(self, when: Step, value: Any, module: str, module_pass: int, label: str, record) -> Any:
        """Apply ``when`` to ``value`` and record the edit as an EDIT op in the graph."""
        if self.pending:  # the edit may read the trace; its op follows the ops before it
            self.flush()
        if getattr(when.edit, "splice", None) is not None and isinstance(record, ModuleCall):
            return self._splice(when, value, record)
        leaves, spec = flatten(value)
        ctx = EditContext(when.site.describe(), label, module, module_pass, record, weakref.proxy(self.trace))
        applier = EditApplier(when, spec, ctx)
        self.paused = True
        try:
            result = applier(*leaves)
            edited = result if spec is None else unflatten(list(result), spec)
            applied = AppliedEdit(when.site.describe(), label, module_pass, count_changed(value, edited), "captured",
                                  before=value)
            land_edit(self.build, when.edit, applied)  # reported (or refused, strict) before it enters the graph
        finally:
            self.paused = False
        index = len(self.ops)
        op = Op(index, self.label("edit"), applier, "edit", result, module, module_pass, None, 0, tuple(leaves), {},
                EDIT)
        op._code, op._lineno = getattr(record, "_code", None), getattr(record, "_lineno", 0)
        self.build.add_op(op)
        if self.save is not None:
            self.build.link_args(op)  # the value before the edit is not held through its arguments
        if spec is None:
            self.build.register_tensor(result, index, None)
        else:
            for i, leaf in enumerate(result):
                if isinstance(leaf, Tensor):
                    self.build.register_tensor(leaf, index, i)
        if self.storage is not None:
            self._index_storage(op)
        when.fired.append(label)
        return edited

    def _splice(self, when: Step, value: Any, call: ModuleCall) -> Any:
        """Run a splice (``when.edit.splice``) inside ``call`` with its ops recorded as the model's own."""
        stack, top = self.stack, self.top
        stack.append(call)  # the splice's ops run in the site's module call
        self.top = call
        try:
            out = when.edit.splice(value, SpliceTools(self, call))
        finally:
            stack.pop()
            self.top = top
        when.fired.append(call.key)
        return out

    def _apply_op_steps(self, op: Op, out: Any) -> Any:
        for when in self.op_steps:
            if when.site.matches_op(op):
                out = self._edit_op(when, out, op.module, op.module_pass, op.label, op)
        return out


def _keep_grad(store, index: int, elem: int | None, grad: Tensor) -> None:
    store(index, elem, grad)


def _tensor_args(args: tuple, kwargs: dict) -> list[Tensor]:
    return [t for t in flatten((args, kwargs))[0] if isinstance(t, Tensor)]
