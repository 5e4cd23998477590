"""The records a capture produces: one ``Op`` per executed tensor op, one ``ModuleCall`` per
module call. They are plain data owned by the base trace; forks never copy them.
"""

from __future__ import annotations

import bisect
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ValueNotSavedError
from .repr_html import repr_html
from .tree import describe_shape, tensor_leaves, unflatten_call

if TYPE_CHECKING:
    from .trace import Trace

# Op.flags bits: why an op needs care when it is re-executed.
INPUT = 1  # a forward input, not an op
INPLACE = 2  # mutates its first argument (or out=)
RANDOM = 4  # output depends on the RNG (dropout in training, randn, ...)
EDIT = 8  # an edit applied during capture (its func re-applies the edit)
ALIAS_MUTATION = 16  # mutated storage that other recorded tensors view
NOT_REPLAYABLE = 32  # cannot be re-issued from recorded arguments
GUARD = 64  # its index-valued outputs choose what runs next (topk indices, nonzero ...): replay checks them
# Issued by a dispatcher (accelerate's device moves), not by the model: labelled ``dispatch_*``,
# kept in the graph so edits propagate through it, never matched by ``tl.func``.
DISPATCH = 128
# The functions whose every call draws random numbers: capture flags their ops RANDOM (dropout's
# calls get the flag only in training mode).
RANDOM_NAMES = frozenset(
    {
        "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "bernoulli",
        "multinomial", "normal", "poisson", "normal_", "uniform_", "exponential_", "random_", "cauchy_",
        "geometric_", "log_normal_", "bernoulli_", "rrelu", "rrelu_", "gumbel_softmax",
    }
)

__all__ = [
    "ALIAS_MUTATION", "DISPATCH", "EDIT", "GUARD", "INPLACE", "INPUT", "LAZY_LINES", "NOT_REPLAYABLE", "OPEN", "RANDOM",
    "RANDOM_NAMES", "Deferred", "ModuleCall", "Op", "Ref", "build_args", "line_at",
]

OPEN = 1 << 62  # ModuleCall.op_end while the call is still running


class _TraceLink:
    """Records point back at their trace weakly: no reference cycle, so a dropped trace
    frees its activations at once instead of at a later garbage collection."""

    __slots__ = ()

    @property
    def trace(self) -> Trace | None:
        ref = self._trace_ref
        return ref() if ref is not None else None

    @trace.setter
    def trace(self, value: Trace | None) -> None:
        self._trace_ref = weakref.ref(value) if value is not None else None


class Ref:
    """A placeholder in ``args_spec``: "the output of op ``index`` (element ``elem``)"."""

    __slots__ = ("index", "elem")

    def __init__(self, index: int, elem: int | None) -> None:
        self.index = index
        self.elem = elem

    def __repr__(self) -> str:
        return f"Ref({self.index})" if self.elem is None else f"Ref({self.index}[{self.elem}])"


class Deferred:
    """A recorded argument kept as a way to fetch the tensor, not the tensor itself.

    An offloaded model's weights exist in memory only while their module runs; keeping them in
    the recorded arguments would hold a second copy of every offloaded weight. A subclass
    (``torchlens.capture._offload``) knows where the weight lives and loads it on demand.
    """

    __slots__ = ()

    def load(self) -> torch.Tensor:
        """The tensor, fetched now (not cached: the caller holds it only while it needs it)."""
        raise NotImplementedError


_new = object.__new__


class Op(_TraceLink):
    """One executed tensor operation (or a forward input, or a capture-time edit)."""

    __slots__ = (
        "index",
        "label",
        "func",
        "func_name",
        "_out",
        "saved",
        "module",
        "module_pass",
        "_code",
        "_line",
        "_lasti",
        "args",
        "kwargs",
        "flags",
        "_trace_ref",
        "args_spec",
        "parent_refs",
        "children_idx",
        "snapshotted",
        "_meta",
    )

    def __init__(self, index, label, func, func_name, out, module, module_pass, code, lineno, args, kwargs, flags,
                 trace_ref=None, lasti=-1):
        self.index = index
        self.label = label
        self.func = func
        self.func_name = func_name
        self._out = out
        self.saved = True
        self.module = module
        self.module_pass = module_pass
        self._code = code
        # The line, or (None) the byte offset ``lasti`` of the calling instruction in ``code``: the
        # recorder passes the offset, as reading ``frame.f_lineno`` scans the line table on each op.
        self._line = lineno
        self._lasti = lasti
        self.args = args
        self.kwargs = kwargs
        self.flags = flags
        self._trace_ref = trace_ref  # a weakref.ref to the trace (the recorder passes its one ref to every op)
        self.args_spec = None
        self.parent_refs: list[Ref] | None = None
        self.children_idx: list[int] | None = None
        self.snapshotted = False
        self._meta = None  # (shape, dtype) kept when the value itself is dropped

    @classmethod
    def recorded(cls, index, label, func, func_name, out, module, module_pass, code, line, lasti, args, kwargs,
                 trace_ref) -> Op:
        """A new op record as a capture makes it (flags 0, value saved), with the fields ``__init__``
        sets. Built without ``__init__``: on Python 3.11 a class call with a Python ``__init__`` costs
        as much as the rest of recording an op; a capture makes one per executed op."""
        op = _new(cls)
        op.index = index
        op.label = label
        op.func = func
        op.func_name = func_name
        op._out = out
        op.saved = True
        op.module = module
        op.module_pass = module_pass
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
        return op

    # -- values ------------------------------------------------------------------
    @property
    def out(self) -> Any:
        """The output as it was when the op ran (later in-place changes are not seen)."""
        if not self.saved:
            raise ValueNotSavedError(f"op {self.label!r} was recorded but its output was not saved", site=self.label)
        out = self._out
        return out.load() if isinstance(out, Deferred) else out

    @property
    def shape(self) -> Any:
        if not self.saved or isinstance(self._out, Deferred):
            return self._meta_shape()
        return describe_shape(self._out)

    def _meta_shape(self):
        return self._meta[0] if self._meta else None

    def drop_value(self) -> None:
        """Forget the output (``save=`` excluded it) but keep its shape and dtype."""
        self._meta = (self.shape, self.dtype)
        self.saved = False
        self._out = None

    @property
    def grad(self) -> Any:
        """The gradient of the loss with respect to this op's output (``tl.trace(..., grad=True)``, then backward).

        Raises:
            ValueNotSavedError: the trace was captured without ``grad=True``, ``save=`` excluded
                this op, or no backward reached it yet.
        """
        return self.trace.grad_of(self)

    def defer_value(self, handle: Deferred) -> None:
        """Keep the output as ``handle`` (on disk), with its shape and dtype at hand."""
        self._meta = (self.shape, self.dtype)
        self._out = handle

    def restore_value(self, value: Any) -> None:
        """Keep ``value`` as the output after all (a bounded capture found a reader for it)."""
        self._out = value
        self.saved = True

    @property
    def dtype(self) -> torch.dtype | None:
        if not self.saved or isinstance(self._out, Deferred):
            return self._meta[1] if self._meta else None
        out = self._out
        if isinstance(out, torch.Tensor):
            return out.dtype
        leaves = tensor_leaves(out) if self.saved else []
        return leaves[0].dtype if leaves else None

    # -- provenance ----------------------------------------------------------------
    @property
    def _lineno(self) -> int | None:
        """The model line that issued the op (worked out from the instruction offset on first read)."""
        line = self._line
        if line is None and self._lasti >= 0:
            line = self._line = line_at(self._code, self._lasti)
        return line

    @_lineno.setter
    def _lineno(self, value: int | None) -> None:
        self._line = value
        self._lasti = -1

    @property
    def source(self) -> str:
        """``file:line`` of the model code that issued the op."""
        if self._code is None:
            return "<unknown>"
        return f"{self._code.co_filename}:{self._lineno}"

    @property
    def parents(self) -> list[str]:
        self.trace.ensure_graph()
        ops = self.trace.ops
        return list(dict.fromkeys(ops[r.index].label for r in self.parent_refs))

    @property
    def children(self) -> list[str]:
        self.trace.ensure_graph()
        ops = self.trace.ops
        return [ops[i].label for i in self.children_idx]

    @property
    def is_input(self) -> bool:
        return bool(self.flags & INPUT)

    def __repr__(self) -> str:
        where = f" in {self.module}" if self.module else ""
        return f"<Op {self.label} {self.func_name}{where} shape={self.shape}>"

    def _repr_html_(self) -> str:
        return repr_html(self)


class ModuleCall(_TraceLink):
    """One call of one ``nn.Module``: where it is, which pass, and what it returned."""

    __slots__ = (
        "address",
        "pass_index",
        "module_type",
        "args",
        "kwargs",
        "_out",
        "out_refs",
        "out_spec",
        "op_start",
        "op_end",
        "_trace_ref",
    )

    def __init__(self, address: str, pass_index: int, module_type: str, args, kwargs, op_start: int):
        self.address = address
        self.pass_index = pass_index
        self.module_type = module_type
        self.args = args
        self.kwargs = kwargs
        self._out: Any = None
        self.out_refs: list[Ref | None] = []
        self.out_spec: Any = None
        self.op_start = op_start
        self.op_end = op_start
        self._trace_ref = None

    @classmethod
    def recorded(cls, address: str, pass_index: int, module_type: str, args, kwargs, op_start: int,
                 trace_ref: Any) -> ModuleCall:
        """A call record as a capture opens it (``op_end`` OPEN until the call returns), with the
        fields ``__init__`` sets; built without ``__init__``, like ``Op.recorded``."""
        call = _new(cls)
        call.address = address
        call.pass_index = pass_index
        call.module_type = module_type
        call.args = args
        call.kwargs = kwargs
        call._out = None
        call.out_refs = []
        call.out_spec = None
        call.op_start = op_start
        call.op_end = OPEN
        call._trace_ref = trace_ref
        return call

    @property
    def n_passes(self) -> int:
        """How many calls of this module its trace recorded (1 for a record in no trace). Asked of the
        trace, not stored: a count kept on every call was rewritten on all of them at each new pass."""
        trace = self.trace
        return 1 if trace is None else trace.passes_of(self.address) or 1

    @property
    def key(self) -> str:
        """``address:N`` — unique for every call."""
        return f"{self.address}:{self.pass_index}"

    @property
    def label(self) -> str:
        return self.address if self.n_passes == 1 else self.key

    @property
    def op_labels(self) -> list[str]:
        """Labels of every op executed during this call (its submodules' included), a dispatcher's
        device moves (``dispatch_*``) excepted."""
        return [op.label for op in self.trace.ops[self.op_start : self.op_end] if not op.flags & DISPATCH]

    def __repr__(self) -> str:
        return f"<ModuleCall {self.key} ({self.module_type}) ops {self.op_start}:{self.op_end}>"

    def _repr_html_(self) -> str:
        return repr_html(self)


# code id -> (code, instruction start offsets, their lines): the code object is held, so its id
# stays its own. Keyed by id because hashing a code object hashes its constants, each time.
_LINE_TABLES: dict[int, tuple[Any, list[int], list[int | None]]] = {}


def line_at(code: Any, lasti: int) -> int | None:
    """The line of the instruction at byte offset ``lasti`` of ``code``: ``frame.f_lineno`` of a
    frame whose ``f_lasti`` was ``lasti``, worked out when first asked instead of on every op."""
    table = _LINE_TABLES.get(id(code))
    if table is None:
        starts, lines = [], []
        for start, _end, line in code.co_lines():
            starts.append(start)
            lines.append(line)
        table = _LINE_TABLES[id(code)] = (code, starts, lines)
    k = bisect.bisect_right(table[1], lasti) - 1
    return table[2][k] if k >= 0 else None


def _lines_from_offsets() -> bool:
    """Whether ``line_at(f_code, f_lasti)`` gives ``f_lineno`` on this interpreter (checked once)."""
    frame = sys._getframe()
    try:
        return line_at(frame.f_code, frame.f_lasti) == frame.f_lineno
    except (AttributeError, TypeError, ValueError):  # an interpreter without co_lines / f_lasti
        return False


# Whether a recorder may keep instruction offsets and leave the lines for later (else it reads f_lineno).
LAZY_LINES = _lines_from_offsets()


def build_args(op: Op, resolve: Callable[[Ref], Any]) -> tuple[tuple, dict]:
    """An op's (args, kwargs) rebuilt from its ``args_spec``, each parent ``Ref`` through ``resolve``."""
    leaves, spec = op.args_spec
    leaves = [resolve(leaf) if type(leaf) is Ref else leaf.load() if isinstance(leaf, Deferred) else leaf
              for leaf in leaves]
    return unflatten_call(leaves, spec)
