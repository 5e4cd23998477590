"""``Graph``: what one real forward recorded, and how engines and loaders build it.

The records (ops, module calls), the links from each op's arguments to the ops that produced
them, the data reads the forward made (guards), the model output and the values kept. Only
``Graph``'s methods write this state: engines build it through ``add_*`` / ``record_*`` /
``finish``, loaders through ``restore``. :class:`~torchlens.core.trace.Trace` adds reading,
navigation and branching on top.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any, NamedTuple

import torch

from ..errors import ReplayNotExactError, ValueNotSavedError
from .records import GUARD, INPUT, Deferred, ModuleCall, Op, Ref
from .selectors import Selector
from .steps import Step
from .tree import flatten, held_tensors, unflatten
from .writes import AliasWrite

__all__ = ["MISSING", "DataRead", "Graph"]


class _Missing:
    pass


MISSING = _Missing()  # "no value here" where None is a value

# Argument types that are never containers. ``(args, kwargs)`` made of them, and of tuples and
# lists of them (shapes, dims), flattens to a spec fixed by its signature, shared by every op with
# that signature. A spec per op was a third of the graph's bytes (a few hundred bytes each).
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, bool, complex, str, type(None), slice,
                         type(Ellipsis), torch.dtype, torch.device, torch.layout, torch.memory_format})
_FLAT_CONTAINERS = frozenset({tuple, list, torch.Size})  # pytree nodes whose children are their items
_ARG_SPECS: dict[tuple, Any] = {}


def _flatten_args(args: Any, kwargs: Any) -> tuple[list[Any], Any]:
    """``flatten((args, kwargs))``, with one shared spec per signature in the common cases."""
    if type(args) is not tuple or type(kwargs) is not dict:
        return flatten((args, kwargs))
    leaves: list[Any] = []
    shape: list[Any] = []
    for a in (*args, *kwargs.values()):
        kind = type(a)
        if kind in _LEAF_TYPES:
            leaves.append(a)
            shape.append(None)
        elif kind in _FLAT_CONTAINERS and all(type(x) in _LEAF_TYPES for x in a):
            leaves.extend(a)
            shape.append((kind, len(a)))
        else:
            return flatten((args, kwargs))
    key = (len(args), tuple(kwargs), tuple(shape))
    spec = _ARG_SPECS.get(key)
    if spec is None:
        spec = _ARG_SPECS[key] = flatten((args, kwargs))[1]
    return leaves, spec


class DataRead(NamedTuple):
    """A data-dependent read the forward made (``bool``, ``.item()`` ...) before op ``position``: a guard.

    ``func`` and ``args_spec`` (arguments with ``Ref`` leaves for recorded tensors) let replay
    recompute the read; ``seen`` is the value the forward saw. A read loaded from disk may lack
    them (``func is None``): replay then cannot check it and refuses to cross it.
    """

    position: int
    ref: Ref | None
    code: Any
    lineno: int
    name: str
    func: Any = None
    args_spec: Any = None
    seen: Any = None

    @property
    def source(self) -> str:
        return f"{getattr(self.code, 'co_filename', '<unknown>')}:{self.lineno}"

    @property
    def refs(self) -> list[Ref]:
        """Every recorded op this read reads from."""
        if self.args_spec is None:
            return [self.ref] if self.ref is not None else []
        return [leaf for leaf in self.args_spec[0] if type(leaf) is Ref]


class Graph:
    """The record of one forward, as engines and loaders build it (see the module docstring)."""

    def __init__(self, model: torch.nn.Module | None = None, args: tuple = (), kwargs: dict | None = None, *,
                 engine: str = "", op_graph: bool = True, strict: bool = False) -> None:
        self.model = model
        self.strict = strict  # an edit on it (or its forks) that changes nothing raises, not warns
        self.args = args
        self.kwargs = kwargs or {}
        self.name = "trace"
        self.engine = engine  # which engine captured it (shown, saved; never branched on)
        self.ops: list[Op] = []
        self.calls: list[ModuleCall] = []
        self.input_layers: list[str] = []
        self.output_layers: list[str] = []
        self.data_reads: list[DataRead] = []
        self.edits: list[Any] = []  # AppliedEdit records, in the order edits landed
        self.steps: list[Step] = []  # capture-time steps, in order
        self.grad = False  # whether the capture ran with autograd (replay follows it)
        self.complete = True  # False for a transaction stopped early
        self.fingerprint: dict[str, Any] | None = None  # the model's, for a trace loaded from disk
        self.unsaved_steps: list[str] = []  # why steps of a loaded trace could not be saved
        self.saved_tensor_names: dict[int, str] = {}  # parameter names a loaded trace was saved with
        self._op_graph = op_graph
        self._labels: dict[str, int] = {}
        self._calls_by_address: dict[str, list[ModuleCall]] = {}
        # id(tensor) -> the op index that produced it (an int: the commonest entry, one op, one tensor
        # out, and no allocation a collector must track), (index, elem) for an element of a
        # multi-output op, or a list of (index, elem) pairs in op order for a tensor several ops returned.
        self._producers: dict[int, int | tuple[int, int | None] | list[tuple[int, int | None]]] = {}
        self._output_raw: Any = None
        self._output_refs: list[Ref | None] = []
        self._output_deferred = False  # output tensors are read through their ops (kept on disk)
        # id(object) -> (object, [(path, Ref | None)]): the tensors an object of the output that flatten keeps
        # whole (a KV cache) holds, and the ops that produced them (see note_held)
        self._held: dict[int, tuple[Any, list[tuple[tuple, Ref | None]]]] = {}
        self._graph_ready = False
        self._values: dict[int, Any] = {}
        self._stale: dict[int, int] = {}  # op index -> position after which its memory was overwritten
        self._alias_writes: dict[int, list[AliasWrite]] = {}  # op index -> writes through other views into it
        # A bounded capture (save=) keeps weak references to every op output, to link arguments to
        # live producers and to keep a module output the selector asks for once the module returns.
        self._weak: dict[int, Any] = {}
        self._grads: dict[int, Any] = {}  # op index -> gradient of its output (grad=True, after a backward)

    # -- capabilities ------------------------------------------------------------------------
    @property
    def has_op_graph(self) -> bool:
        """Whether every op of the forward was recorded (replay and validate need it)."""
        return self._op_graph

    def require_op_graph(self, what: str) -> None:
        """Raise ``ReplayNotExactError`` naming ``what`` when this trace holds no op graph."""
        if not self._op_graph:
            raise ReplayNotExactError(
                f"this trace was captured without an op graph ({self.engine or 'module outputs only'}); "
                f"{what} needs one",
                remedy="Re-execute with do(site, edit, model=model, inputs=x), or capture with tl.trace(model, x) "
                "(without a module-only save= next to intervene=) to get the graph.",
            )

    # -- building (engines and loaders) ----------------------------------------------------
    def add_op(self, op: Op) -> None:
        """Append one op record (its label must be new)."""
        op.trace = self
        self._labels[op.label] = op.index
        self.ops.append(op)

    def relabel(self, index: int, label: str) -> None:
        """Give op ``index`` the name ``label`` instead of its numbered one (a sub-site a capture adds,
        such as a feature dictionary's ``<site>.features``); the label must be new."""
        op = self.ops[index]
        if self._labels.get(op.label) == index:
            del self._labels[op.label]
        op.label = label
        self._labels[label] = index

    def add_recorded_op(self, op: Op, multi: bool) -> None:
        """The recorder's hot path: append ``op`` and register the tensors it produced."""
        index = op.index
        self._labels[op.label] = index
        self.ops.append(op)
        out = op._out
        if not multi:
            self.register_tensor(out, index, None)
            return
        for i, t in enumerate(out):
            if t is not None:
                self.register_tensor(t, index, i)

    def add_recorded_tensor_ops(self, rows: list[tuple], counters: dict[str, int], trace_ref: Any) -> None:
        """Append the ops a capture noted as compact rows, in order, each as ``add_recorded_op`` (one
        tensor out) would.

        A row is ``(func, info, out, call, code, line, lasti, args, kwargs)``: ``info`` gives the
        label stem and function name (``counters`` numbers the labels per stem), ``call`` the module
        call the op ran in. Built in one loop after the ops ran: the same records as one call per
        op, without a call per op.
        """
        new = object.__new__
        labels = self._labels
        ops = self.ops
        producers = self._producers
        index = len(ops)
        for func, info, out, call, code, line, lasti, args, kwargs in rows:
            stem = info.stem
            n = counters.get(stem, 0) + 1
            counters[stem] = n
            label = f"{stem}_{n}"
            # ``Op.recorded``'s fields, set here: a Python call per op (13 arguments) cost a third
            # of making the records
            op = new(Op)
            op.index = index
            op.label = label
            op.func = func
            op.func_name = info.name
            op._out = out
            op.saved = True
            op.module = call.address
            op.module_pass = call.pass_index
            op._code = code
            op._line = line
            op._lasti = lasti
            op.args = args
            op.kwargs = kwargs
            op.flags = 0
            op._trace_ref = trace_ref
            op.args_spec = None
            op.parent_refs = None
            op.children_idx = None
            op.snapshotted = False
            op._meta = None
            ops.append(op)
            labels[label] = index
            key = id(out)  # ``register_tensor(out, index, None)``, inlined: this loop runs for every op
            entry = producers.get(key)
            if entry is None:
                producers[key] = index
            else:
                self._add_producer(key, entry, index, None)
            index += 1

    def add_transient_op(self, op: Op, multi: bool, keep: bool) -> None:
        """A bounded capture's hot path: append ``op``, link its arguments now, and unless ``keep``
        hold its output only weakly, so it is freed as soon as the forward itself lets go of it."""
        self.add_recorded_op(op, multi)
        out = op._out
        self._weak[op.index] = (type(out), [None if t is None else weakref.ref(t) for t in out]) if multi \
            else weakref.ref(out)
        self.link_args(op)
        if not keep:
            op.drop_value()

    def link_args(self, op: Op) -> None:
        """Turn ``op``'s raw arguments into ``args_spec`` now, refs to live producers only, and drop them."""
        self._resolve_args(op)
        op.args = op.kwargs = None

    def _resolve_args(self, op: Op) -> None:
        """``op.args_spec`` (its arguments with a ``Ref`` for each recorded tensor) and ``op.parent_refs``."""
        leaves, spec = _flatten_args(op.args, op.kwargs)
        refs: list[Ref] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                ref = self.producer_ref(leaf, op.index)
                if ref is not None:
                    leaves[i] = ref
                    refs.append(ref)
        op.args_spec = (leaves, spec)
        op.parent_refs = refs

    def _alive(self, ref: Ref) -> Any:
        """The live tensor op ``ref`` produced in a bounded capture (None once freed): an id reused
        by a newer tensor must not link it to the op that made the old one."""
        weak = self._weak.get(ref.index)
        if weak is None:  # an input or a capture-time edit: held strongly
            op = self.ops[ref.index]
            if not op.saved:
                return None
            return op._out if ref.elem is None else op._out[ref.elem]
        if isinstance(weak, tuple):
            weaks = weak[1]
            weak = weaks[ref.elem] if ref.elem is not None and ref.elem < len(weaks) else None
        elif ref.elem is not None:
            weak = None
        return weak() if weak is not None else None

    def live_value(self, index: int) -> Any:
        """Op ``index``'s output as the model still holds it in a bounded capture (None: freed)."""
        weak = self._weak.get(index)
        if weak is None:
            op = self.ops[index]
            return op._out if op.saved else None
        if isinstance(weak, tuple):
            kind, weaks = weak
            leaves = [None if w is None else w() for w in weaks]
            return None if all(v is None for v in leaves) else kind(leaves)
        return weak()

    def spill(self, index: int, sink: Any) -> None:
        """Move op ``index``'s value into ``sink`` (a disk store: ``put(key, value)`` returns a
        ``Deferred`` that reads it back); the op keeps that handle, not the tensor. The sink also
        gets the op itself (its function and linked arguments), to keep a recipe instead of bytes."""
        op = self.ops[index]
        op.defer_value(sink.put(op.label, op._out, op))

    def keep_value(self, index: int) -> None:
        """A bounded capture keeps op ``index``'s output after all (a module the selector saves returned it)."""
        op = self.ops[index]
        if op.saved:
            return
        weak = self._weak.get(index)
        if isinstance(weak, tuple):
            kind, weaks = weak
            leaves = [None if w is None else w() for w in weaks]
            if any(v is None and w is not None for v, w in zip(leaves, weaks)):
                return  # freed already: nothing left to keep
            op.restore_value(kind(leaves))
        elif weak is not None and weak() is not None:
            op.restore_value(weak())

    def store_grad(self, index: int, elem: int | None, grad: torch.Tensor) -> None:
        """Note the gradient a backward computed for op ``index``'s output (element ``elem``)."""
        if elem is None:
            self._grads[index] = grad
        else:
            self._grads.setdefault(index, {})[elem] = grad

    def grad_of(self, op: Op) -> Any:
        """The gradient of op ``op``'s output (a tuple for a multi-output op).

        Raises:
            ValueNotSavedError: no gradient was recorded for it (see the message for why).
        """
        g = self._grads.get(op.index, MISSING)
        if g is MISSING:
            why = ("the trace was captured without grad=True" if not self.grad else
                   "no backward has reached it yet (call .backward() on something computed from the output)"
                   if op.saved else "save= excluded it")
            raise ValueNotSavedError(f"op {op.label!r} has no gradient: {why}", site=op.label,
                                     remedy="Capture with tl.trace(model, x, grad=True) (and a save= that "
                                            "includes it), then call loss.backward().")
        if isinstance(g, dict):
            n = len(op._out) if op.saved else max(g) + 1
            return tuple(g.get(i) for i in range(n))
        return g

    @property
    def nbytes(self) -> int:
        """Bytes held by the recorded op values and module outputs (each storage counted once)."""
        seen: set[int] = set()
        total = 0
        values = [op._out for op in self.ops if op.saved] + [c._out for c in self.calls if c._out is not None]
        for value in values:
            for t in flatten(value)[0]:
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    try:
                        storage = t.untyped_storage()
                    except (RuntimeError, NotImplementedError):
                        continue
                    key = storage.data_ptr() or id(storage)
                    if key not in seen:
                        seen.add(key)
                        total += storage.nbytes()
        return total

    def add_call(self, call: ModuleCall, trace_ref: Any = None) -> None:
        """Append one module call record (``trace_ref``: a ``weakref.ref`` to this trace, when the
        caller holds one already: a capture makes one for all its records)."""
        if trace_ref is not None:
            call._trace_ref = trace_ref
        else:
            call.trace = self
        self.calls.append(call)
        same = self._calls_by_address.get(call.address)
        if same is None:  # the first call of that module
            self._calls_by_address[call.address] = [call]
        else:
            same.append(call)

    def take_records(self) -> None:
        """Point every op and module call at this trace: a fork that became a re-executed capture
        owns that capture's records (the capture itself is dropped, and records link weakly)."""
        ref = weakref.ref(self)
        for record in (*self.ops, *self.calls):
            record._trace_ref = ref

    def passes_of(self, address: str) -> int:
        """How many calls of the module at ``address`` were recorded (``ModuleCall.n_passes``)."""
        return len(self._calls_by_address.get(address, ()))

    def add_input(self, label: str) -> None:
        self.input_layers.append(label)

    def register_tensor(self, tensor: torch.Tensor, index: int, elem: int | None) -> None:
        """Note that op ``index`` (element ``elem`` of a multi-output op) produced ``tensor``."""
        # One entry for a tensor one op produced (nearly all of them), a list of pairs in op order for
        # one several ops returned (in-place ops): a list per tensor doubled its bytes.
        key = id(tensor)
        entry = self._producers.get(key)
        if entry is None:
            self._producers[key] = index if elem is None else (index, elem)
        else:
            self._add_producer(key, entry, index, elem)

    def _add_producer(self, key: int, entry: Any, index: int, elem: int | None) -> None:
        """A tensor some op produced already is returned by op ``index`` too (an in-place op)."""
        if type(entry) is int:
            self._producers[key] = [(entry, None), (index, elem)]
        elif type(entry) is tuple:
            self._producers[key] = [entry, (index, elem)]
        else:
            entry.append((index, elem))

    def producer_ref(self, tensor: Any, before: int) -> Ref | None:
        """The op that last produced ``tensor`` before op index ``before`` (None: not recorded)."""
        entry = self._producers.get(id(tensor))
        if entry is None:
            return None
        if type(entry) is int:
            if entry >= before:
                return None
            ref = Ref(entry, None)
        elif type(entry) is tuple:
            if entry[0] >= before:
                return None
            ref = Ref(*entry)
        else:
            k = bisect.bisect_left(entry, (before,)) - 1  # (i, elem) < (before,) exactly when i < before
            if k < 0:
                return None
            ref = Ref(*entry[k])
        if self._weak and self._alive(ref) is not tensor:
            return None  # a bounded capture freed that op's output: this is a newer tensor with its id
        return ref

    def refs_for_value(self, value: Any, before: int) -> tuple[list[Ref | None], Any]:
        leaves, spec = flatten(value)
        refs = [self.producer_ref(leaf, before) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        return refs, spec

    def note_held(self, output: Any) -> None:
        """Note the ops that produced the tensors held inside objects of ``output`` that ``flatten``
        keeps whole (a KV cache's keys and values, made by ``cat`` or an in-place update), while the
        ids still name them: a fork's output holds its own values there (``Trace.held_now``)."""
        held: dict[int, tuple[Any, list[tuple[tuple, Ref | None]]]] = {}
        end = len(self.ops)
        # the model output, and module outputs that are not a bare tensor (a base model returning the cache)
        for value in (output, *(c._out for c in self.calls if c._out is not None and type(c._out) is not torch.Tensor)):
            for leaf in flatten(value)[0]:
                if leaf is None or isinstance(leaf, (torch.Tensor, int, float, bool, str)) or id(leaf) in held:
                    continue
                refs = [(path, self.producer_ref(t, end)) for path, t in held_tensors(leaf)]
                if any(ref is not None for _, ref in refs):
                    held[id(leaf)] = (leaf, refs)
        self._held = held

    def record_data_read(self, position: int, ref: Ref | None, code: Any, lineno: int, name: str, *,
                         func: Any = None, args_spec: Any = None, seen: Any = None) -> None:
        """Note a read of tensor data into Python made before op ``position`` (a guard)."""
        if hasattr(seen, "shape") and hasattr(seen, "copy") and not isinstance(seen, torch.Tensor):
            seen = seen.copy()  # a NumPy array may share the tensor's memory
        self.data_reads.append(DataRead(position, ref, code, lineno, name, func, args_spec, seen))

    def record_edit(self, applied: Any) -> None:
        """Note an edit that landed (an ``AppliedEdit``)."""
        self.edits.append(applied)

    def set_output(self, output: Any, refs: list[Ref | None] | None = None) -> None:
        """The model's return value (and, when known, the ops its tensors came from)."""
        self._output_raw = output
        if refs is not None:
            self._output_refs = refs
            self.output_layers = list(dict.fromkeys(self.ops[r.index].label for r in refs if r is not None))

    def finish(self, output: Any, *, steps: list[Step], save: Selector | None = None, grad: bool = False,
               complete: bool = True, stale: dict[int, int] | None = None,
               output_refs: list[Ref | None] | None = None,
               alias_writes: dict[int, list[AliasWrite]] | None = None) -> None:
        """Called once the forward returned: record outputs, then drop unsaved values.

        ``output_refs``: the ops that produced ``output``'s tensor leaves, as ``refs_for_value``
        would find them after the last op, when the caller knows them already (the outermost
        module call returned ``output``); else they are looked up here.
        """
        self.steps = list(steps)
        self.grad = grad
        self.complete = complete
        self._stale = dict(stale or {})
        self._alias_writes = dict(alias_writes or {})
        if not self._op_graph:
            self.set_output(output)
            return
        self.set_output(output, output_refs if output_refs is not None else
                        self.refs_for_value(output, len(self.ops))[0])
        if save is not None:
            self.ensure_graph()
            matched = save.match(self)
            keep = {id(r) for r in matched}
            for r in matched:  # a kept module output is read through the ops that produced it
                if isinstance(r, ModuleCall):
                    keep.update(id(self.ops[ref.index]) for ref in r.out_refs if ref is not None)
                elif self.capture_edit_of(r.index) is not None:  # a kept edited op reads as its edit
                    keep.add(id(self.ops[self.capture_edit_of(r.index)]))
            for op in self.ops:
                if id(op) not in keep and not op.flags & (INPUT | GUARD):  # guard ops: replay compares them
                    op.drop_value()
            for call in self.calls:
                if id(call) not in keep:
                    call._out = None
            for op in self.ops:
                op.args = op.kwargs = None
        self.note_held(output)  # after save= dropped module outputs: only the kept ones are scanned
        self._defer_output()

    def _defer_output(self) -> None:
        """Drop the model output's tensors whose ops keep their values deferred (``store=``: on
        disk): ``output`` reads them back through those ops, so the trace does not hold them."""
        ops, stale = self.ops, self._stale
        if not any(ref is not None and ref.index not in stale and isinstance(ops[ref.index]._out, Deferred)
                   for ref in self._output_refs):
            return  # nothing on disk (every in-memory capture): no walk of the output
        leaves, spec = flatten(self._output_raw)
        deferred = False
        for i, ref in enumerate(self._output_refs):
            if ref is not None and ref.index not in self._stale and isinstance(self.ops[ref.index]._out, Deferred):
                leaves[i] = 0  # placeholders must not be None: a ModelOutput drops None fields
                deferred = True
        if deferred:
            self._output_raw = unflatten(leaves, spec)
            self._output_deferred = True

    def recorded_output(self) -> Any:
        """The model's return value as the forward produced it (tensors kept on disk read back)."""
        if not self._output_deferred:
            return self._output_raw
        leaves, spec = flatten(self._output_raw)
        for i, ref in enumerate(self._output_refs):
            if ref is not None and ref.index not in self._stale:
                v = self.ops[ref.index].out
                leaves[i] = v if ref.elem is None else v[ref.elem]
        return unflatten(leaves, spec)

    def restore(self, *, name: str, engine: str, op_graph: bool, complete: bool, grad: bool,
                fingerprint: dict[str, Any] | None, args: tuple, kwargs: dict, input_layers: list[str],
                output_layers: list[str], output: Any, output_refs: list[Ref | None], data_reads: list[DataRead],
                stale: dict[int, int], edits: list[Any], steps: list[Step], unsaved_steps: list[str],
                saved_tensor_names: dict[int, str]) -> None:
        """Set the state a loader decoded from disk (ops and calls were added one by one first)."""
        self.name, self.engine, self._op_graph = name, engine, op_graph
        self.complete, self.grad, self.fingerprint = complete, grad, fingerprint
        self.args, self.kwargs = args, kwargs
        self.input_layers, self.output_layers = list(input_layers), list(output_layers)
        self._output_raw = output
        self._output_refs = list(output_refs)
        self.data_reads = list(data_reads)
        self._stale = dict(stale)
        self.edits = list(edits)
        self.steps = list(steps)
        self.unsaved_steps = list(unsaved_steps)
        self.saved_tensor_names = dict(saved_tensor_names)
        self._graph_ready = False
        self.ensure_graph()

    def ensure_graph(self) -> None:
        """Turn every op's raw arguments into ``args_spec`` (refs to parent ops + constants)."""
        if self._graph_ready:
            return
        ops = self.ops
        for op in ops:
            if op.args_spec is not None or op.flags & INPUT:
                op.parent_refs = op.parent_refs or []
                continue
            self._resolve_args(op)
        for op in ops:
            op.children_idx = []
        for op in ops:
            for ref in dict.fromkeys(r.index for r in op.parent_refs):
                ops[ref].children_idx.append(op.index)
        self._graph_ready = True
