"""``Trace``: the record of one real forward, and ``Fork``: an isolated branch of it.

A trace owns the records (ops, module calls). A fork owns only what it changed: a
dictionary of replaced op values and the recipe of steps that produced them, so forks of
forks are cheap and never disturb their parent. Both classes are the only writers of their
state: engines build a trace through its ``add_*`` / ``record_*`` / ``finish`` methods,
replay changes a fork through ``set_value`` / ``substitute`` / ``set_module_output``.

Which value a consumer sees is decided in one place, :meth:`Trace.seen_value`; reads,
replay, validate and facets all ask it.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from ..errors import (
    AmbiguousSiteError,
    EmptySelectionError,
    InvalidArgumentError,
    ReplayNotExactError,
    SiteNotFoundError,
    TooManySitesError,
    ValueNotSavedError,
)
from .inputs import call_inputs, split_inputs
from .names import nearest
from .records import EDIT, GUARD, INPUT, ModuleCall, Op, Ref
from .selectors import Label, Selector, as_selector, split_pass
from .services import services
from .sites import ModuleSites, Site, Sites
from .steps import REPLAY, Step
from .tree import flatten, unflatten

__all__ = ["DataRead", "Fork", "ForkState", "Trace"]


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


class ForkState(NamedTuple):
    """A copy of what a fork changed: op values, substitutions, module outputs, recipe, edits."""

    values: dict[int, Any]
    subst: dict[int, tuple[int, Any]]
    overrides: dict[str, Any]
    recipe: list[Step]
    edits: list[Any]


class _Missing:
    pass


_MISSING = _Missing()


class Trace:
    """The record of one forward: every executed op, every module call, inputs and output.

    Read it with ``trace[label_or_address]``, ``trace.layers``, ``trace.modules`` and
    ``trace.find_sites(selector)``; edit it after the fact with ``trace.fork().do(...)``.
    """

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
        self._producers: dict[int, tuple[list[int], list[int | None]]] = {}
        self._output_raw: Any = None
        self._output_refs: list[Ref | None] = []
        self._graph_ready = False
        self._values: dict[int, Any] = {}
        self._stale: dict[int, int] = {}  # op index -> position after which its memory was overwritten
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
        leaves, spec = flatten((op.args, op.kwargs))
        refs: list[Ref] = []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                ref = self.producer_ref(leaf, op.index)
                if ref is not None:
                    leaves[i] = ref
                    refs.append(ref)
        op.args_spec = (leaves, spec)
        op.parent_refs = refs
        op.args = op.kwargs = None

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
        ``Deferred`` that reads it back); the op keeps that handle, not the tensor."""
        op = self.ops[index]
        op.defer_value(sink.put(op.label, op._out))

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
        g = self._grads.get(op.index, _MISSING)
        if g is _MISSING:
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

    def add_call(self, call: ModuleCall) -> None:
        """Append one module call record."""
        call.trace = self
        self.calls.append(call)
        same = self._calls_by_address.setdefault(call.address, [])
        same.append(call)
        n = len(same)
        for c in same:
            c.n_passes = n

    def add_input(self, label: str) -> None:
        self.input_layers.append(label)

    def register_tensor(self, tensor: torch.Tensor, index: int, elem: int | None) -> None:
        """Note that op ``index`` (element ``elem`` of a multi-output op) produced ``tensor``."""
        entry = self._producers.get(id(tensor))
        if entry is None:
            self._producers[id(tensor)] = ([index], [elem])
        else:
            entry[0].append(index)
            entry[1].append(elem)

    def producer_ref(self, tensor: Any, before: int) -> Ref | None:
        """The op that last produced ``tensor`` before op index ``before`` (None: not recorded)."""
        entry = self._producers.get(id(tensor))
        if entry is None:
            return None
        idx, elems = entry
        k = bisect.bisect_left(idx, before) - 1
        if k < 0:
            return None
        ref = Ref(idx[k], elems[k])
        if self._weak and self._alive(ref) is not tensor:
            return None  # a bounded capture freed that op's output: this is a newer tensor with its id
        return ref

    def refs_for_value(self, value: Any, before: int) -> tuple[list[Ref | None], Any]:
        leaves, spec = flatten(value)
        refs = [self.producer_ref(leaf, before) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        return refs, spec

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
               complete: bool = True, stale: dict[int, int] | None = None) -> None:
        """Called once the forward returned: record outputs, then drop unsaved values."""
        self.steps = list(steps)
        self.grad = grad
        self.complete = complete
        self._stale = dict(stale or {})
        if not self._op_graph:
            self.set_output(output)
            return
        self.set_output(output, self.refs_for_value(output, len(self.ops))[0])
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
            leaves, spec = flatten((op.args, op.kwargs))
            refs: list[Ref] = []
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    ref = self.producer_ref(leaf, op.index)
                    if ref is not None:
                        leaves[i] = ref
                        refs.append(ref)
            op.args_spec = (leaves, spec)
            op.parent_refs = refs
        for op in ops:
            op.children_idx = []
        for op in ops:
            for ref in dict.fromkeys(r.index for r in op.parent_refs):
                ops[ref].children_idx.append(op.index)
        self._graph_ready = True

    # -- which value a consumer sees (the one rule) ---------------------------------------------
    def value(self, index: int) -> Any:
        """Op ``index``'s own output in this trace (a fork's recomputed value when it has one)."""
        v = self._values.get(index, _MISSING)
        if v is _MISSING:
            return self.ops[index].out
        return v

    def seen_value(self, ref: Ref, consumer: int | ModuleCall | None = None) -> Any:
        """The value ``ref`` names as ``consumer`` sees it.

        ``consumer`` is an op index (an op reading it as an argument), a module call
        (a module returning it), or None (everything after the forward: the model output).
        A module edit on a fork replaces what readers *after* that module see, not the
        producing op's own value: later ops, the model output and modules returning after
        the edited one (or enclosing it) see the edit; a submodule that returned first does not.
        """
        v = self.value(ref.index)
        sub = self._substitution(ref.index)
        if sub is not None and self._sees_substitution(sub[0], ref.index, consumer):
            v = sub[1]
        return v if ref.elem is None else v[ref.elem]

    def stale_positions(self) -> dict[int, int]:
        """Every op whose memory an in-place op overwrote, with the position it happened at."""
        return dict(self._stale)

    def stale_after(self, index: int) -> int | None:
        """Position after which op ``index``'s memory was overwritten in place (None: never)."""
        return self._stale.get(index)

    def _substitution(self, index: int) -> tuple[int, Any] | None:
        return None

    def _sees_substitution(self, position: int, index: int, consumer: int | ModuleCall | None) -> bool:
        if consumer is None:
            return True
        if isinstance(consumer, int):
            return consumer >= position
        return position < consumer.op_end or (position == consumer.op_end and self._encloses_edit(consumer, index))

    def _encloses_edit(self, reader: ModuleCall, index: int) -> bool:
        """Whether ``reader`` returned after the edited module that replaced op ``index``."""
        for key in self._module_outputs():
            address, pass_index = key.rsplit(":", 1)
            calls = self._calls_by_address.get(address, ())
            edited = calls[int(pass_index) - 1] if 0 < int(pass_index) <= len(calls) else None
            if edited is None or not any(r is not None and r.index == index for r in edited.out_refs):
                continue
            inside = reader.address == "" or edited.address.startswith(reader.address + ".")
            if inside and reader.op_start <= edited.op_start:
                return True
        return False

    def _module_outputs(self) -> dict[str, Any]:
        return {}

    def read(self, record: Op | ModuleCall) -> Any:
        """The value at a record as a user reads it (``site.out``): what the ops after it consumed.

        An op edited during capture reads as its edited value (the output of the ``edit_N`` op
        that replaced it), as an op edited on a fork does; the value before the edit is kept
        on the applied-edit record, ``trace.edits[i].before``.
        """
        if isinstance(record, Op):
            edit_index = self.capture_edit_of(record.index)
            if edit_index is None:
                return self.seen_value(Ref(record.index, None))
            edited = self.seen_value(Ref(edit_index, None))
            spec = getattr(self.ops[edit_index].func, "spec", None)  # a structured output, flattened by the edit
            return edited if spec is None else unflatten(list(edited), spec)
        return self.module_output(record)

    _edit_targets: tuple[int, dict[int, int]] | None = None  # (ops seen, {op index: its last edit op})

    def capture_edit_of(self, index: int) -> int | None:
        """Index of the last capture-time ``edit_N`` op that replaced op ``index``'s output (None: none)."""
        cached = self._edit_targets
        if cached is None or cached[0] != len(self.ops):
            found: dict[int, int] = {}
            for op in self.ops:
                if op.flags & EDIT:
                    # The edit op's function knows its target (an Op, or a ModuleCall for a module edit).
                    target = getattr(getattr(op.func, "ctx", None), "op", None)
                    if isinstance(target, Op):
                        found[target.index] = op.index
            cached = self._edit_targets = (len(self.ops), found)
        return cached[1].get(index)

    def module_output(self, call: ModuleCall) -> Any:
        """What module call ``call`` returned in this trace (an edited output on a fork)."""
        override = self._module_outputs().get(call.key, _MISSING)
        if override is not _MISSING:
            return override
        raw = call._out
        if raw is None and call.out_refs:
            leaves = [None if r is None else self.seen_value(r, call) for r in call.out_refs]
            return unflatten(leaves, call.out_spec)
        if not call.out_refs:
            return raw
        # Rebuild only when an op value differs from the object the hook saw (snapshots, forks).
        raw_leaves, spec = flatten(raw)
        changed = False
        for i, ref in enumerate(call.out_refs):
            if ref is None:
                continue
            v = self.seen_value(ref, call)
            if v is not raw_leaves[i]:
                raw_leaves[i] = v
                changed = True
        return unflatten(raw_leaves, spec) if changed else raw

    def unedited_module_output(self, call: ModuleCall) -> Any:
        """What ``call`` returned before any module edit on it (its ops' own values)."""
        leaves, spec = flatten(call._out)
        for i, ref in enumerate(call.out_refs):
            if ref is not None:
                v = self.value(ref.index)
                leaves[i] = v if ref.elem is None else v[ref.elem]
        return unflatten(leaves, spec)

    @property
    def output(self) -> Any:
        """The model's return value (rebuilt from edited values on a fork)."""
        if not self._values and not self._module_outputs():
            return self._output_raw
        leaves, spec = flatten(self._output_raw)
        for i, ref in enumerate(self._output_refs):
            # Memory of the producing op overwritten (through another view) before the model returned:
            # the recorded op does not describe what was returned, the returned tensor does.
            if ref is not None and self.stale_after(ref.index) is None:
                leaves[i] = self.seen_value(ref)
        return unflatten(leaves, spec)

    @property
    def output_refs(self) -> list[Ref | None]:
        return list(self._output_refs)

    @property
    def raw_output(self) -> Any:
        """The model's return value as the forward produced it (no fork edits)."""
        return self._output_raw

    # -- navigating --------------------------------------------------------------------------
    @property
    def layers(self) -> list[Site]:
        """Every recorded op in execution order (inputs first)."""
        return [Site(self, op) for op in self.ops]

    @property
    def modules(self) -> ModuleSites:
        """Every module call in the order the calls started; also indexed by address
        (``trace.modules["transformer.h.0"]``, ``"block:2"``), like ``trace[...]``."""
        return ModuleSites(self, [Site(self, c) for c in sorted(self.calls, key=lambda c: c.op_start)])

    def module_call(self, key: str) -> ModuleCall:
        """The module call an address names (``addr``, ``addr:N``, or a canonical name).

        Raises:
            SiteNotFoundError: no module that ran has that address (the nearest are listed).
            AmbiguousSiteError: a module that ran several times, named without a pass.
        """
        if not isinstance(key, str):
            raise InvalidArgumentError(f"trace.modules[...] takes a module address or a position, "
                                       f"got {type(key).__name__}")
        address, pass_index = split_pass(key)
        calls = self._calls_by_address.get(address)
        if calls:
            return self._pick_pass(key, address, pass_index, calls)
        found = None
        if self.model is not None and not self.has_label(key):
            try:
                found = self.lookup(key)  # a canonical name (blocks.0) bound to this model
            except SiteNotFoundError:
                found = None
        if isinstance(found, ModuleCall):
            return found
        near = nearest(key, self._calls_by_address)
        raise SiteNotFoundError(f"{key!r} is not the address of a module that ran in this trace; nearest: {near}",
                                site=key, candidates=near)

    @property
    def module_addresses(self) -> list[str]:
        return list(self._calls_by_address)

    def calls_of(self, address: str) -> list[ModuleCall]:
        """Every call of the module at ``address``, in order (empty if it never ran)."""
        return list(self._calls_by_address.get(address, ()))

    def has_label(self, label: str) -> bool:
        return label in self._labels

    def op_index(self, label: str) -> int | None:
        return self._labels.get(label)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Site]:
        return iter(self.layers)

    def __contains__(self, key: str) -> bool:
        try:
            self.lookup(key)
        except (SiteNotFoundError, AmbiguousSiteError):
            return False
        return True

    def bind(self, selector: Any, *, strings_as_modules: bool = False) -> Selector:
        """``selector`` with canonical names resolved for this trace's model (once, here).

        With ``strings_as_modules`` a plain string naming a module means every pass of it
        (as in ``tl.when`` and ``fork.do``); otherwise it stays a label (``trace[...]``).
        """
        sel = as_selector(selector)
        if self.model is None:
            return sel
        return services().bind(self.model, sel, strings_as_modules=strings_as_modules)

    def lookup(self, key: str) -> Op | ModuleCall:
        """The record an op label or module address (``addr``, ``addr:2``, a canonical name) names.

        Raises:
            SiteNotFoundError: nothing has that name.
            AmbiguousSiteError: a module that ran several times, named without a pass.
        """
        if not isinstance(key, str):
            raise InvalidArgumentError(f"trace[...] takes an op label or module address, got {type(key).__name__}")
        index = self._labels.get(key)
        if index is not None:
            return self.ops[index]
        address, pass_index = split_pass(key)
        calls = self._calls_by_address.get(address)
        if calls:
            return self._pick_pass(key, address, pass_index, calls)
        bound = self.bind(Label(key)) if self.model is not None else None
        if bound is not None and not isinstance(bound, Label):
            found = bound.match(self)
            if len(found) == 1:
                return found[0]
            paths = bound.module_paths()
            if paths and len(paths) == 1 and pass_index is None:
                real = split_pass(paths[0])[0]
                return self._pick_pass(key, real, None, self._calls_by_address.get(real, []))
            names = [r.key if isinstance(r, ModuleCall) else r.label for r in found]
            raise AmbiguousSiteError(
                f"{key!r} matches {len(found)} sites: {names[:8]}", site=key, passes=names,
                remedy=f"Name one of them, e.g. trace[{names[0]!r}], or get them all with "
                       f"trace.find_sites({key!r}).",
            )
        near = nearest(key, [*self._calls_by_address, *self._labels])
        raise SiteNotFoundError(
            f"{key!r} is neither an op label nor a module address of this trace; nearest: {near}",
            site=key,
            candidates=near,
        )

    def _pick_pass(self, key: str, address: str, pass_index: int | None, calls: list[ModuleCall]) -> ModuleCall:
        if pass_index is None:
            if len(calls) > 1:
                passes = [c.key for c in calls]
                raise AmbiguousSiteError(
                    f"module {address!r} ran {len(calls)} times; say which pass: {passes}",
                    site=key,
                    passes=passes,
                    remedy=f"Add the pass number: {passes[0]!r} is its first call, {passes[-1]!r} its last "
                           f"(trace[{passes[0]!r}], tl.module({passes[0]!r})); tl.module({address!r}) selects every "
                           "pass (trace.find_sites).",
                )
            return calls[0]
        if 1 <= pass_index <= len(calls):
            return calls[pass_index - 1]
        raise SiteNotFoundError(
            f"module {address!r} ran {len(calls)} time(s); there is no pass {pass_index}",
            site=key,
            remedy=f"Use a pass between 1 and {len(calls)}.",
        )

    def __getitem__(self, key: str | int) -> Site:
        if isinstance(key, int):
            return Site(self, self.ops[key])
        return Site(self, self.lookup(key))

    def find_sites(self, selector: Any, max_fanout: int | None = None) -> Sites:
        """All sites a selector matches, in execution order.

        Raises:
            EmptySelectionError: nothing matches (``SiteNotFoundError``, a subclass, when a name
                does not exist); the nearest valid names are listed.
            TooManySitesError: more than ``max_fanout`` matches.
        """
        sel = self.bind(selector)
        records = sel.match(self)
        if not records:
            raise self.empty_selection(sel)
        if max_fanout is not None and len(records) > max_fanout:
            raise TooManySitesError(
                f"{sel.describe()} matches {len(records)} sites, more than max_fanout={max_fanout}",
                site=sel.describe(),
                count=len(records),
            )
        return Sites([Site(self, r) for r in records], sel)

    def empty_selection(self, sel: Selector) -> EmptySelectionError:
        """The error for a selector that matched nothing, with the names nearest to the one it uses."""
        name = next((v for v in (getattr(sel, a, None) for a in ("path", "name", "label")) if isinstance(v, str)),
                    sel.describe())
        near = nearest(name, [*self._calls_by_address, *self._labels])
        return EmptySelectionError(f"{sel.describe()} matches nothing in this trace; nearest names: {near}",
                                   site=sel.describe(), candidates=near)

    # -- branching and editing -------------------------------------------------------------
    def fork(self, name: str | None = None) -> Fork:
        """An isolated branch: edits on it never change this trace or its other forks."""
        return Fork(self, name)

    def do(self, site: Any, edit: Any, *, model=None, inputs=None, check: bool = False) -> Trace:
        raise InvalidArgumentError(
            "do() edits a fork, never the original trace",
            remedy="Call trace.fork(name).do(site, edit); the fork shares memory with the trace.",
        )

    def all_steps(self) -> list[Step]:
        """Every step that made this trace: capture-time steps (then, on a fork, its recipe)."""
        return list(self.steps)

    def run(self, model: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> Trace:
        """Run the model again with this trace's steps as capture-time edits; a new trace."""
        model = model if model is not None else self.model
        args, kwargs = (self.args, self.kwargs) if not args and not kwargs else call_inputs(args, kwargs)
        steps = [s.for_capture() for s in self.all_steps()]
        return services().rerun(self, model, args, kwargs, steps, None)

    def run_transaction(self, *, inputs: Any = None, until: Any, model=None) -> Trace:
        """Run the forward again and stop right after ``until``; return the partial trace.

        ``inputs`` follows the one input convention (a tensor, a tuple of positional
        inputs, a dict of keyword inputs); default: this trace's own inputs.
        """
        model = model if model is not None else self.model
        args, kwargs = (self.args, self.kwargs) if inputs is None else split_inputs(inputs)
        return services().rerun(self, model, args, kwargs, [s.for_capture() for s in self.steps],
                                as_selector(until))

    def validate(self, **kwargs: Any) -> Any:
        """``tl.validate(self, **kwargs)``."""
        return services().validate(self, **kwargs)

    # -- persistence (implemented in torchlens.store) -------------------------------------------
    def save_intervention(self, path: Any, level: str = "portable", *, overwrite: bool = False) -> Any:
        """Write this trace's edits (capture-time steps and, on a fork, its recipe) as ``.tlspec/``."""
        return services().save_intervention(self, path, level=level, overwrite=overwrite)

    def save(self, path: Any, *, selector: Any = None, overwrite: bool = False) -> Any:
        """Write the graph (JSON) and activations (safetensors), optionally only ``selector``'s ops."""
        return services().save_trace(self, path, selector=selector, overwrite=overwrite)

    # -- presentation ----------------------------------------------------------------------
    def table(self, selector: Any = None, limit: int | None = None) -> str:
        """A text table of ops (label, function, module:pass, shape, source line)."""
        return services().table(self, selector, limit)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r}: {len(self.ops)} ops, {len(self.calls)} module calls, "
            f"outputs {self.output_layers}>"
        )

    # -- pictures, summaries, notebooks (implemented in torchlens.analysis) -----------------------
    def to_dot(self, *, depth: int | str | None = "auto", focus: Any = None, rolled: bool = False,
               highlight: Any = None) -> str:
        """The DOT source of the executed graph (works without Graphviz installed).

        Args:
            depth: collapse module calls nested this deep into single nodes; None: every op;
                "auto": the deepest level that stays readable.
            focus: a selector: draw that region at full detail, with its inputs and readers.
            rolled: draw a module called several times once, with loop edges.
            highlight: a ``tl.debug.compare`` result whose divergences to highlight.

        Returns:
            the DOT text.
        """
        return services().to_dot(self, depth=depth, focus=focus, rolled=rolled, highlight=highlight)

    def draw(self, path: Any = None, *, fmt: str | None = None, depth: int | str | None = "auto",
             focus: Any = None, rolled: bool = False, highlight: Any = None) -> Any:
        """Draw the executed graph with Graphviz: a file at ``path`` (.svg/.png/.pdf/.dot), inline in notebooks.

        Args:
            path: where to write the picture (None: only return the Drawing).
            fmt: the format when ``path`` has no known suffix.
            depth: see :meth:`to_dot`.
            focus: see :meth:`to_dot`.
            rolled: see :meth:`to_dot`.
            highlight: see :meth:`to_dot`.

        Returns:
            a ``Drawing`` (``.dot``, ``.path``, ``.svg()``; shown inline by Jupyter).

        Raises:
            GraphvizNotFoundError: Graphviz's ``dot`` program is not installed (``to_dot()`` still works).
        """
        return services().draw(self, path, fmt=fmt, depth=depth, focus=focus, rolled=rolled, highlight=highlight)

    def summary(self) -> Any:
        """Per module call: ops, parameters, output shape and memory held (``print`` it, or show it in a notebook)."""
        return services().summary(self)

    def to_pandas(self) -> Any:
        """One row per op (label, func, module, pass, shape, dtype, source, parents) as a pandas DataFrame.

        Raises:
            OptionalDependencyError: pandas is not installed.
        """
        return services().to_pandas(self)

    def _repr_html_(self) -> str:
        return services().html(self)


class Fork(Trace):
    """A branch of a trace. Shares every record and unchanged value with its parent."""

    def __init__(self, parent: Trace, name: str | None = None) -> None:
        self._share(parent)
        self.parent = parent
        self.name = name or f"{parent.name}/fork"
        state = parent.fork_state() if isinstance(parent, Fork) else None
        self._values = dict(parent._values)
        self._subst: dict[int, tuple[int, Any]] = dict(state.subst) if state else {}
        self._overrides: dict[str, Any] = dict(state.overrides) if state else {}
        self.recipe: list[Step] = list(state.recipe) if state else []
        self.edits = list(parent.edits)

    def _share(self, other: Trace) -> None:
        """Take every record and setting of ``other`` (records are shared, never copied)."""
        self.__dict__.update(other.__dict__)

    # -- reading fork state ------------------------------------------------------------------
    def _substitution(self, index: int) -> tuple[int, Any] | None:
        return self._subst.get(index) if self._subst else None

    def _module_outputs(self) -> dict[str, Any]:
        return self._overrides

    def fork_state(self) -> ForkState:
        """A copy of what this fork changed (for saving and inspection)."""
        return ForkState(dict(self._values), dict(self._subst), dict(self._overrides), list(self.recipe),
                         list(self.edits))

    def module_override(self, key: str) -> Any:
        """The edited output of module call ``key`` on this fork (``_MISSING``-free: None if none)."""
        return self._overrides.get(key)

    def has_module_override(self, key: str) -> bool:
        return key in self._overrides

    def all_steps(self) -> list[Step]:
        return [*self.steps, *self.recipe]

    # -- changing fork state (replay, re-execution, loading) -----------------------------------
    def set_value(self, index: int, value: Any) -> None:
        """Op ``index``'s own output on this fork is now ``value`` (a module substitution for it ends)."""
        self._values[index] = value
        self._subst.pop(index, None)

    def set_recomputed(self, index: int, value: Any) -> None:
        """Replay recomputed op ``index``; module substitutions of it stay."""
        self._values[index] = value

    def substitute(self, index: int, position: int, value: Any) -> None:
        """Readers from op position ``position`` on see ``value`` for op ``index`` (a module edit)."""
        self._subst[index] = (position, value)

    def set_module_output(self, key: str, value: Any) -> None:
        """The edited output of module call ``key``."""
        self._overrides[key] = value

    def add_step(self, step: Step) -> None:
        if step.phase != REPLAY:
            step = Step(step.site, step.edit, REPLAY)
        self.recipe.append(step)

    def drop_last_step(self) -> None:
        self.recipe.pop()

    def adopt(self, fresh: Trace, recipe: list[Step]) -> None:
        """Become ``fresh`` (a re-executed capture) while staying this fork of the same parent."""
        parent, name = self.parent, self.name
        self._share(fresh)
        self.parent, self.name = parent, name
        self.steps = list(parent.steps)
        self.recipe = list(recipe)
        self._values, self._subst, self._overrides = {}, {}, {}

    def restore_fork(self, state: ForkState, unsaved_steps: list[str]) -> None:
        """Set the fork state a loader decoded from disk."""
        self.unsaved_steps = list(unsaved_steps)
        self._values = dict(state.values)
        self._subst = dict(state.subst)
        self._overrides = dict(state.overrides)
        self.recipe = list(state.recipe)
        self.edits = list(state.edits)

    def do(self, site: Any, edit: Any, *, model=None, inputs=None, check: bool = False,
           replay: str = "auto") -> Fork:
        """Apply ``edit`` at ``site`` on this fork and push it down the recorded graph.

        Without ``model``/``inputs`` only ops downstream of the site are re-executed from
        their recorded arguments. With both, the real forward is re-executed with the
        fork's whole recipe. ``check=True`` replays and then re-executes to compare.

        Replay follows the recorded path only while every guard (a value the forward branched
        on: ``if x.sum() > 0``, ``.item()``, the experts a router's ``topk`` picked, data-dependent
        shapes) is unchanged. When the edit changes one, ``replay`` decides: ``"strict"`` raises
        ``GuardChangedError``; ``"fallback"`` re-executes the real forward with the fork's steps
        (warns ``ReplayFellBack`` and marks the fork's ``edits`` ``how="re-executed: ..."``);
        ``"auto"`` (default) falls back when the trace holds its model, else raises.

        Returns:
            this fork, for chaining.

        Raises:
            GuardChangedError: a guard changed and no fallback was allowed or possible.
            ReplayNotExactError: the recorded graph cannot reproduce this edit exactly.
        """
        step = Step(self.bind(site, strings_as_modules=True), edit, REPLAY)
        return services().replay(self, step, model=model, inputs=inputs, check=check, replay=replay)
