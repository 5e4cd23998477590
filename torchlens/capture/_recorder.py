"""The function-mode engine's recorder: one ``Op`` per torch call, module context from hooks.

A ``TorchFunctionMode`` is thread-local and patches nothing, so two threads can record
two models at once. The per-call path is kept short: classification is cached per
function, raw arguments are kept as they are and only resolved into ``args_spec`` when
someone asks (replay, parents, ``save=``), and outputs are copied only when an in-place
op is about to overwrite a recorded value (copy on write).
"""

from __future__ import annotations

import os
import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..core.records import ALIAS_MUTATION, EDIT, INPLACE, OPEN, RANDOM, ModuleCall, Op
from ..core.steps import Step
from ..core.trace import Trace
from ..core.tree import clone_value, flatten, unflatten
from ..edit.edits import AppliedEdit, EditContext, apply_edit, count_changed
from ..errors import StopCapture
from ._classify import info_for

__all__ = ["EditApplier", "Recorder"]

Tensor = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
# TorchLens's own machinery, skipped when looking for the model line that issued an op.
_OWN = tuple(_PKG_DIR + p for p in ("capture" + os.sep, "core" + os.sep, "edit" + os.sep, "api.py", "_services.py"))
_INTERNAL: dict[Any, bool] = {}


def _is_internal(code) -> bool:
    internal = _INTERNAL.get(code)
    if internal is None:
        fn = code.co_filename
        internal = fn.startswith(_TORCH_DIR) or fn.startswith(_OWN) or fn.startswith("<frozen")
        _INTERNAL[code] = internal
    return internal


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


class Recorder(TorchFunctionMode):
    """Records every torch function / tensor method call made while it is active."""

    def __init__(self, trace: Trace, op_steps: list[Step] | None = None, until: Any = None) -> None:
        super().__init__()
        self.trace = trace
        self.trace_ref = weakref.ref(trace)
        self.ops = trace.ops
        self.counters: dict[str, int] = {}
        self.stack: list[ModuleCall] = []
        self.paused = False
        self.op_steps = op_steps or []
        self.until = until
        self.storage: dict[int, list[int]] | None = None
        self.stale: dict[int, int] = {}

    # -- labels and provenance -------------------------------------------------------------
    def label(self, stem: str) -> str:
        n = self.counters.get(stem, 0) + 1
        self.counters[stem] = n
        return f"{stem}_{n}"

    @staticmethod
    def source() -> tuple[Any, int]:
        f = sys._getframe(3)  # skip source(), _record(), __torch_function__
        while f is not None:
            if not _is_internal(f.f_code):
                return f.f_code, f.f_lineno
            f = f.f_back
        return None, 0

    # -- the hot path --------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.paused:
            return func(*args, **kwargs)
        info = info_for(func)
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
            if isinstance(target, Tensor) and self._before_inplace(target):
                flags |= ALIAS_MUTATION
        if info.random:
            flags |= RANDOM
        elif info.training_pos is not None:
            pos = info.training_pos
            if kwargs.get("training", args[pos] if len(args) > pos else True):
                flags |= RANDOM
        elif info.name == "scaled_dot_product_attention" and kwargs.get("dropout_p", 0.0):
            flags |= RANDOM

        out = func(*args, **kwargs)

        if inplace and out is None:
            out = target
        if isinstance(out, Tensor):
            return self._record(func, info, out, args, kwargs, flags, None)
        if type(out) in (tuple, list) or isinstance(out, tuple):
            if out and all(isinstance(x, Tensor) or x is None for x in out):
                return self._record(func, info, out, args, kwargs, flags, True)
            return out
        if info.data_read:
            self._data_read(info.name, args)
        return out

    def _record(self, func, info, out, args, kwargs, flags, multi) -> Any:
        trace = self.trace
        ops = self.ops
        index = len(ops)
        code, lineno = self.source()
        stack = self.stack
        if stack:
            call = stack[-1]
            module, module_pass = call.address, call.pass_index
        else:
            module, module_pass = "", 1
        if list in map(type, args):  # a list may be appended to later by the model: keep it as it is now
            args = tuple(list(a) if type(a) is list else a for a in args)
        stem = info.stem
        n = self.counters.get(stem, 0) + 1
        self.counters[stem] = n
        label = f"{stem}_{n}"
        op = Op(index, label, func, info.name, out, module, module_pass, code, lineno, args, kwargs, flags)
        op._trace_ref = self.trace_ref
        trace.add_recorded_op(op, multi)
        if self.storage is not None:
            self._index_storage(op)
        if self.op_steps:
            out = self._apply_op_steps(op, out)
        if self.until is not None and self.until.matches_op(op):
            raise StopCapture(op.label)
        return out

    def _data_read(self, name: str, args: tuple) -> None:
        ref = None
        for a in args:
            if isinstance(a, Tensor):
                ref = self.trace.producer_ref(a, len(self.ops))
                if ref is not None:
                    break
        code, lineno = self.source()
        self.trace.record_data_read(len(self.ops), ref, code, lineno, name)

    # -- copy on write for in-place ops -----------------------------------------------------------
    def _storage_key(self, t: Tensor) -> int | None:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None

    def _index_storage(self, op: Op) -> None:
        out = op._out
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        for t in leaves:
            if isinstance(t, Tensor):
                key = self._storage_key(t)
                if key:
                    self.storage.setdefault(key, []).append(op.index)

    def _before_inplace(self, target: Tensor) -> bool:
        """Snapshot every recorded value the in-place op is about to overwrite.

        Returns True when the overwritten memory is viewed by other recorded tensors, whose
        later readers would see data the recorded graph does not describe.
        """
        if self.storage is None:
            self.storage = {}
            for op in self.ops:
                self._index_storage(op)
        key = self._storage_key(target)
        if not key:
            return False
        aliased = False
        ops = self.ops
        for index in self.storage.pop(key, ()):
            # Each op sharing this memory keeps a private copy of its value as it was; it no
            # longer shares the memory, so it leaves the index.
            op = ops[index]
            out = op._out
            if isinstance(out, Tensor):
                op._out = out.clone()
                is_target = out is target
            elif isinstance(out, (tuple, list)):
                op._out = type(out)(x.clone() if isinstance(x, Tensor) else x for x in out) \
                    if type(out) in (tuple, list) else out
                is_target = False
            else:
                continue
            op.snapshotted = True
            if not is_target:
                aliased = True
                self.stale.setdefault(index, len(ops))
        return aliased

    # -- capture-time edits --------------------------------------------------------------------
    def _edit_op(self, when: Step, value: Any, module: str, module_pass: int, label: str, record) -> Any:
        """Apply ``when`` to ``value`` and record the edit as an EDIT op in the graph."""
        leaves, spec = flatten(value)
        ctx = EditContext(when.site.describe(), label, module, module_pass, record, weakref.proxy(self.trace))
        applier = EditApplier(when, spec, ctx)
        self.paused = True
        try:
            result = applier(*leaves)
            edited = result if spec is None else unflatten(list(result), spec)
            changed = count_changed(value, edited)
        finally:
            self.paused = False
        index = len(self.ops)
        op = Op(index, self.label("edit"), applier, "edit", result, module, module_pass, None, 0, tuple(leaves), {},
                EDIT)
        op._code, op._lineno = getattr(record, "_code", None), getattr(record, "_lineno", 0)
        self.trace.add_op(op)
        if spec is None:
            self.trace.register_tensor(result, index, None)
        else:
            for i, leaf in enumerate(result):
                if isinstance(leaf, Tensor):
                    self.trace.register_tensor(leaf, index, i)
        if self.storage is not None:
            self._index_storage(op)
        when.fired.append(label)
        self.trace.record_edit(AppliedEdit(when.site.describe(), label, module_pass, changed))
        return edited

    def _apply_op_steps(self, op: Op, out: Any) -> Any:
        for when in self.op_steps:
            if when.site.matches_op(op):
                out = self._edit_op(when, out, op.module, op.module_pass, op.label, op)
        return out

    # -- module hook callbacks -----------------------------------------------------------------
    def enter_module(self, info, args, kwargs) -> None:
        call = ModuleCall(info.address, info.pass_index, type(info.module).__name__, args, kwargs, len(self.ops))
        call.op_end = OPEN
        self.trace.add_call(call)
        self.stack.append(call)

    def exit_module(self, info, args, kwargs, output, steps: list[tuple[int | None, Step]] | None, stop: bool):
        call = self.stack.pop() if self.stack else None
        if call is None or call.address != info.address:  # hooks out of step: find it
            call = next(c for c in reversed(self.trace.calls) if c.address == info.address)
        replaced = None
        if steps:
            for pass_index, when in steps:
                if pass_index is None or pass_index == call.pass_index:
                    output = self._edit_op(when, output, call.address, call.pass_index, call.address, call)
                    replaced = output
        call.op_end = len(self.ops)
        call._out = output
        call.out_refs, call.out_spec = self.trace.refs_for_value(output, len(self.ops))
        if stop:
            raise StopCapture(call.key)
        return replaced
