"""``Trace``: the record of one real forward, read.

A trace reads one :class:`~torchlens.core.graph.Graph` (the records: ops, module calls, guards,
the output), which a :class:`~torchlens.core.builder.TraceBuilder` wrote while the forward ran
(or the loader decoded). ``trace.fork()`` branches it: a :class:`~torchlens.core.fork.Fork`
(:mod:`torchlens.core.fork`) holds the same ``Graph`` and owns only what it changed. The actions
carried out above the core (re-running, saving, pictures) come from
:class:`~torchlens.core.actions.TraceActions`.

Which value a consumer sees is decided in one place, :meth:`Trace.seen_value`; reads,
replay, validate and facets all ask it.
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..errors import (
    AmbiguousSiteError,
    EmptySelectionError,
    InvalidArgumentError,
    ReplayNotExactError,
    SiteNotFoundError,
    TokenizerRequiredError,
    TooManySitesError,
)
from .actions import TraceActions
from .graph import MISSING, DataRead, Graph
from .names import nearest
from .records import ModuleCall, Op, Ref
from .selectors import Label, Selector, as_selector, split_pass
from .services import services
from .sites import ModuleSites, Site, Sites
from .steps import REPLAY, Step
from .sweeping import SweepBlock
from .text import decode_tokens, input_ids_of, token_position
from .tree import Withheld, flatten, held_tensors, replace_held, unflatten
from .writes import fold

if TYPE_CHECKING:
    from .fork import Fork

__all__ = ["DataRead", "Trace"]

_NO_VALUES: dict[int, Any] = {}  # a trace's own op values: none (only a fork recomputes); never written


def _recorded(name: str, doc: str) -> property:
    """A read-only property giving the graph's ``name`` (the records a trace and its forks share)."""
    return property(attrgetter(f"_graph.{name}"), doc=doc)


class Trace(TraceActions):
    """The record of one forward: every executed op, every module call, inputs and output.

    Read it with ``trace[label_or_address]``, ``trace.layers``, ``trace.modules`` and
    ``trace.find_sites(selector)``; edit it after the fact with ``trace.fork().do(...)``.
    Capture engines and the loader build it through a
    :class:`~torchlens.core.builder.TraceBuilder`; a trace itself only reads.
    """

    _sweeping: SweepBlock | None = None  # the open ``with trace.sweep():`` block queuing its forks' edits
    # the tokenizer the inputs were made with (tokenizer=, or model.tokenizer; ``tokens`` and ``str_tokens``
    # read it); a trace loaded from disk has none until one is set: ``trace.tokenizer = tok``
    tokenizer: Any = None
    # The class ``fork()`` makes: :class:`~torchlens.core.fork.Fork`, a subclass, which names itself
    # with ``class Fork(Trace, branch=True)`` (see ``__init_subclass__``): core.fork imports this
    # module, so this module cannot import it back.
    _branch: ClassVar[type[Fork]]

    def __init_subclass__(cls, *, branch: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if branch:
            Trace._branch = cls

    def __init__(self, graph: Graph, *, name: str = "trace", tokenizer: Any = None) -> None:
        self._graph = graph
        self.name = name
        self.tokenizer = tokenizer

    # -- the records (shared with every fork of this trace) ----------------------------------------
    model = _recorded("model", "The model that ran (None for a trace loaded from disk).")
    strict = _recorded("strict", "Whether an edit on it (or its forks) that changes nothing raises, not warns.")
    args = _recorded("args", "The forward's positional inputs.")
    kwargs = _recorded("kwargs", "The forward's keyword inputs.")
    ops = _recorded("ops", "Every recorded op record (``Op``), in execution order.")
    calls = _recorded("calls", "Every module call record (``ModuleCall``), in the order they returned.")
    input_layers = _recorded("input_layers", "Labels of the input ops.")
    output_layers = _recorded("output_layers", "Labels of the ops whose tensors the model returned.")
    data_reads = _recorded("data_reads", "The data-dependent reads the forward made (guards), in order.")
    grad = _recorded("grad", "Whether the capture ran with autograd (replay follows it).")
    complete = _recorded("complete", "False for a transaction stopped early (``run_transaction``).")
    fingerprint = _recorded("fingerprint", "The model's fingerprint, for a trace loaded from disk.")
    saved_tensor_names = _recorded("saved_tensor_names", "Parameter names a loaded trace was saved with.")
    has_op_graph = _recorded("op_graph", "Whether every op of the forward was recorded (replay and validate "
                                         "need it).")
    nbytes = _recorded("nbytes", "Bytes held by the recorded op values and module outputs (each storage "
                                 "counted once).")

    @property
    def engine(self) -> str:
        """The capture engine that recorded the forward (shown and saved, never branched on); an
        engine that delegates to another names the trace its own (``trace.engine = self.name``)."""
        return self._graph.engine

    @engine.setter
    def engine(self, name: str) -> None:
        self._graph.engine = name

    @property
    def steps(self) -> list[Step]:
        """The capture-time steps (``tl.when``) that made this forward, in order."""
        return self._graph.steps

    @property
    def edits(self) -> list[Any]:
        """The edits that landed (``AppliedEdit``), in order: capture-time, then a fork's own."""
        return self._graph.edits

    @property
    def unsaved_steps(self) -> list[str]:
        """Why steps of a trace loaded from disk could not be saved."""
        return self._graph.unsaved_steps

    def require_op_graph(self, what: str) -> None:
        """Raise ``ReplayNotExactError`` naming ``what`` when this trace holds no op graph."""
        self._graph.require_op_graph(what)

    def ensure_graph(self) -> None:
        """Link every op's arguments to the ops that produced them and note each op's children
        (derived once, on the first read that needs them)."""
        self._graph.ensure_graph()

    def producer_ref(self, tensor: Any, before: int) -> Ref | None:
        """The op that last produced ``tensor`` before op index ``before`` (None: not recorded)."""
        return self._graph.producer_ref(tensor, before)

    def passes_of(self, address: str) -> int:
        """How many calls of the module at ``address`` were recorded (``ModuleCall.n_passes``)."""
        return self._graph.passes_of(address)

    def grad_of(self, op: Op) -> Any:
        """The gradient of op ``op``'s output (a tuple for a multi-output op).

        Raises:
            ValueNotSavedError: no gradient was recorded for it (see the message for why).
        """
        return self._graph.grad_of(op)

    # -- which value a consumer sees (the one rule) ---------------------------------------------
    def value(self, index: int, *, pending_ok: bool = False) -> Any:
        """Op ``index``'s own output in this trace (a fork's recomputed value when it has one);
        ``pending_ok`` returns a value replay stored unbuilt (a ``Pending``) as it is."""
        return self._graph.ops[index].out

    def has_value(self, index: int) -> bool:
        """Whether op ``index``'s output can be read here (kept by the capture, or a fork's own value)."""
        return self._graph.ops[index].saved

    def held_values(self) -> list[Any]:
        """What this trace keeps beyond its ops' recorded outputs (a fork's recomputed values; an
        unbuilt one as the tensors it holds), as they are: reading them builds nothing."""
        return []

    def _own_values(self) -> dict[int, Any]:
        return _NO_VALUES

    def seen_value(self, ref: Ref, consumer: int | ModuleCall | None = None, *, pending_ok: bool = False) -> Any:
        """The value ``ref`` names as ``consumer`` sees it.

        ``consumer`` is an op index (an op reading it as an argument), a module call
        (a module returning it), or None (everything after the forward: the model output).
        A module edit on a fork replaces what readers *after* that module see, not the
        producing op's own value: later ops, the model output and modules returning after
        the edited one (or enclosing it) see the edit; a submodule that returned first does not.
        """
        writes = self._graph.alias_writes.get(ref.index) if self._graph.alias_writes and consumer is not None else None
        v = self.value(ref.index, pending_ok=pending_ok and ref.elem is None and writes is None)
        sub = self._substitution(ref.index)
        since = 0
        if sub is not None and self._sees_substitution(sub[0], ref.index, consumer):
            # the edit's own tensor: the views later ops take are of it, so only their writes reach it
            v, since = sub[1], sub[0]
        v = v if ref.elem is None else v[ref.elem]
        if writes:
            v = self.with_writes(v, ref, consumer if isinstance(consumer, int) else consumer.op_end, since=since)
        return v

    def with_writes(self, value: Any, ref: Ref, position: int, written: Any = None, since: int = 0) -> Any:
        """``value`` (op ``ref``'s output) as a reader at ``position`` sees it: with the writes an
        in-place op at ``since`` or later made through another view of its memory before then
        (``torchlens.core.writes``). ``written`` gives a write op's value by index (default: this
        trace's). Unchanged when no write precedes the reader, or one cannot be laid out again
        (``_reproduces_writes`` says so)."""
        due = [w for w in self._graph.alias_writes.get(ref.index, ())
               if w.elem == ref.elem and since <= w.op < position]
        if not due or not all(w.reproducible for w in due) or not isinstance(value, torch.Tensor):
            return value
        return fold(value, due, written or self.value)

    def _reproduces_writes(self, index: int) -> bool:
        """Whether every write through another view into op ``index``'s memory can be applied again
        (True also when there is none): replay then rebuilds what each reader saw."""
        return self.unreplayable_write(index) is None

    def unreplayable_write(self, index: int) -> Op | None:
        """The first in-place op that wrote into op ``index``'s memory through another view in a way
        replay cannot lay out again (the memory may move, or the view reinterprets the dtype); None:
        there is none. A loaded trace does not keep the writes: any write it noted counts."""
        if index in self._graph.stale and not self._graph.alias_writes:  # loaded from disk: where it wrote is not kept
            return self._graph.ops[self._graph.stale[index]]
        for w in self._graph.alias_writes.get(index, ()):
            if not w.reproducible:
                return self._graph.ops[w.op]
        return None

    def writes_between(self, index: int, start: int, end: int) -> list[int]:
        """The in-place ops at positions ``start <= p < end`` that wrote into op ``index``'s memory
        through another view (a reader at ``end`` depends on them)."""
        writes = self._graph.alias_writes
        return [w.op for w in writes.get(index, ()) if start <= w.op < end] if writes else []

    def stale_positions(self) -> dict[int, int]:
        """Every op whose memory an in-place op overwrote, with the position it happened at."""
        return dict(self._graph.stale)

    def stale_after(self, index: int) -> int | None:
        """Position after which op ``index``'s memory was overwritten in place (None: never)."""
        return self._graph.stale.get(index)

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
            calls = self._graph.calls_by_address.get(address, ())
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
            edit_index = self._graph.capture_edit_of(record.index)
            if edit_index is None:
                return self.seen_value(Ref(record.index, None))
            edited = self.seen_value(Ref(edit_index, None))
            spec = getattr(self._graph.ops[edit_index].func, "spec", None)  # a structured output, flattened by the edit
            return edited if spec is None else unflatten(list(edited), spec)
        return self.module_output(record)

    def module_output(self, call: ModuleCall) -> Any:
        """What module call ``call`` returned in this trace (an edited output on a fork)."""
        override = self._module_outputs().get(call.key, MISSING)
        if override is not MISSING:
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
                if self._graph.held and id(raw_leaves[i]) in self._graph.held:
                    v = self._held_now(raw_leaves[i])
                    changed = changed or v is not raw_leaves[i]
                    raw_leaves[i] = v
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
                leaves[i] = self.with_writes(v if ref.elem is None else v[ref.elem], ref, call.op_end)
        return unflatten(leaves, spec)

    @property
    def output(self) -> Any:
        """The model's return value (rebuilt from edited values on a fork)."""
        if not self._own_values() and not self._module_outputs():
            return self._graph.recorded_output()  # its tensors read back from disk with store=
        leaves, spec = flatten(self._graph.output_raw)
        for i, ref in enumerate(self._graph.output_refs):
            # Memory of the producing op overwritten (through another view) before the model returned:
            # the recorded op does not describe what was returned, the returned tensor does.
            if ref is not None and self.stale_after(ref.index) is None:
                leaves[i] = self.seen_value(ref)
            elif ref is not None and self._reproduces_writes(ref.index):  # with the writes made before the return
                leaves[i] = self.seen_value(ref, len(self._graph.ops))
            elif ref is None and self._graph.held and id(leaves[i]) in self._graph.held:
                leaves[i] = self._held_now(leaves[i])
        return unflatten(leaves, spec)

    def _held_now(self, obj: Any) -> Any:
        """``obj``, an object of the model output that ``flatten`` keeps whole (a KV cache), as this
        trace has it: a copy holding this fork's values for the tensors replay recomputed (a cache's
        keys and values after an edit upstream of them), else ``obj`` itself."""
        entry = self._graph.held.get(id(obj))
        if entry is None or entry[0] is not obj:
            return obj
        current = dict(held_tensors(obj))
        new = dict(current)
        changed = False
        own = self._own_values()
        for path, ref in entry[1]:
            if ref is None or path not in current or (ref.index not in own and self._substitution(ref.index) is None):
                continue
            stale = self.stale_after(ref.index)
            if stale is not None and not self._reproduces_writes(ref.index):
                # memory written again through a view in a way replay cannot lay out again: not op's value
                return Withheld(obj, ReplayNotExactError(
                    f"this fork cannot give its {type(obj).__name__}: its {'.'.join(str(key) for _, key in path)} "
                    f"comes from op {self._graph.ops[ref.index].label}, whose memory an in-place op overwrote through "
                    "a view before the model returned, so replay cannot rebuild it, and the recorded one is stale",
                    op_label=self._graph.ops[ref.index].label,
                    remedy="Re-execute the real forward: fork.do(site, edit, model=model, inputs=x)."))
            v = self.seen_value(ref, len(self._graph.ops) if stale is not None else None)
            if v is not current[path]:
                new[path] = v
                changed = True
        return replace_held(obj, new) if changed else obj

    @property
    def output_refs(self) -> list[Ref | None]:
        return list(self._graph.output_refs)

    @property
    def raw_output(self) -> Any:
        """The model's return value as the forward produced it (no fork edits)."""
        return self._graph.recorded_output()

    # -- navigating --------------------------------------------------------------------------
    @property
    def layers(self) -> list[Site]:
        """Every recorded op in execution order (inputs first)."""
        return [Site(self, op) for op in self._graph.ops]

    @property
    def modules(self) -> ModuleSites:
        """Every module call in the order the calls started; also indexed by address
        (``trace.modules["transformer.h.0"]``, ``"block:2"``), like ``trace[...]``."""
        return ModuleSites(self, [Site(self, c) for c in sorted(self._graph.calls, key=lambda c: c.op_start)])

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
        calls = self._graph.calls_by_address.get(address)
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
        near = nearest(key, self._graph.calls_by_address)
        raise SiteNotFoundError(f"{key!r} is not the address of a module that ran in this trace; nearest: {near}",
                                site=key, candidates=near)

    @property
    def module_addresses(self) -> list[str]:
        return list(self._graph.calls_by_address)

    def calls_of(self, address: str) -> list[ModuleCall]:
        """Every call of the module at ``address``, in order (empty if it never ran)."""
        return list(self._graph.calls_by_address.get(address, ()))

    def has_label(self, label: str) -> bool:
        return label in self._graph.labels

    def op_index(self, label: str) -> int | None:
        return self._graph.labels.get(label)

    def __len__(self) -> int:
        return len(self._graph.ops)

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
        return sel.bind(services().names(self.model), strings_as_modules=strings_as_modules)

    def lookup(self, key: str) -> Op | ModuleCall:
        """The record an op label or module address (``addr``, ``addr:2``, a canonical name) names.

        Raises:
            SiteNotFoundError: nothing has that name.
            AmbiguousSiteError: a module that ran several times, named without a pass.
        """
        if not isinstance(key, str):
            raise InvalidArgumentError(f"trace[...] takes an op label or module address, got {type(key).__name__}")
        index = self._graph.labels.get(key)
        if index is not None:
            return self._graph.ops[index]
        address, pass_index = split_pass(key)
        calls = self._graph.calls_by_address.get(address)
        if calls:
            return self._pick_pass(key, address, pass_index, calls)
        bound = self.bind(Label(key)) if self.model is not None else None
        if isinstance(bound, Label) and bound.label in self._graph.labels:  # a sub-site named by a canonical site
            return self._graph.ops[self._graph.labels[bound.label]]
        if bound is not None and not isinstance(bound, Label):
            found = bound.match(self)
            if len(found) == 1:
                return found[0]
            paths = bound.module_paths()
            if paths and len(paths) == 1 and pass_index is None:
                real = split_pass(paths[0])[0]
                return self._pick_pass(key, real, None, self._graph.calls_by_address.get(real, []))
            names = [r.key if isinstance(r, ModuleCall) else r.label for r in found]
            raise AmbiguousSiteError(
                f"{key!r} matches {len(found)} sites: {names[:8]}", site=key, passes=names,
                remedy=f"Name one of them, e.g. trace[{names[0]!r}], or get them all with "
                       f"trace.find_sites({key!r}).",
            )
        if self.model is None:
            self._refuse_unresolved_sub_site(key, address)
        near = nearest(key, [*self._graph.calls_by_address, *self._graph.labels])
        raise SiteNotFoundError(
            f"{key!r} is neither an op label nor a module address of this trace; nearest: {near}",
            site=key,
            candidates=near,
        )

    def _refuse_unresolved_sub_site(self, key: str, address: str) -> None:
        """On a trace without its model (loaded from disk), a name ``<site>.<part>`` whose site is no
        module of the trace (a canonical name, ``blocks.1.features``) cannot be resolved; when the trace
        has ``<part>`` sub-sites of real modules (``transformer.h.1.features``), name them.

        Raises:
            SiteNotFoundError: always, when such sub-sites exist (nothing otherwise).
        """
        head, _, part = address.rpartition(".")
        if not head or head in self._graph.calls_by_address:
            return
        real = sorted(label for label in self._graph.labels
                      if split_pass(label)[0].rpartition(".")[2] == part
                      and split_pass(label)[0].rpartition(".")[0] in self._graph.calls_by_address)
        if real:
            raise SiteNotFoundError(
                f"{key!r} names its site {head!r} by a name this trace cannot resolve: it has no model (loaded "
                f"from disk), so a canonical name is not mapped to a module; its {part!r} sub-sites are named by "
                f"real address: {real}",
                site=key, candidates=real,
                remedy=f"Name the real address, e.g. trace[{real[0]!r}] (canonical names such as {key!r} work on "
                       "a trace captured with the model).",
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
            return Site(self, self._graph.ops[key])
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
            raise self._empty_selection(sel)
        if max_fanout is not None and len(records) > max_fanout:
            raise TooManySitesError(
                f"{sel.describe()} matches {len(records)} sites, more than max_fanout={max_fanout}",
                site=sel.describe(),
                count=len(records),
            )
        return Sites([Site(self, r) for r in records], sel)

    def _empty_selection(self, sel: Selector) -> EmptySelectionError:
        """The error for a selector that matched nothing, with the names nearest to the one it uses."""
        name = next((v for v in (getattr(sel, a, None) for a in ("path", "name", "label")) if isinstance(v, str)),
                    sel.describe())
        near = nearest(name, [*self._graph.calls_by_address, *self._graph.labels])
        return EmptySelectionError(f"{sel.describe()} matches nothing in this trace; nearest names: {near}",
                                   site=sel.describe(), candidates=near)

    # -- text: the input's tokens (docs/concepts.md, "Text in") ----------------------------------
    @property
    def tokens(self) -> Any:
        """The input's token ids ``[batch, tokens]`` (padding included), for a trace made from text or
        with ``tokenizer=``.

        Raises:
            TokenizerRequiredError: the trace was made without a tokenizer, or its inputs hold no token ids.
        """
        if self.tokenizer is None:
            raise TokenizerRequiredError(
                "this trace was not made from text or with a tokenizer, so which input holds token ids is unknown",
                remedy="Capture with tl.trace(model, text_or_ids, tokenizer=tok) (or set model.tokenizer = tok); "
                       "the raw inputs are trace.args and trace.kwargs.")
        ids = input_ids_of(self.args, self.kwargs)
        if ids is None:
            raise TokenizerRequiredError("this trace's inputs hold no token ids (no input_ids=, no integer tensor)",
                                         remedy="Read the raw inputs from trace.args and trace.kwargs.")
        return ids

    @property
    def str_tokens(self) -> list[list[str]]:
        """Each row's tokens as strings, every id decoded alone as TransformerLens's ``to_str_tokens``
        does (``trace.str_tokens[0]`` is its ``model.to_str_tokens(prompt)``); padding included.

        Raises:
            TokenizerRequiredError: as :attr:`tokens`.
        """
        return decode_tokens(self.tokens, self.tokenizer)

    def position(self, token: str, *, row: int | None = None) -> int:
        """The position of the token string ``token`` (``" Paris"``) in the prompt (``row``: which
        prompt of a batch; needed when there are several).

        Raises:
            TokenNotFoundError: no token is exactly ``token`` (the prompt's token strings are listed).
            AmbiguousTokenError: ``token`` occurs several times (each position is named).
            InvalidArgumentError: a batch of several prompts and no ``row``, or ``row`` out of range.
            TokenizerRequiredError: as :attr:`tokens`.
        """
        rows = self.str_tokens
        if row is None and len(rows) > 1:
            raise InvalidArgumentError(f"the trace holds {len(rows)} prompts; say which with row=",
                                       remedy="Pass row=i, the index of the prompt in the batch.")
        index = 0 if row is None else row
        if isinstance(index, bool) or not isinstance(index, int) or not -len(rows) <= index < len(rows):
            raise InvalidArgumentError(f"row={row!r} is not a prompt of this trace's batch of {len(rows)}")
        return token_position(rows[index], token)

    # -- branching and editing -------------------------------------------------------------
    def fork(self, name: str | None = None) -> Fork:
        """An isolated branch: edits on it never change this trace or its other forks."""
        return self._branch(self, name)

    def sweep(self, *, batch_size: int | None = None) -> SweepBlock:
        """A block in which forks edited in a plain loop are replayed together.

        Inside ``with trace.sweep():``, ``trace.fork().do(site, edit)`` checks and queues the edit
        and returns the fork at once; every queued fork is replayed in one batched pass, as
        :meth:`forks` replays them, when the block ends or when one of them is first read.
        Read the forks' values after the loop: a read inside the loop replays what is queued so
        far (correct, only less batched). Each fork equals ``fork.do`` replayed alone (to float
        rounding). ``do`` with ``model=``/``inputs=`` or ``check=True`` runs at once.

        An edit that fails when replayed leaves its fork as it was before that edit (later edits
        queued on the fork are dropped); its error is raised at the first read of the fork, or
        when the block ends. An exception leaving the block replays nothing: the queued forks
        are replayed when one of them is first read.

        Args:
            batch_size: how many forks replay together (None: all), as in :meth:`forks`.

        Returns:
            the block (a context manager; ``block.queued`` counts the forks waiting).

        Raises:
            InvalidArgumentError: entering a block inside another block of this trace, entering one
                block twice, or a bad ``batch_size``.
        """
        return SweepBlock(self, batch_size)

    def forks(self, edits: Any, *, names: Any = None, check: bool = False, replay: str = "auto",
              batch_size: int | None = None) -> list[Fork]:
        """One fork per item of ``edits`` — a ``(site, edit)`` pair, or a list of pairs applied in
        order — all forks replayed together, op by op, so an op several forks recompute on a few
        rows runs once on their stacked rows (one read of its weights instead of one per fork).

        Each fork equals ``self.fork().do(site, edit, ...)`` chained over its pairs (to float
        rounding, as sliced replay); the forks' ``edits[-1].replay`` logs say what was recomputed.
        A sweep such as zeroing each block's output at the last position costs about one sliced
        replay of the whole model instead of one per fork: fresh forks whose edits change the
        same rows are walked through the graph once, their rows stacked in one tensor per op.

        Args:
            edits: per fork, a ``(site, edit)`` pair as ``fork.do(site, edit)`` takes it, or a list of them.
            names: a name per fork (default ``"<trace>/fork"``).
            check: re-execute each fork's recipe and compare (``fork.do(check=True)``).
            replay: what a changed guard does, as in :meth:`Fork.do` (that fork is then handled alone).
            batch_size: how many forks replay together (None: all). Each fork holds its own
                recomputed rows either way; stacking adds at most one batch's rows of one op.

        Returns:
            the forks, in the order of ``edits``.

        Raises:
            InvalidArgumentError: an item of ``edits`` that is neither a ``(site, edit)`` pair nor a
                non-empty list of them, ``names`` of another length, a bad ``replay`` or ``batch_size``.
            SiteNotFoundError: a site names nothing in this trace (no fork is made).
            GuardChangedError: an edit changes a guard and no fallback was allowed or possible.
            ReplayNotExactError: the recorded graph cannot reproduce an edit exactly.
        """
        items = [_edit_pairs(item) for item in edits]
        if names is not None:
            names = list(names)
            if len(names) != len(items):
                raise InvalidArgumentError(f"names= gives {len(names)} names for {len(items)} forks")
        made = [self.fork(None if names is None else names[i]) for i in range(len(items))]
        steps = [[Step(f.bind(site, strings_as_modules=True), edit, REPLAY) for site, edit in pairs]
                 for f, pairs in zip(made, items)]
        return services().replay_many(made, steps, check=check, replay=replay, batch_size=batch_size)

    def do(self, site: Any, edit: Any, *, model=None, inputs=None, check: bool = False) -> Trace:
        raise InvalidArgumentError(
            "do() edits a fork, never the original trace",
            remedy="Call trace.fork(name).do(site, edit); the fork shares memory with the trace.",
        )

    def all_steps(self) -> list[Step]:
        """Every step that made this trace: capture-time steps (then, on a fork, its recipe)."""
        return list(self.steps)

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.name!r}: {len(self._graph.ops)} ops, {len(self._graph.calls)} module calls, "
            f"outputs {self.output_layers}>"
        )


def _edit_pairs(item: Any) -> list[tuple[Any, Any]]:
    """One fork's edits for ``Trace.forks``: a ``(site, edit)`` pair or a non-empty list of them."""
    def is_pair(x: Any) -> bool:
        return isinstance(x, (tuple, list)) and len(x) == 2 and not isinstance(x[0], (tuple, list))

    if is_pair(item):
        return [tuple(item)]
    if isinstance(item, (tuple, list)) and item and all(is_pair(x) for x in item):
        return [tuple(x) for x in item]
    raise InvalidArgumentError(
        f"forks() takes, per fork, a (site, edit) pair or a list of them; got {type(item).__name__} {item!r:.60}",
        remedy="Pass e.g. [(tl.module('transformer.h.0'), edit), [(site_a, edit_a), (site_b, edit_b)], ...].")
