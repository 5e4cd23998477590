"""The function-mode engine's recorder: one ``Op`` per torch call, module context from hooks.

A ``TorchFunctionMode`` is thread-local and patches nothing, so two threads can record
two models at once. The per-call path is kept short: classification is cached per
function, raw arguments are kept as they are and only resolved into ``args_spec`` when
someone asks (replay, parents, ``save=``), and outputs are copied only when an in-place
op is about to overwrite a recorded value (copy on write).

With ``save=`` or ``store=`` the capture is *transient*: arguments are linked to their
producers at once, values the selector does not keep are held weakly (freed when the forward
frees them), and kept values go to the sink (disk) as they are produced. Ops a dispatcher
issues (accelerate moving activations between devices) are flagged ``DISPATCH`` and labelled
``dispatch_*`` so the model's own ops keep the labels they have undispatched.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

try:
    import resource
except ImportError:  # Windows has no resource module: max_bytes= then reads no peak
    resource = None

from ..core.records import ALIAS_MUTATION, DISPATCH, EDIT, GUARD, INPLACE, OPEN, RANDOM, Deferred, ModuleCall, Op
from ..core.selectors import Selector
from ..core.steps import Step
from ..core.trace import Trace
from ..core.tree import clone_value, flatten, unflatten
from ..edit.edits import AppliedEdit, EditContext, apply_edit, count_changed, land_edit
from ..errors import CaptureMemoryError, StopCapture
from ._classify import info_for

__all__ = ["EditApplier", "Recorder"]

Tensor = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
# TorchLens's own machinery, skipped when looking for the model line that issued an op.
_OWN = tuple(_PKG_DIR + p for p in ("capture" + os.sep, "core" + os.sep, "edit" + os.sep, "api.py", "_services.py"))
_INTERNAL: dict[Any, bool] = {}


def _package_dirs(*names: str) -> tuple[str, ...]:
    """Where these packages are installed (found without importing them)."""
    found = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or ()) if spec is not None else ():
            found.append(os.path.join(loc, ""))
    return tuple(found)


# Packages that move a model's weights and activations between devices around its forward
# (accelerate's dispatch and offload hooks): the ops they issue are not the model's.
_DISPATCHER_DIRS = _package_dirs("accelerate")
_DISPATCHER: dict[Any, bool] = {}
# In-place ops that change which memory a tensor describes, not the data in it: only the
# records holding that very tensor object change.
_RESHAPES_IN_PLACE = frozenset(
    {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "swapdims_", "swapaxes_", "detach_", "set_"}
)
# In-place ops that may move the whole storage elsewhere: every record on it changes address.
_REALLOCATES = frozenset({"resize_", "resize_as_"})


def _is_dispatcher(code) -> bool:
    """Whether the frame that called a torch function is a dispatcher's own code."""
    found = _DISPATCHER.get(code)
    if found is None:
        found = _DISPATCHER[code] = code.co_filename.startswith(_DISPATCHER_DIRS)
    return found


def _is_internal(code) -> bool:
    internal = _INTERNAL.get(code)
    if internal is None:
        fn = code.co_filename
        # A dispatcher's forward wrapper stands between the model's line and the module it calls.
        internal = fn.startswith(_TORCH_DIR) or fn.startswith(_OWN) or fn.startswith("<frozen") or \
            bool(_DISPATCHER_DIRS) and fn.startswith(_DISPATCHER_DIRS)
        _INTERNAL[code] = internal
    return internal


def _source(f) -> tuple[Any, int]:
    """The code object and line of the first frame from ``f`` outwards that is the model's own."""
    internal = _INTERNAL
    while f is not None:
        code = f.f_code
        found = internal.get(code)
        if found is None:
            found = _is_internal(code)
        if not found:
            return code, f.f_lineno
        f = f.f_back
    return None, 0


# Functions whose calls need none of the per-call checks (in place, random, guard): the op
# path looks them up here first.
_PLAIN: dict[Any, Any] = {}


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


class Recorder(TorchFunctionMode):
    """Records every torch function / tensor method call made while it is active."""

    def __init__(self, trace: Trace, op_steps: list[Step] | None = None, until: Any = None, *,
                 save: Selector | None = None, grad: bool = False, sink: Any = None,
                 max_bytes: int | None = None) -> None:
        super().__init__()
        # The process may grow by max_bytes during the capture; checked every _CHECK_EVERY ops
        # (a read of the resident size, ~10 us), so the check costs nothing per op.
        self.max_bytes = max_bytes
        self.rss0 = _resident_bytes() if max_bytes is not None else None
        self.until_check = _CHECK_EVERY
        # With store=, each kept value is copied to ``sink`` (a disk store) as it is produced.
        self.sink = sink
        self.transient = save is not None or sink is not None
        # With save=, values the selector does not ask for are held weakly (freed when the forward
        # frees them): the peak is bounded, not only what is kept.
        self.save = save
        self.grad = grad  # hook every kept output so a backward leaves its gradient on the trace
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
        return _source(sys._getframe(3))  # skip source(), _record(), __torch_function__

    # -- the hot path --------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if self.paused:
            return func(*args, **kwargs)
        try:
            info = _PLAIN.get(func)
        except TypeError:  # an unhashable callable: classified on each call by info_for
            info = None
        if info is not None and "out" not in kwargs:
            flags, inplace, target = 0, False, None  # the common op: none of the checks apply
        else:
            info = info_for(func)
            flags, inplace, target = self._checks(func, info, args, kwargs)

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
            self._data_read(func, info.name, args, kwargs, out)
        return out

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
            for t in (target,) if isinstance(target, Tensor) else target if isinstance(target, (tuple, list)) else ():
                if isinstance(t, Tensor) and self._before_inplace(t, info.name, out_arg):
                    flags |= ALIAS_MUTATION
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
        trace = self.trace
        ops = self.ops
        index = len(ops)
        caller = sys._getframe(2)  # skip _record(), __torch_function__
        code = caller.f_code
        if _INTERNAL.get(code) is False:  # called from the model's own line (never a dispatcher's): no walk
            lineno = caller.f_lineno
        else:
            code, lineno = _source(caller)
            if _DISPATCHER_DIRS and _is_dispatcher(caller.f_code):
                # A dispatcher's move of an activation is kept (the model reads its output: an edit
                # must propagate through it) under its own stem; its weight on/offloads are not ops.
                if not any(trace.producer_ref(t, index) is not None for t in _tensor_args(args, kwargs)):
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
        op = Op(index, label, func, info.name, value, module, module_pass, code, lineno, args, kwargs, flags)
        op._trace_ref = self.trace_ref
        if not self.transient:
            trace.add_recorded_op(op, multi)
        else:
            keep = bool(flags & GUARD) or self.save is None or self.save.matches_op(op)
            trace.add_transient_op(op, multi, keep)
            if keep and self.sink is not None and not flags & GUARD:  # guard values stay: replay compares them
                trace.spill(index, self.sink)
        if self.rss0 is not None:
            self.until_check -= 1
            if not self.until_check:
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
        self.until_check = _CHECK_EVERY
        grown = _resident_bytes() - self.rss0
        if grown > self.max_bytes:
            raise CaptureMemoryError(
                f"the capture grew this process by {grown / 2**20:.0f} MiB after {len(self.ops)} ops, more than "
                f"max_bytes={self.max_bytes / 2**20:.0f} MiB; the forward was stopped before memory ran out",
                grown=grown, max_bytes=self.max_bytes,
            )

    def _keep(self, index: int) -> None:
        """Keep op ``index``'s value after all (a saved module returned it), on disk with store=."""
        trace = self.trace
        trace.keep_value(index)
        op = self.ops[index]
        if not op.saved:
            return
        if self.sink is not None:
            trace.spill(index, self.sink)
        elif self.storage is not None:  # copy on write protects it from now on
            self._index_storage(op)
        if self.grad:
            self._hook_grad(op)

    def _hook_grad(self, op: Op) -> None:
        """Leave the gradient of each output tensor that requires one on the trace, when a backward runs."""
        out = self._live_out(op) if op.saved else None
        leaves = ((None, out),) if isinstance(out, Tensor) else enumerate(out) if out is not None else ()
        store = self.trace.store_grad
        with torch._C.DisableTorchFunction():  # our hook, not an op of the model
            for elem, t in leaves:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(functools.partial(_keep_grad, store, op.index, elem))

    def _data_read(self, func: Any, name: str, args: tuple, kwargs: dict, seen: Any) -> None:
        """Record a read of tensor data into Python (a guard): what was read, from which ops,
        and the value the forward saw, so replay can recompute it and compare."""
        position = len(self.ops)
        leaves, spec = flatten((args, kwargs))
        ref = None
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                found = self.trace.producer_ref(leaf, position)
                if found is not None:
                    leaves[i] = found
                    ref = ref or found
        if _DISPATCHER_DIRS and _is_dispatcher(sys._getframe(2).f_code):
            return  # a dispatcher looking at a tensor (its device, its pointer), not the model branching
        code, lineno = self.source()
        self.trace.record_data_read(position, ref, code, lineno, name, func=func, args_spec=(leaves, spec), seen=seen)

    # -- copy on write for in-place ops -----------------------------------------------------------
    def _storage_key(self, t: Tensor) -> int | None:
        try:
            # Views share their base's storage, whatever their offset. A tensor with no memory
            # yet (torch.empty(0), later filled through out=) is keyed by the object itself.
            return t.untyped_storage().data_ptr() or -id(t)
        except (RuntimeError, NotImplementedError):
            return None

    def _live_out(self, op: Op) -> Any:
        """The tensors op ``op`` produced, as the model still holds them (a bounded or disk-backed
        capture keeps only weak references, or its own copy on disk)."""
        out = op._out
        if self.transient and (out is None or isinstance(out, Deferred)):
            return self.trace.live_value(op.index)
        return out

    def _index_storage(self, op: Op) -> None:
        out = self._live_out(op)
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        for t in leaves:
            if isinstance(t, Tensor):
                key = self._storage_key(t)
                if key:
                    self.storage.setdefault(key, []).append(op.index)

    def _before_inplace(self, target: Tensor, name: str, out_arg: bool = False) -> bool:
        """Snapshot every recorded tensor the in-place op ``name`` on ``target`` is about to change.

        Works leaf by leaf: one element of a tuple output (``topk``, ``split``...) is copied
        when it is the target or overlaps the memory the op writes; the other elements keep
        sharing memory with the model and stay indexed.

        Args:
            target: the tensor the op mutates (``args[0]`` or an ``out=`` tensor).
            name: the op's name, which says whether it writes data or only moves metadata.
            out_arg: ``target`` is an ``out=`` argument, which the op may resize (and so move).

        Returns:
            True when the overwritten memory is viewed by other recorded tensors, whose
            later readers would see data the recorded graph does not describe.
        """
        if self.storage is None:
            self.storage = {}
            for op in self.ops:
                self._index_storage(op)
        key = self._storage_key(target)
        bucket = self.storage.pop(key, None) if key else None
        if not bucket:
            return False
        # ``span``: the memory the op writes (None: no data written, only ``target`` changes
        # shape or storage). ``moves``: the op may give the storage new memory, which changes
        # where every tensor on it points: all of them are copied (their values stay).
        span = None if name in _RESHAPES_IN_PLACE or name in _REALLOCATES else _span(target)
        moves = out_arg or name in _REALLOCATES
        aliased = False
        keep: list[int] = []
        ops = self.ops
        position = len(ops)
        for index in dict.fromkeys(bucket):
            op = ops[index]
            out = self._live_out(op)
            if out is None:
                continue  # freed: nothing left to overwrite
            detached = out is not op._out  # the record holds its own copy (on disk) or nothing: never copy it
            multi = not isinstance(out, Tensor)
            leaves = list(out) if multi else [out]
            copied = shared = others = False
            for i, t in enumerate(leaves):
                if not isinstance(t, Tensor) or (multi and self._storage_key(t) != key):
                    continue
                written = t is not target and span is not None and _overlap(_span(t), span)
                if t is target or written or moves:
                    if not detached:
                        leaves[i] = t.clone()
                        copied = True
                    others = others or written
                else:
                    shared = True
            if shared:  # still views the model's memory: a later write must find it again
                keep.append(index)
            if others:
                aliased = True
                self.stale.setdefault(index, position)
            if not copied:
                continue
            op._out = type(out)(leaves) if multi else leaves[0]
            op.snapshotted = True
        if keep:
            self.storage[key] = keep
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
            applied = AppliedEdit(when.site.describe(), label, module_pass, count_changed(value, edited), "captured",
                                  before=value)
            land_edit(self.trace, when.edit, applied)  # reported (or refused, strict) before it enters the graph
        finally:
            self.paused = False
        index = len(self.ops)
        op = Op(index, self.label("edit"), applier, "edit", result, module, module_pass, None, 0, tuple(leaves), {},
                EDIT)
        op._code, op._lineno = getattr(record, "_code", None), getattr(record, "_lineno", 0)
        self.trace.add_op(op)
        if self.save is not None:
            self.trace.link_args(op)  # the value before the edit is not held through its arguments
        if spec is None:
            self.trace.register_tensor(result, index, None)
        else:
            for i, leaf in enumerate(result):
                if isinstance(leaf, Tensor):
                    self.trace.register_tensor(leaf, index, i)
        if self.storage is not None:
            self._index_storage(op)
        when.fired.append(label)
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
        n = call.op_end = len(self.ops)
        if type(output) is Tensor:  # the common module output, without the generic walk
            refs = [self.trace.producer_ref(output, n)]
        else:
            refs, call.out_spec = self.trace.refs_for_value(output, n)
        if self.stale:
            # Memory of that op was overwritten through another view before the module returned:
            # no recorded op produced what it returns, so the call keeps its own copy instead.
            refs = [None if r is not None and r.index in self.stale else r for r in refs]
        call.out_refs = refs
        if self.save is None or self.save.matches_call(call):
            call._out = output if call.out_spec is None and refs[0] is not None else \
                self._kept_output(output, refs, call.out_spec)
            if self.sink is not None:  # on disk, its tensors are read through the ops that produced them
                leaves, spec = flatten(call._out)
                # placeholders must not be None: a ModelOutput drops None fields, losing leaves
                call._out = unflatten([0 if r is not None else x for x, r in zip(leaves, refs)], spec)
            for ref in refs if self.save is not None else ():
                if ref is not None and not self.ops[ref.index].saved:
                    self._keep(ref.index)
        if self.transient:
            call.args, call.kwargs = (), {}  # the module's inputs are ops' values: freed with them
        if stop:
            raise StopCapture(call.key)
        return replaced

    @staticmethod
    def _kept_output(output: Any, refs: list, spec: Any) -> Any:
        """The module output as the call record keeps it, safe from later changes by the model.

        Tensors some recorded op produced are guarded by copy on write already; a tensor no
        op produced (a buffer, a tensor made outside the capture) is copied now, and a
        container the model could refill (list, dict, ``ModelOutput``) is rebuilt.
        """
        if spec is None and refs[0] is not None:
            return output
        leaves, _ = flatten(output)
        copied = False
        for i, ref in enumerate(refs):
            if ref is None and isinstance(leaves[i], Tensor):
                with torch._C.DisableTorchFunction():  # our copy, not an op of the model
                    leaves[i] = leaves[i].clone()
                copied = True
        if copied or type(output) is not tuple:
            return unflatten(leaves, spec)
        return output


_CHECK_EVERY = 64  # ops between two reads of the resident size (max_bytes=)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_STATM: list[int | None] = [None, None]  # (pid, fd) kept open: a pread is ~1 us, an open() several


def _statm() -> int | None:
    pid = os.getpid()
    if _STATM[0] != pid:  # first use, or a forked child: /proc/self was resolved for the parent
        try:
            _STATM[1] = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            _STATM[1] = None
        _STATM[0] = pid
    return _STATM[1]


def _resident_bytes() -> int:
    """The process's resident memory now (Linux), or its peak so far where that is all there is."""
    try:
        fd = _statm()
        if fd is None:
            raise OSError("no /proc/self/statm")
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE
    except OSError:
        if resource is None:
            return 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _keep_grad(store, index: int, elem: int | None, grad: Tensor) -> None:
    store(index, elem, grad)


def _tensor_args(args: tuple, kwargs: dict) -> list[Tensor]:
    return [t for t in flatten((args, kwargs))[0] if isinstance(t, Tensor)]


def _span(t: Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``t`` can touch (empty for no elements)."""
    if t.numel() == 0:
        return (0, 0)
    size = t.element_size()
    start = t.storage_offset() * size
    reach = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (start, start + reach * size)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]
