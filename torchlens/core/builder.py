"""``TraceBuilder``: the one writer of a :class:`~torchlens.core.graph.Graph` while it is built.

Capture engines make one per forward (``TraceBuilder(model, args, kwargs, engine=...)``), add
records as the forward runs (``add_op``, ``add_call``, ``register_tensor``, ``record_data_read``,
``record_edit`` ...) and call :meth:`TraceBuilder.finish` once it returned; the loader decodes a
saved trace through ``add_op`` / ``add_call`` and :meth:`TraceBuilder.restore`. Both hand back
the :class:`~torchlens.core.trace.Trace`, which only reads. ``builder.trace`` is that trace while
it is being built (an edit applied during capture may read it).

The recorder binds the methods it calls per op to locals once per capture: the builder adds no
indirection on the hot path (its containers are the graph's own, held here once).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .graph import DataRead, Graph
from .records import GUARD, INPUT, Deferred, ModuleCall, Op, Ref
from .selectors import Selector
from .steps import Step
from .trace import Trace
from .tree import flatten, held_tensors, unflatten
from .writes import AliasWrite

__all__ = ["TraceBuilder"]


class TraceBuilder:
    """Builds the graph of one forward and hands back its :class:`Trace` (see the module docstring).

    Args:
        model: the model that ran (None for a trace loaded from disk).
        args: its positional inputs.
        kwargs: its keyword inputs.
        engine: which engine captured it (shown and saved, never branched on).
        op_graph: whether every op is recorded (False: module outputs only).
        strict: an edit on the trace (or its forks) that changes nothing raises instead of warning.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: tuple = (), kwargs: dict | None = None, *,
                 engine: str = "", op_graph: bool = True, strict: bool = False) -> None:
        self.graph = graph = Graph(model, args, kwargs, engine=engine, op_graph=op_graph, strict=strict)
        self.trace = Trace(graph)
        self.strict = strict
        # the graph's containers, written here on every op (never reassigned while building)
        self.ops = graph.ops
        self.calls = graph.calls
        self._labels = graph.labels
        self._producers = graph.producers
        self._by_address = graph.calls_by_address
        # which op produced a tensor, as of op index ``before``: the read the capture itself makes
        # (the graph's own method, bound once: no call added per op)
        self.producer_ref = graph.producer_ref
        self.producer_ref = graph.producer_ref

    # -- ops -----------------------------------------------------------------------------------
    def add_op(self, op: Op) -> None:
        """Append one op record (its label must be new)."""
        op.trace = self.trace
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
        self.graph.weak[op.index] = (type(out), [None if t is None else weakref.ref(t) for t in out]) if multi \
            else weakref.ref(out)
        self.link_args(op)
        if not keep:
            op.drop_value()

    def link_args(self, op: Op) -> None:
        """Turn ``op``'s raw arguments into ``args_spec`` now, refs to live producers only, and drop them."""
        self.graph.resolve_args(op)
        op.args = op.kwargs = None

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

    # -- values of a bounded capture -------------------------------------------------------------
    def live_value(self, index: int) -> Any:
        """Op ``index``'s output as the model still holds it in a bounded capture (None: freed)."""
        weak = self.graph.weak.get(index)
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
        weak = self.graph.weak.get(index)
        if isinstance(weak, tuple):
            kind, weaks = weak
            leaves = [None if w is None else w() for w in weaks]
            if any(v is None and w is not None for v, w in zip(leaves, weaks)):
                return  # freed already: nothing left to keep
            op.restore_value(kind(leaves))
        elif weak is not None and weak() is not None:
            op.restore_value(weak())

    def store_grad(self, index: int, elem: int | None, grad: torch.Tensor) -> None:
        """Note the gradient a backward computed for op ``index``'s output (element ``elem``); called by
        the gradient hooks a ``grad=True`` capture leaves on the outputs, after the capture returned."""
        grads = self.graph.grads
        if elem is None:
            grads[index] = grad
        else:
            grads.setdefault(index, {})[elem] = grad

    # -- module calls, inputs, guards, edits -----------------------------------------------------
    def add_call(self, call: ModuleCall, trace_ref: Any = None, *, output: Any = None) -> None:
        """Append one module call record.

        Args:
            call: the record (``ModuleCall(address, pass_index, module_type, args, kwargs, op_start)``).
            trace_ref: a ``weakref.ref`` to the trace, when the caller holds one already (a capture
                makes one for all its records).
            output: what the call returned, kept on the record: an engine recording module outputs
                only keeps them so (an every-op engine reads them through the ops that made them).
        """
        if output is not None:
            call._out = output
        if trace_ref is not None:
            call._trace_ref = trace_ref
        else:
            call.trace = self.trace
        self.calls.append(call)
        same = self._by_address.get(call.address)
        if same is None:  # the first call of that module
            self._by_address[call.address] = [call]
        else:
            same.append(call)

    def add_input(self, label: str) -> None:
        """Name op ``label`` as an input of the forward."""
        self.graph.input_layers.append(label)

    def record_data_read(self, position: int, ref: Ref | None, code: Any, lineno: int, name: str, *,
                         func: Any = None, args_spec: Any = None, seen: Any = None) -> None:
        """Note a read of tensor data into Python made before op ``position`` (a guard)."""
        if hasattr(seen, "shape") and hasattr(seen, "copy") and not isinstance(seen, torch.Tensor):
            seen = seen.copy()  # a NumPy array may share the tensor's memory
        self.graph.data_reads.append(DataRead(position, ref, code, lineno, name, func, args_spec, seen))

    def record_edit(self, applied: Any) -> None:
        """Note a capture-time edit that landed (an ``AppliedEdit``)."""
        self.graph.edits.append(applied)

    # -- the end of the forward ------------------------------------------------------------------
    def _set_output(self, output: Any, refs: list[Ref | None] | None = None) -> None:
        """The model's return value (and, when known, the ops its tensors came from)."""
        graph = self.graph
        graph.output_raw = output
        if refs is not None:
            graph.output_refs = refs
            graph.output_layers = list(dict.fromkeys(self.ops[r.index].label for r in refs if r is not None))

    def note_held(self, output: Any) -> None:
        """Note the ops that produced the tensors held inside objects of ``output`` that ``flatten``
        keeps whole (a KV cache's keys and values, made by ``cat`` or an in-place update), while the
        ids still name them: a fork's output holds its own values there (``Trace._held_now``)."""
        held: dict[int, tuple[Any, list[tuple[tuple, Ref | None]]]] = {}
        end = len(self.ops)
        producer_ref = self.graph.producer_ref
        # the model output, and module outputs that are not a bare tensor (a base model returning the cache)
        for value in (output, *(c._out for c in self.calls if c._out is not None and type(c._out) is not torch.Tensor)):
            for leaf in flatten(value)[0]:
                if leaf is None or isinstance(leaf, (torch.Tensor, int, float, bool, str)) or id(leaf) in held:
                    continue
                refs = [(path, producer_ref(t, end)) for path, t in held_tensors(leaf)]
                if any(ref is not None for _, ref in refs):
                    held[id(leaf)] = (leaf, refs)
        self.graph.held = held

    def finish(self, output: Any, *, steps: list[Step], save: Selector | None = None, grad: bool = False,
               complete: bool = True, stale: dict[int, int] | None = None,
               output_refs: list[Ref | None] | None = None,
               alias_writes: dict[int, list[AliasWrite]] | None = None) -> Trace:
        """Called once the forward returned: record outputs, then drop unsaved values.

        ``output_refs``: the ops that produced ``output``'s tensor leaves, as ``refs_for_value``
        would find them after the last op, when the caller knows them already (the outermost
        module call returned ``output``); else they are looked up here.

        Returns:
            the trace, built.
        """
        graph = self.graph
        graph.steps = list(steps)
        graph.grad = grad
        graph.complete = complete
        graph.stale = dict(stale or {})
        graph.alias_writes = dict(alias_writes or {})
        if not graph.op_graph:
            self._set_output(output)
            return self.trace
        self._set_output(output, output_refs if output_refs is not None else
                         graph.refs_for_value(output, len(self.ops))[0])
        if save is not None:
            graph.ensure_graph()
            matched = save.match(self.trace)
            keep = {id(r) for r in matched}
            for r in matched:  # a kept module output is read through the ops that produced it
                if isinstance(r, ModuleCall):
                    keep.update(id(self.ops[ref.index]) for ref in r.out_refs if ref is not None)
                elif graph.capture_edit_of(r.index) is not None:  # a kept edited op reads as its edit
                    keep.add(id(self.ops[graph.capture_edit_of(r.index)]))
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
        return self.trace

    def _defer_output(self) -> None:
        """Drop the model output's tensors whose ops keep their values deferred (``store=``: on
        disk): ``output`` reads them back through those ops, so the trace does not hold them."""
        graph = self.graph
        ops, stale = self.ops, graph.stale
        if not any(ref is not None and ref.index not in stale and isinstance(ops[ref.index]._out, Deferred)
                   for ref in graph.output_refs):
            return  # nothing on disk (every in-memory capture): no walk of the output
        leaves, spec = flatten(graph.output_raw)
        deferred = False
        for i, ref in enumerate(graph.output_refs):
            if ref is not None and ref.index not in stale and isinstance(ops[ref.index]._out, Deferred):
                leaves[i] = 0  # placeholders must not be None: a ModelOutput drops None fields
                deferred = True
        if deferred:
            graph.output_raw = unflatten(leaves, spec)
            graph.output_deferred = True

    def restore(self, *, name: str, engine: str, op_graph: bool, complete: bool, grad: bool,
                fingerprint: dict[str, Any] | None, args: tuple, kwargs: dict, input_layers: list[str],
                output_layers: list[str], output: Any, output_refs: list[Ref | None], data_reads: list[DataRead],
                stale: dict[int, int], edits: list[Any], steps: list[Step], unsaved_steps: list[str],
                saved_tensor_names: dict[int, str]) -> Trace:
        """Set the state a loader decoded from disk (ops and calls were added one by one first).

        Returns:
            the trace, built.
        """
        graph = self.graph
        self.trace.name = name
        graph.engine, graph.op_graph = engine, op_graph
        graph.complete, graph.grad, graph.fingerprint = complete, grad, fingerprint
        graph.args, graph.kwargs = args, kwargs
        graph.input_layers, graph.output_layers = list(input_layers), list(output_layers)
        graph.output_raw = output
        graph.output_refs = list(output_refs)
        graph.data_reads = list(data_reads)
        graph.stale = dict(stale)
        graph.edits = list(edits)
        graph.steps = list(steps)
        graph.unsaved_steps = list(unsaved_steps)
        graph.saved_tensor_names = dict(saved_tensor_names)
        graph.graph_ready = False
        graph.ensure_graph()
        return self.trace
