"""The recorder's module calls: one ``ModuleCall`` per call, opened and closed by ``ModuleHooks``.

Every op is recorded in the call that encloses it (the top of a stack of open calls). When a
call returns, the ops that produced its output are found (among the records, or the rows not
yet made records: see ``Recorder.flush``), and its output is kept safe from later changes by
the model: tensors through copy on write, a container by rebuilding it, after the forward and
only if the model refilled it (``settle``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree

from ..core.records import ModuleCall, Op, Ref
from ..core.steps import Step
from ..core.tree import flatten, unflatten
from ..errors import StopCapture

__all__ = ["NO_CALL", "ModuleCalls"]

Tensor = torch.Tensor


class ModuleCalls:
    """The recorder's module-call part (a mixin): ``enter_module`` / ``exit_module`` are the every-module
    callbacks. It reads ``trace``, ``build`` (the trace's builder), ``ops``, ``pending`` (rows of ops not yet
    records), ``module_steps``, ``stops``, ``save``, ``sink``, ``transient``, ``stale``, ``alias_writes`` and
    ``trace_ref``, and writes ``stack``, ``top`` and ``unsettled``; the class it is mixed into defines
    ``_edit_op`` and ``_keep``."""

    trace: Any
    build: Any
    ops: list[Op]
    pending: list[tuple]
    stack: list[ModuleCall]
    top: Any
    module_steps: dict[str, list[tuple[int | None, Step]]]
    stops: dict[str, int | None]
    save: Any
    sink: Any
    transient: bool
    stale: dict[int, int]
    alias_writes: dict[int, list[Any]]
    unsettled: list[tuple[ModuleCall, list, Any]]
    trace_ref: Any

    def enter_module(self, info, args, kwargs) -> None:
        """Open the record of the module call ``info``: the ops that follow run in it."""
        address, module, pass_index = info  # a CallInfo is a tuple: unpacked, not read field by field
        call = _new_call(address, pass_index, type(module).__name__, args, kwargs, len(self.ops) + len(self.pending),
                         self.trace_ref)
        self.build.add_call(call, self.trace_ref)
        self.stack.append(call)
        self.top = call

    def exit_module(self, info, args, kwargs, output):
        """Close the module call ``info``: apply its capture-time edits, note which ops produced what
        it returns, keep that output, and stop the forward when ``until=`` names this call.

        Returns:
            The edited output, or None (the output stays as the module returned it).
        """
        stack = self.stack
        call = stack.pop() if stack else None
        self.top = stack[-1] if stack else NO_CALL  # the call enclosing the ops that follow
        address = info[0]  # (a CallInfo is a tuple: its ``address`` property is a call)
        if call is None or call.address != address:  # hooks out of step: find it
            call = next(c for c in reversed(self.trace.calls) if c.address == address)
        replaced = None
        steps = self.module_steps.get(call.address) if self.module_steps else None
        if steps:
            for pass_index, when in steps:
                if pass_index is None or pass_index == call.pass_index:
                    output = self._edit_op(when, output, call.address, call.pass_index, call.address, call)
                    replaced = output
        pending = self.pending
        n = call.op_end = len(self.ops) + len(pending)
        if type(output) is Tensor:  # the common module output, without the generic walk
            leaves = None
            # its last op made it (the latest producer there can be), or another op
            refs = [Ref(n - 1, None) if pending and pending[-1][2] is output else self._producer_ref(output)]
        else:
            leaves, call.out_spec = _flatten_output(output)
            refs = [self._producer_ref(leaf) if isinstance(leaf, Tensor) else None for leaf in leaves]
        if self.stale:
            # Memory of that op was overwritten through another view before the module returned:
            # no recorded op produced what it returns, so the call keeps its own copy instead.
            # (Unless replay can apply those writes again: then the op, with them, describes it.)
            refs = [None if r is not None and r.index in self.stale and not _reproducible(self.alias_writes, r.index)
                    else r for r in refs]
        call.out_refs = refs
        save = self.save
        if save is None or save.matches_call(call):
            # The outermost call returns what the forward returns, which the trace keeps as it is
            # (``trace.output``): its container is not rebuilt (a ModelOutput costs tens of us).
            call._out = output if leaves is None and refs[0] is not None else \
                self._kept_output(output, refs, call.out_spec, leaves, rebuild=bool(stack), call=call)
            if self.sink is not None:  # on disk, its tensors are read through the ops that produced them
                leaves, spec = flatten(call._out)
                # placeholders must not be None: a ModelOutput drops None fields, losing leaves
                call._out = unflatten([0 if r is not None else x for x, r in zip(leaves, refs)], spec)
            for ref in refs if save is not None else ():
                if ref is not None and not self.ops[ref.index].saved:
                    self._keep(ref.index)
        if self.transient:
            call.args, call.kwargs = (), {}  # the module's inputs are ops' values: freed with them
        if self.stops:
            stop_pass = self.stops.get(call.address, -1)
            if stop_pass != -1 and (stop_pass is None or stop_pass == call.pass_index):
                raise StopCapture(call.key)
        return replaced

    def _kept_output(self, output: Any, refs: list, spec: Any, leaves: list | None = None, rebuild: bool = True,
                     call: ModuleCall | None = None) -> Any:
        """The module output as the call record keeps it, safe from later changes by the model.

        Tensors some recorded op produced are guarded by copy on write already; a tensor no
        op produced (a buffer, a tensor made outside the capture) is copied now, and a
        container the model could refill (list, dict, ``ModelOutput``) is rebuilt.
        ``leaves``: ``flatten(output)[0]`` when the caller has it already; ``rebuild``: False keeps
        the container itself when no tensor in it needed a copy. With ``call`` (an in-memory
        capture), a container that needed no copy is kept as it is and its leaves noted:
        ``settle`` rebuilds it from them only if the model did refill it.
        """
        if spec is None and refs[0] is not None:
            return output
        leaves = list(leaves) if leaves is not None else flatten(output)[0]
        copied = False
        for i, ref in enumerate(refs):
            if ref is None and isinstance(leaves[i], Tensor):
                with torch._C.DisableTorchFunction():  # our copy, not an op of the model
                    leaves[i] = leaves[i].clone()
                copied = True
        if copied:
            return unflatten(leaves, spec)
        if rebuild and type(output) is not tuple:
            if call is None or self.sink is not None:
                return unflatten(leaves, spec)
            # Rebuilding a ModelOutput costs tens of us and the model almost never refills one:
            # the check after the forward (a flatten) is the cheaper side.
            self.unsettled.append((call, leaves, spec))
        return output

    def output_refs(self, output: Any) -> list | None:
        """The ops that produced the model output's tensors, when the outermost module call noted
        them as it returned ``output`` after the last op (None: ``TraceBuilder.finish`` looks them up)."""
        calls = self.trace.calls
        if not calls or self.stale:  # a call's refs leave out overwritten ops; the output's do not
            return None
        top = calls[0]
        if top.address or top.op_end != len(self.ops) or top._out is not output:
            return None
        return list(top.out_refs)

    def settle(self) -> None:
        """After the forward: a container a module returned that the model has refilled since
        (other leaves, other keys) is replaced on its call by one rebuilt from the leaves it had."""
        for call, leaves, spec in self.unsettled:
            now, now_spec = _flatten_output(call._out)
            if len(now) != len(leaves) or any(a is not b for a, b in zip(now, leaves)) or \
                    (now_spec is not spec and now_spec != spec):
                call._out = unflatten(leaves, spec)
        self.unsettled.clear()

    def _producer_ref(self, t: Tensor) -> Ref | None:
        """``trace.producer_ref(t, ...)`` as of now, the ops noted but not flushed included."""
        pending = self.pending
        base = len(self.ops)
        for i in range(len(pending) - 1, -1, -1):  # the latest producer first
            if pending[i][2] is t:
                return Ref(base + i, None)
        return self.build.producer_ref(t, base)


# A bound classmethod: called as a plain Python call (no class-call path, see ``Op.recorded``).
_new_call = ModuleCall.recorded


class _NoCall:
    """The module context of an op no module call encloses."""

    address = ""
    pass_index = 1


NO_CALL = _NoCall()
# Specs of module outputs whose tree is one container of leaves, by the container's type, its
# keys and the types of its elements (a module returning ``(out, None)`` is common: attention;
# a transformers model returns a ModelOutput from its top modules). Shared between captures,
# like the argument specs of ``core.graph``: a spec is immutable.
_SPECS: dict[tuple, Any] = {}
_MAX_SPECS = 1024


def _flatten_output(value: Any) -> tuple[list[Any], Any]:
    """``flatten(value)`` for a module output, without the pytree walk for a tensor, and for a tuple
    or a registered container (a ``ModelOutput``) of leaves seen before with the same keys and
    element types: the walk was ~10 us for each ModelOutput, met twice per capture (here, ``settle``)."""
    kind = type(value)
    if kind is Tensor:
        return [value], None
    nodes = _pytree.SUPPORTED_NODES
    node = nodes.get(kind)
    if node is None:
        return flatten(value)
    if kind is tuple:
        children, context = value, None
    else:
        children, context = node.flatten_fn(value)
        if type(context) is not list:
            return flatten(value)
    types = tuple(map(type, children))
    if not nodes.keys().isdisjoint(types):  # a container among them (registered since, maybe): walked
        return flatten(value)
    # the keys' types too: 1, 1.0 and True are one dict key (specs are kept for string keys only)
    key = (kind, types) if context is None else (kind, types, tuple(context), tuple(map(type, context)))
    try:
        spec = _SPECS.get(key)
    except TypeError:  # an unhashable key
        return flatten(value)
    if spec is None:
        leaves, spec = flatten(value)
        # kept when its elements are its leaves (a namedtuple among them gives its own leaves)
        if len(leaves) == len(children) and all(a is b for a, b in zip(leaves, children)) and \
                (context is None or all(type(k) is str for k in context)):
            if len(_SPECS) >= _MAX_SPECS:  # outputs keyed by data (a dict per token ...): kept bounded
                _SPECS.clear()
            _SPECS[key] = spec  # one container of leaves: its spec holds for the next one alike
        return leaves, spec
    return list(children), spec



def _reproducible(alias_writes: dict[int, list[Any]], index: int) -> bool:
    """Whether every write noted so far into op ``index``'s memory through another view can be applied again."""
    return all(w.reproducible for w in alias_writes.get(index, ()))
