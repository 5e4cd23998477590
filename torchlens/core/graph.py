"""``Graph``: what one real forward recorded.

The records (ops, module calls), the links from each op's arguments to the ops that produced
them, the data reads the forward made (guards), the model output and the values kept. One
writer fills it: :class:`~torchlens.core.builder.TraceBuilder` (capture engines while the forward
runs, the loader when it decodes a saved trace). Then it is read: a
:class:`~torchlens.core.trace.Trace` reads it, and every fork of that trace holds the same
``Graph`` object (the records are shared, never copied).
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any, NamedTuple

import torch

from ..errors import ReplayNotExactError, ValueNotSavedError
from .records import EDIT, INPUT, ModuleCall, Op, Ref
from .steps import Step
from .tree import flatten, unflatten
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
    """What one forward recorded: the state a :class:`~torchlens.core.builder.TraceBuilder` writes
    while a capture runs (or a loader decodes), and that every trace of that forward and its forks
    then reads. Its methods only read, or fill caches derived from the records (``ensure_graph``).
    """

    def __init__(self, model: torch.nn.Module | None = None, args: tuple = (), kwargs: dict | None = None, *,
                 engine: str = "", op_graph: bool = True, strict: bool = False) -> None:
        self.model = model
        self.strict = strict  # an edit on it (or its forks) that changes nothing raises, not warns
        self.args = args
        self.kwargs = kwargs or {}
        self.engine = engine  # which engine captured it (shown, saved; never branched on)
        self.op_graph = op_graph
        self.ops: list[Op] = []
        self.calls: list[ModuleCall] = []
        self.input_layers: list[str] = []
        self.output_layers: list[str] = []
        self.data_reads: list[DataRead] = []
        self.edits: list[Any] = []  # AppliedEdit records, in the order capture-time edits landed
        self.steps: list[Step] = []  # capture-time steps, in order
        self.grad = False  # whether the capture ran with autograd (replay follows it)
        self.complete = True  # False for a transaction stopped early
        self.fingerprint: dict[str, Any] | None = None  # the model's, for a trace loaded from disk
        self.unsaved_steps: list[str] = []  # why steps of a loaded trace could not be saved
        self.saved_tensor_names: dict[int, str] = {}  # parameter names a loaded trace was saved with
        self.labels: dict[str, int] = {}
        self.calls_by_address: dict[str, list[ModuleCall]] = {}
        # id(tensor) -> the op index that produced it (an int: the commonest entry, one op, one tensor
        # out, and no allocation a collector must track), (index, elem) for an element of a
        # multi-output op, or a list of (index, elem) pairs in op order for a tensor several ops returned.
        self.producers: dict[int, int | tuple[int, int | None] | list[tuple[int, int | None]]] = {}
        self.output_raw: Any = None
        self.output_refs: list[Ref | None] = []
        self.output_deferred = False  # output tensors are read through their ops (kept on disk)
        # id(object) -> (object, [(path, Ref | None)]): the tensors an object of the output that flatten keeps
        # whole (a KV cache) holds, and the ops that produced them (see TraceBuilder.note_held)
        self.held: dict[int, tuple[Any, list[tuple[tuple, Ref | None]]]] = {}
        self.graph_ready = False
        self.stale: dict[int, int] = {}  # op index -> position after which its memory was overwritten
        self.alias_writes: dict[int, list[AliasWrite]] = {}  # op index -> writes through other views into it
        # A bounded capture (save=) keeps weak references to every op output, to link arguments to
        # live producers and to keep a module output the selector asks for once the module returns.
        self.weak: dict[int, Any] = {}
        self.grads: dict[int, Any] = {}  # op index -> gradient of its output (grad=True, after a backward)
        self.edit_targets: tuple[int, dict[int, int]] | None = None  # (ops seen, {op index: its last edit op})

    # -- capabilities ------------------------------------------------------------------------
    def require_op_graph(self, what: str) -> None:
        """Raise ``ReplayNotExactError`` naming ``what`` when this forward was recorded without an op graph."""
        if not self.op_graph:
            raise ReplayNotExactError(
                f"this trace was captured without an op graph ({self.engine or 'module outputs only'}); "
                f"{what} needs one",
                remedy="Re-execute with do(site, edit, model=model, inputs=x), or capture with tl.trace(model, x) "
                "(without a module-only save= next to intervene=) to get the graph.",
            )

    # -- links from arguments to the ops that produced them --------------------------------------
    def resolve_args(self, op: Op) -> None:
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

    def alive(self, ref: Ref) -> Any:
        """The live tensor op ``ref`` produced in a bounded capture (None once freed): an id reused
        by a newer tensor must not link it to the op that made the old one."""
        weak = self.weak.get(ref.index)
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

    def producer_ref(self, tensor: Any, before: int) -> Ref | None:
        """The op that last produced ``tensor`` before op index ``before`` (None: not recorded)."""
        entry = self.producers.get(id(tensor))
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
        if self.weak and self.alive(ref) is not tensor:
            return None  # a bounded capture freed that op's output: this is a newer tensor with its id
        return ref

    def refs_for_value(self, value: Any, before: int) -> tuple[list[Ref | None], Any]:
        """The op that produced each tensor leaf of ``value`` before op ``before``, and its tree spec."""
        leaves, spec = flatten(value)
        refs = [self.producer_ref(leaf, before) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        return refs, spec

    def point_records_at(self, trace: Any) -> None:
        """Point every op and module call at ``trace`` (records link weakly): a fork that became a
        re-executed capture owns that capture's records (the capture itself is dropped)."""
        ref = weakref.ref(trace)
        for record in (*self.ops, *self.calls):
            record._trace_ref = ref

    # -- reads -------------------------------------------------------------------------------
    def grad_of(self, op: Op) -> Any:
        """The gradient of op ``op``'s output (a tuple for a multi-output op).

        Raises:
            ValueNotSavedError: no gradient was recorded for it (see the message for why).
        """
        g = self.grads.get(op.index, MISSING)
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

    def passes_of(self, address: str) -> int:
        """How many calls of the module at ``address`` were recorded (``ModuleCall.n_passes``)."""
        return len(self.calls_by_address.get(address, ()))

    def capture_edit_of(self, index: int) -> int | None:
        """Index of the last capture-time ``edit_N`` op that replaced op ``index``'s output (None: none)."""
        cached = self.edit_targets
        if cached is None or cached[0] != len(self.ops):
            found: dict[int, int] = {}
            for op in self.ops:
                if op.flags & EDIT:
                    # The edit op's function knows its target (an Op, or a ModuleCall for a module edit).
                    target = getattr(getattr(op.func, "ctx", None), "op", None)
                    if isinstance(target, Op):
                        found[target.index] = op.index
            cached = self.edit_targets = (len(self.ops), found)
        return cached[1].get(index)

    def recorded_output(self) -> Any:
        """The model's return value as the forward produced it (tensors kept on disk read back)."""
        if not self.output_deferred:
            return self.output_raw
        leaves, spec = flatten(self.output_raw)
        for i, ref in enumerate(self.output_refs):
            if ref is not None and ref.index not in self.stale:
                v = self.ops[ref.index].out
                leaves[i] = v if ref.elem is None else v[ref.elem]
        return unflatten(leaves, spec)

    def ensure_graph(self) -> None:
        """Turn every op's raw arguments into ``args_spec`` (refs to parent ops + constants), and
        note each op's children (derived once, on the first read that needs them)."""
        if self.graph_ready:
            return
        ops = self.ops
        for op in ops:
            if op.args_spec is not None or op.flags & INPUT:
                op.parent_refs = op.parent_refs or []
                continue
            self.resolve_args(op)
        for op in ops:
            op.children_idx = []
        for op in ops:
            for ref in dict.fromkeys(r.index for r in op.parent_refs):
                ops[ref].children_idx.append(op.index)
        self.graph_ready = True
