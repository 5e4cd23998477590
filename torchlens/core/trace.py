"""``Trace``: the record of one real forward, and ``Fork``: an isolated branch of it.

A trace owns the records (ops, module calls). A fork owns only what it changed: a
dictionary of replaced op values and the recipe of steps that produced them, so forks of
forks are cheap and never disturb their parent.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

import torch

from ..capture.names import nearest
from ..errors import AmbiguousSiteError, InvalidArgumentError, SiteNotFoundError, TooManySitesError
from .records import INPUT, ModuleCall, Op, Ref
from .selectors import Selector, as_selector
from .sites import Site, Sites
from .tree import flatten, unflatten


class Trace:
    """The record of one forward: every executed op, every module call, inputs and output.

    Read it with ``trace[label_or_address]``, ``trace.layers``, ``trace.modules`` and
    ``trace.find_sites(selector)``; edit it after the fact with ``trace.fork().do(...)``.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: tuple = (), kwargs: dict | None = None):
        self.model = model
        self.args = args
        self.kwargs = kwargs or {}
        self.name = "trace"
        self.ops: list[Op] = []
        self.calls: list[ModuleCall] = []
        self._labels: dict[str, int] = {}
        self._calls_by_address: dict[str, list[ModuleCall]] = {}
        self._producers: dict[int, tuple[list[int], list[int | None]]] = {}
        self.input_layers: list[str] = []
        self.output_layers: list[str] = []
        self._output_raw: Any = None
        self._output_refs: list[Ref | None] = []
        self._output_spec: Any = None
        self.data_reads: list[tuple[int, Ref | None, Any, int, str]] = []
        self.edits: list[Any] = []
        self.steps: list[Any] = []  # capture-time edits (When objects), in order
        self.engine = "function_mode"
        self.grad = False  # whether the capture ran with autograd (replay follows it)
        self.complete = True  # False for a transaction stopped early
        self._graph_ready = False
        self._values: dict[int, Any] = {}
        self._stale: dict[int, int] = {}  # op index -> position after which its memory was overwritten

    # -- building (used by engines) ------------------------------------------------------
    def _add_op(self, op: Op) -> None:
        op.trace = self
        self._labels[op.label] = op.index
        self.ops.append(op)

    def _add_call(self, call: ModuleCall) -> None:
        call.trace = self
        self.calls.append(call)
        same = self._calls_by_address.setdefault(call.address, [])
        same.append(call)
        n = len(same)
        for c in same:
            c.n_passes = n

    def _register(self, tensor: torch.Tensor, index: int, elem: int | None) -> None:
        entry = self._producers.get(id(tensor))
        if entry is None:
            self._producers[id(tensor)] = ([index], [elem])
        else:
            entry[0].append(index)
            entry[1].append(elem)

    def _ref_for(self, tensor: Any, before: int) -> Ref | None:
        """The op that last produced ``tensor`` before op index ``before``."""
        entry = self._producers.get(id(tensor))
        if entry is None:
            return None
        idx, elems = entry
        k = bisect.bisect_left(idx, before) - 1
        if k < 0:
            return None
        return Ref(idx[k], elems[k])

    def _refs_for_value(self, value: Any, before: int) -> tuple[list[Ref | None], Any]:
        leaves, spec = flatten(value)
        refs = [self._ref_for(leaf, before) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        return refs, spec

    def _ensure_graph(self) -> None:
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
                    ref = self._ref_for(leaf, op.index)
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

    def _finish(self, output: Any, save: Selector | None) -> None:
        """Called once the forward returned: record outputs, then drop unsaved values."""
        self._output_raw = output
        n = len(self.ops)
        self._output_refs, self._output_spec = self._refs_for_value(output, n)
        self.output_layers = list(
            dict.fromkeys(self.ops[r.index].label for r in self._output_refs if r is not None)
        )
        if save is not None:
            self._ensure_graph()
            matched = save.match(self)
            keep = {id(r) for r in matched}
            for r in matched:  # a kept module output is read through the ops that produced it
                if isinstance(r, ModuleCall):
                    keep.update(id(self.ops[ref.index]) for ref in r.out_refs if ref is not None)
            for op in self.ops:
                if id(op) not in keep and not op.flags & INPUT:
                    op.drop_value()
            for call in self.calls:
                if id(call) not in keep:
                    call._out = None
            for op in self.ops:
                op.args = op.kwargs = None
        # identity of tensors no longer matters once the graph is resolvable
        self._producers_frozen = True

    # -- reading ---------------------------------------------------------------------------
    def value(self, index: int) -> Any:
        """The value of op ``index`` in this trace (a fork's replacement when it has one)."""
        v = self._values.get(index, _MISSING)
        if v is _MISSING:
            return self.ops[index].out
        return v

    def _resolve_ref(self, ref: Ref | None, raw: Any, reader: ModuleCall | None = None,
                     final: bool = False) -> Any:
        """The value ``ref`` names as ``reader`` (a module returning it) or, with ``final``,
        as everything after the forward sees it."""
        if ref is None:
            return raw
        v = self._value_at(ref.index, reader) if reader is not None or final else self.value(ref.index)
        return v if ref.elem is None else v[ref.elem]

    def _value_at(self, index: int, reader: ModuleCall | None) -> Any:
        # A module edit on a fork replaces what readers after that module see (``_subst``),
        # not the producing op's own value: the model output and modules returning after the
        # edited one (or enclosing it) see the edit; a submodule that returned first does not.
        sub = getattr(self, "_subst", None)
        if sub:
            found = sub.get(index)
            if found is not None and (reader is None or found[0] < reader.op_end
                                      or (found[0] == reader.op_end and self._encloses_edit(reader, index))):
                return found[1]
        return self.value(index)

    def _encloses_edit(self, reader: ModuleCall, index: int) -> bool:
        """Whether ``reader`` returned after the edited module that replaced op ``index``."""
        for key in self._module_overrides():
            address, pass_index = key.rsplit(":", 1)
            calls = self._calls_by_address.get(address, ())
            edited = calls[int(pass_index) - 1] if 0 < int(pass_index) <= len(calls) else None
            if edited is None or not any(r is not None and r.index == index for r in edited.out_refs):
                continue
            inside = reader.address == "" or edited.address.startswith(reader.address + ".")
            if inside and reader.op_start <= edited.op_start:
                return True
        return False

    def _read(self, record: Op | ModuleCall) -> Any:
        if isinstance(record, Op):
            return self._value_at(record.index, None)
        return self._module_out(record)

    def _module_out(self, call: ModuleCall) -> Any:
        override = self._module_overrides().get(call.key, _MISSING)
        if override is not _MISSING:
            return override
        raw = call._out
        if raw is None and call.out_refs:
            leaves = [self._resolve_ref(r, None, call) for r in call.out_refs]
            return unflatten(leaves, call.out_spec)
        if not call.out_refs:
            return raw
        # Rebuild only when an op value differs from the object the hook saw (snapshots, forks).
        raw_leaves, spec = flatten(raw)
        changed = False
        for i, ref in enumerate(call.out_refs):
            if ref is None:
                continue
            v = self._resolve_ref(ref, raw_leaves[i], call)
            if v is not raw_leaves[i]:
                raw_leaves[i] = v
                changed = True
        return unflatten(raw_leaves, spec) if changed else raw

    def _module_overrides(self) -> dict[str, Any]:
        return {}

    @property
    def output(self) -> Any:
        """The model's return value (rebuilt from edited values on a fork)."""
        if not self._values and not self._module_overrides():
            return self._output_raw
        leaves, spec = flatten(self._output_raw)
        for i, ref in enumerate(self._output_refs):
            if ref is not None:
                leaves[i] = self._resolve_ref(ref, leaves[i], final=True)
        return unflatten(leaves, spec)

    @property
    def layers(self) -> list[Site]:
        """Every recorded op in execution order (inputs first)."""
        return [Site(self, op) for op in self.ops]

    @property
    def modules(self) -> list[Site]:
        """Every module call in the order the calls started."""
        return [Site(self, c) for c in sorted(self.calls, key=lambda c: c.op_start)]

    @property
    def module_addresses(self) -> list[str]:
        return list(self._calls_by_address)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Site]:
        return iter(self.layers)

    def __contains__(self, key: str) -> bool:
        try:
            self._lookup(key)
        except (SiteNotFoundError, AmbiguousSiteError):
            return False
        return True

    def resolve_path(self, path: str) -> str:
        """Map a canonical adapter name (``blocks.3.mlp``) to a real module address."""
        from .selectors import split_pass

        address, pass_index = split_pass(path)
        if address in self._calls_by_address or address == "" or self.model is None:
            return path
        from ..plugins import resolve_canonical

        real = resolve_canonical(self.model, address)
        if real is None:
            return path
        return real if pass_index is None else f"{real}:{pass_index}"

    def _lookup(self, key: str) -> Op | ModuleCall:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"trace[...] takes an op label or module address, got {type(key).__name__}")
        index = self._labels.get(key)
        if index is not None:
            return self.ops[index]
        from .selectors import split_pass

        address, pass_index = split_pass(self.resolve_path(key))
        calls = self._calls_by_address.get(address)
        if calls:
            if pass_index is None:
                if len(calls) > 1:
                    passes = [c.key for c in calls]
                    raise AmbiguousSiteError(
                        f"module {address!r} ran {len(calls)} times; say which pass: {passes}",
                        site=key,
                        passes=passes,
                    )
                return calls[0]
            if 1 <= pass_index <= len(calls):
                return calls[pass_index - 1]
        if self.model is not None:
            from ..plugins import canonical_selector

            target = canonical_selector(self.model, key)
            if target is not None:
                found = target.match(self)
                if len(found) == 1:
                    return found[0]
                raise AmbiguousSiteError(
                    f"{key!r} matches {len(found)} sites; use find_sites to get them all", site=key
                )
        pool = [*self._calls_by_address, *self._labels]
        raise SiteNotFoundError(
            f"{key!r} is neither an op label nor a module address of this trace; nearest: {nearest(key, pool)}",
            site=key,
            candidates=nearest(key, pool),
        )

    def __getitem__(self, key: str | int) -> Site:
        if isinstance(key, int):
            return Site(self, self.ops[key])
        return Site(self, self._lookup(key))

    def find_sites(self, selector: Any, max_fanout: int | None = None) -> Sites:
        """All sites a selector matches, in execution order.

        Raises:
            SiteNotFoundError / EmptySelectionError: nothing matches.
            TooManySitesError: more than ``max_fanout`` matches.
        """
        sel = as_selector(selector)
        records = sel.match(self)
        if not records:
            from ..errors import EmptySelectionError

            raise EmptySelectionError(f"{sel.describe()} matches nothing in this trace", site=sel.describe())
        if max_fanout is not None and len(records) > max_fanout:
            raise TooManySitesError(
                f"{sel.describe()} matches {len(records)} sites, more than max_fanout={max_fanout}",
                site=sel.describe(),
                count=len(records),
            )
        return Sites([Site(self, r) for r in records], sel)

    # -- branching and editing -------------------------------------------------------------
    def fork(self, name: str | None = None) -> Fork:
        """An isolated branch: edits on it never change this trace or its other forks."""
        return Fork(self, name)

    def do(self, site: Any, edit: Any, *, model=None, inputs=None, check: bool = False) -> Trace:
        raise InvalidArgumentError(
            "do() edits a fork, never the original trace",
            remedy="Call trace.fork(name).do(site, edit); the fork shares memory with the trace.",
        )

    def run(self, model: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> Trace:
        """Run the model again with this trace's capture-time edits and return a new trace."""
        from ..api import trace as _trace

        model = model if model is not None else self.model
        if not args and not kwargs:
            args, kwargs = self.args, self.kwargs
        return _trace(model, *args, intervene=list(self.steps) or None, **kwargs)

    def run_transaction(self, *, inputs: Any = None, until: Any, model=None) -> Trace:
        """Run the forward again and stop right after ``until``; return the partial trace."""
        from ..api import trace_until

        model = model if model is not None else self.model
        if inputs is None:
            args, kwargs = self.args, self.kwargs
        else:
            from ..capture.request import split_inputs

            args, kwargs = split_inputs(inputs)
        return trace_until(model, args, kwargs, until, intervene=list(self.steps) or None)

    def validate(self, **kwargs: Any):
        from ..validate import validate

        return validate(self, **kwargs)

    # -- persistence (implemented in torchlens.recipes / torchlens.persist) ------------------
    def save_intervention(self, path: Any, level: str = "portable", *, overwrite: bool = False) -> Any:
        """Write this trace's edits (capture-time steps and, on a fork, its recipe) as ``.tlspec/``."""
        from ..recipes import save_intervention

        return save_intervention(self, path, level=level, overwrite=overwrite)

    def save(self, path: Any, *, selector: Any = None, overwrite: bool = False) -> Any:
        """Write the graph (JSON) and activations (safetensors), optionally only ``selector``'s ops."""
        from ..persist import save_trace

        return save_trace(self, path, selector=selector, overwrite=overwrite)

    # -- presentation ----------------------------------------------------------------------
    def table(self, selector: Any = None, limit: int | None = None) -> str:
        """A text table of ops (label, function, module:pass, shape, source line)."""
        from ..display import op_table

        return op_table(self, selector, limit)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r}: {len(self.ops)} ops, {len(self.calls)} module calls, "
            f"outputs {self.output_layers}>"
        )


class _Missing:
    pass


_MISSING = _Missing()


class Fork(Trace):
    """A branch of a trace. Shares every record and unchanged value with its parent."""

    def __init__(self, parent: Trace, name: str | None = None) -> None:
        self.__dict__.update(parent.__dict__)
        self.parent = parent
        self.name = name or f"{parent.name}/fork"
        self._values = dict(parent._values)
        self._subst: dict[int, tuple[int, Any]] = dict(getattr(parent, "_subst", {}))
        self._overrides: dict[str, Any] = dict(parent._module_overrides())
        self.recipe: list[Any] = list(getattr(parent, "recipe", []))
        self.edits = list(parent.edits)

    def _module_overrides(self) -> dict[str, Any]:
        return self._overrides

    def do(self, site: Any, edit: Any, *, model=None, inputs=None, check: bool = False) -> Fork:
        """Apply ``edit`` at ``site`` on this fork and push it down the recorded graph.

        Without ``model``/``inputs`` only ops downstream of the site are re-executed from
        their recorded arguments. With both, the real forward is re-executed with the
        fork's whole recipe. ``check=True`` replays and then re-executes to compare.

        Returns:
            this fork, for chaining.

        Raises:
            ReplayNotExactError: the recorded graph cannot reproduce this edit exactly.
        """
        from ..replay import do_on_fork

        return do_on_fork(self, site, edit, model=model, inputs=inputs, check=check)

    def run(self, model: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> Trace:
        """Run the model again with the parent's capture-time edits plus this fork's recipe."""
        from ..api import trace as _trace

        model = model if model is not None else self.model
        if not args and not kwargs:
            args, kwargs = self.args, self.kwargs
        steps = list(self.steps) + [step.as_when() for step in self.recipe]
        return _trace(model, *args, intervene=steps or None, **kwargs)
