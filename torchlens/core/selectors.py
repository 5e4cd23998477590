"""Selectors: where to read or edit, resolved against a recorded trace or a live capture.

``tl.module(path)`` is a module's output, ``tl.in_module(path)`` every op inside it,
``tl.func(name)`` ops by function name, a plain string an op label or module address.
They compose with ``&`` and ``|``. A selector made only of module outputs can be served
by module hooks alone, which is what makes ``tl.extract`` cheap.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import EmptySelectionError, FusedKernelError, InvalidArgumentError, SiteError, SiteNotFoundError
from .names import nearest
from .records import DISPATCH, ModuleCall, Op

__all__ = [
    "OP_LABEL", "And", "Func", "InModule", "Label", "ModuleOutput", "Names", "Or", "Record", "Selector", "as_selector",
    "as_sites", "func", "in_module", "module", "split_pass",
]

if TYPE_CHECKING:
    from .trace import Trace

Record = Op | ModuleCall
# What an op label looks like (``linear_3``, ``input_0``): a string site of this form that is not a
# module is kept as a label, known once the op runs.
OP_LABEL = re.compile(r"^(?:[A-Za-z0-9_]+_\d+|input_.+)$")


class Names(Protocol):
    """One model's names, as a selector binds to them (:meth:`Selector.bind`).

    ``torchlens.arch`` provides one per model (``arch.resolve.ModelNames``); the selectors decide
    what the answers mean for them, so ``arch`` knows no selector class but the ones it returns.
    """

    def canonical(self, path: str) -> Selector | None:
        """What a canonical name (``blocks.3.mlp``, ``blocks.3.resid_mid``) selects in this model; None
        when ``path`` is a real module address or no canonical name.

        Raises:
            SiteNotFoundError: a canonical name this model does not have.
        """

    def sub_site(self, label: str) -> str | None:
        """The capture's label of a splice sub-site named ``label`` (``blocks.6.features``), or None."""

    def is_module(self, path: str) -> bool:
        """Whether ``path`` (``address`` or ``address:pass``) is the address of one of the model's modules."""

    def not_found(self, label: str) -> SiteNotFoundError:
        """The error for a string site that names nothing in this model (with the nearest module names)."""


def split_pass(path: str) -> tuple[str, int | None]:
    """``'a.b:2'`` -> ``('a.b', 2)``; a path without a pass -> ``(path, None)``."""
    head, sep, tail = path.rpartition(":")
    if sep and tail.isdigit():
        return head, int(tail)
    return path, None


class Selector:
    """Base of all selectors; subclasses say what they match."""

    def match(self, trace: Trace) -> list[Record]:
        raise NotImplementedError

    def module_paths(self) -> list[str] | None:
        """Module addresses this selector reads, if it is made of module outputs only."""
        return None

    def matches_op(self, op: Op) -> bool:
        """Whether a just-executed op belongs to this selector (for capture-time use)."""
        return False

    def matches_call(self, call: ModuleCall) -> bool:
        """Whether a module call that just returned is one of this selector's module outputs
        (for capture-time use: a bounded ``save=`` keeps its value)."""
        for path in self.module_paths() or ():
            address, pass_index = split_pass(path)
            if address == call.address and (pass_index is None or pass_index == call.pass_index):
                return True
        return False

    def describe(self) -> str:
        return repr(self)

    def capture_refusal(self) -> str | None:
        """Why an edit at this site cannot fire during a capture, known before it runs (None: it can)."""
        return None

    def bind(self, names: Names, *, strings_as_modules: bool) -> Selector:
        """This selector with its names resolved against one model's ``names``, once, before it is
        matched (``trace.bind``, the capture request). A selector without names is itself.

        With ``strings_as_modules`` (capture-time sites and ``fork.do``), a plain string naming a
        module becomes a module selector (every pass) and a string naming nothing is refused.

        Raises:
            SiteNotFoundError: a string site that names nothing (with ``strings_as_modules``), a
                canonical name this model does not have, or ``in_module`` of a canonical op.
        """
        return self

    def __and__(self, other: Any) -> Selector:
        return And(self, as_selector(other))

    def __or__(self, other: Any) -> Selector:
        return Or(self, as_selector(other))

    def __rand__(self, other: Any) -> Selector:
        return And(as_selector(other), self)

    def __ror__(self, other: Any) -> Selector:
        return Or(as_selector(other), self)

    def __str__(self) -> str:
        return self.describe()


class ModuleOutput(Selector):
    """A module's output (every pass, or one pass with ``path:N``).

    ``path`` may be a canonical adapter name (``blocks.3.resid_mid``): it is resolved once, at
    the edge (``trace.bind``, the capture request), which binds ``_target`` to what the name
    means in that model; the canonical name stays, so recipes stay portable across families.
    """

    def __init__(self, path: str) -> None:
        if not isinstance(path, str):
            raise InvalidArgumentError(f"tl.module() takes a module path string, got {type(path).__name__}")
        self.path = path
        self._target: Selector | None = None  # what a canonical name means for one model

    def bind(self, names: Names, *, strings_as_modules: bool) -> Selector:
        if self._target is not None:
            return self
        target = names.canonical(self.path)
        return self if target is None else ModuleOutput.standing_for(self.path, target)

    @classmethod
    def standing_for(cls, path: str, target: Selector) -> ModuleOutput:
        """The canonical name ``path`` bound to what it selects in one model; the name stays, so
        recipes stay portable across families."""
        bound = cls(path)
        bound._target = target
        return bound

    def module_paths(self) -> list[str] | None:
        if self._target is not None:
            return self._target.module_paths()
        return [self.path]

    def matches_op(self, op: Op) -> bool:
        return self._target.matches_op(op) if self._target is not None else False

    def capture_refusal(self) -> str | None:
        return self._target.capture_refusal() if self._target is not None else None

    def match(self, trace: Trace) -> list[Record]:
        if self._target is not None:
            return self._target.match(trace)
        address, pass_index = split_pass(self.path)
        calls = trace.calls_of(address)
        if not calls:
            pool = trace.module_addresses
            raise SiteNotFoundError(
                f"no module {address!r} ran in this trace; nearest: {nearest(address, pool)}",
                site=self.path,
                candidates=nearest(address, pool),
            )
        if pass_index is None:
            return calls
        if not 1 <= pass_index <= len(calls):
            raise SiteNotFoundError(
                f"module {address!r} ran {len(calls)} time(s); there is no pass {pass_index}",
                site=self.path,
                remedy=f"Use a pass between 1 and {len(calls)}.",
            )
        return [calls[pass_index - 1]]

    def describe(self) -> str:
        return f"module({self.path!r})"

    __repr__ = describe


class InModule(Selector):
    """Every op executed inside a module (its submodules included), a dispatcher's device moves
    (``DISPATCH``, accelerate's hooks around the module) excepted: they are not the module's ops."""

    def __init__(self, path: str) -> None:
        if not isinstance(path, str):
            raise InvalidArgumentError(f"tl.in_module() takes a module path string, got {type(path).__name__}")
        self.path = path
        self._address, self._pass = split_pass(path)

    def bind(self, names: Names, *, strings_as_modules: bool) -> Selector:
        target = names.canonical(self.path)
        if target is None:
            return self
        paths = target.module_paths()
        if not paths or len(paths) != 1:
            raise SiteNotFoundError(
                f"tl.in_module({self.path!r}) needs a module, but this canonical name is an op "
                f"({target.describe()})",
                site=self.path,
                remedy=f"Use tl.module({self.path!r}) for the op itself.",
            )
        bound = InModule(self.path)
        bound._address, bound._pass = split_pass(paths[0])
        return bound

    def _inside(self, module: str) -> bool:
        a = self._address
        return a == "" or module == a or module.startswith(a + ".")

    def matches_op(self, op: Op) -> bool:
        if op.flags & DISPATCH or not self._inside(op.module):
            return False
        if self._pass is None:
            return True
        if op.module == self._address:
            return op.module_pass == self._pass
        # An op of a submodule: inside the wanted pass when it ran during that call.
        calls = op.trace.calls_of(self._address)
        if len(calls) < self._pass:
            return False
        call = calls[self._pass - 1]
        return call.op_start <= op.index < call.op_end

    def match(self, trace: Trace) -> list[Record]:
        address, pass_index = self._address, self._pass
        calls = trace.calls_of(address) if address else None
        if address and not calls:
            raise SiteNotFoundError(
                f"no module {address!r} ran in this trace; nearest: {nearest(address, trace.module_addresses)}",
                site=self.path,
            )
        if address == "":
            return [op for op in trace.ops if not op.is_input and not op.flags & DISPATCH]
        chosen = calls if pass_index is None else calls[pass_index - 1 : pass_index]
        out: list[Record] = []
        for call in chosen:
            out.extend(op for op in trace.ops[call.op_start : call.op_end] if not op.flags & DISPATCH)
        return out

    def describe(self) -> str:
        return f"in_module({self.path!r})"

    __repr__ = describe


# Ops an eager attention runs that a fused SDPA kernel keeps inside itself.
_INSIDE_FUSED_ATTENTION = frozenset({"softmax", "matmul", "bmm", "baddbmm", "masked_fill"})


class Func(Selector):
    """Ops by function name (``'softmax'`` matches ``F.softmax`` and ``Tensor.softmax``)."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            raise InvalidArgumentError(f"tl.func() takes a function name string, got {type(name).__name__}")
        self.name = name.strip("_") if name.startswith("__") else name

    def matches_op(self, op: Op) -> bool:
        # A dispatcher's device moves (accelerate's ``.to``) are not the model's ops.
        return op.func_name == self.name and not op.flags & DISPATCH

    def match(self, trace: Trace) -> list[Record]:
        found = [op for op in trace.ops if op.func_name == self.name and not op.flags & DISPATCH]
        if not found:
            names = {op.func_name for op in trace.ops if not op.flags & DISPATCH}
            if self.name in _INSIDE_FUSED_ATTENTION and "scaled_dot_product_attention" in names:
                raise FusedKernelError(
                    f"no {self.name!r} op ran: this model computes attention with one fused "
                    "scaled_dot_product_attention op, whose scores and softmax never exist as tensors",
                    site=self.name,
                    remedy="Read them as facets (site.facets.pattern), patch heads with "
                    "torchlens.mechinterp.patch_head, or re-capture with attn_implementation='eager'.",
                )
            raise SiteNotFoundError(
                f"no op calls {self.name!r} in this trace; nearest: {nearest(self.name, names)}",
                site=self.name,
                candidates=nearest(self.name, names),
            )
        return found

    def describe(self) -> str:
        return f"func({self.name!r})"

    __repr__ = describe


class Label(Selector):
    """One op label (``'linear_3'``) or module address (``'transformer.h.0'``, ``'x.y:2'``)."""

    def __init__(self, label: str) -> None:
        self.label = label

    def bind(self, names: Names, *, strings_as_modules: bool) -> Selector:
        sub = names.sub_site(self.label)
        if sub is not None:
            return Label(sub)
        if names.is_module(self.label):
            return ModuleOutput(self.label) if strings_as_modules else self
        target = names.canonical(self.label)
        if target is not None:
            return ModuleOutput.standing_for(self.label, target)
        if not strings_as_modules or OP_LABEL.match(self.label):
            return self  # a label stays a label; an op label is known once the op runs
        raise names.not_found(self.label)

    def matches_op(self, op: Op) -> bool:
        return op.label == self.label

    def matches_call(self, call: ModuleCall) -> bool:
        return self.label in (call.address, call.key)

    def match(self, trace: Trace) -> list[Record]:
        return [trace.lookup(self.label)]

    def module_paths(self) -> list[str] | None:
        return None

    def describe(self) -> str:
        return repr(self.label)

    __repr__ = describe


class And(Selector):
    """What both selectors select (``a & b``)."""

    def __init__(self, a: Selector, b: Selector) -> None:
        self.a, self.b = a, b

    def bind(self, names: Names, *, strings_as_modules: bool) -> Selector:
        return And(self.a.bind(names, strings_as_modules=strings_as_modules),
                    self.b.bind(names, strings_as_modules=strings_as_modules))

    def matches_op(self, op: Op) -> bool:
        return self.a.matches_op(op) and self.b.matches_op(op)

    def matches_call(self, call: ModuleCall) -> bool:
        return self.a.matches_call(call) and self.b.matches_call(call)

    def match(self, trace: Trace) -> list[Record]:
        right = {id(r) for r in self.b.match(trace)}
        found = [r for r in self.a.match(trace) if id(r) in right]
        if not found:
            raise EmptySelectionError(f"{self.describe()} matches nothing in this trace", site=self.describe())
        return found

    def describe(self) -> str:
        return f"({self.a.describe()} & {self.b.describe()})"

    __repr__ = describe


class Or(Selector):
    """What either selector selects (``a | b``), in execution order, without duplicates."""

    def __init__(self, a: Selector, b: Selector) -> None:
        self.a, self.b = a, b

    def bind(self, names: Names, *, strings_as_modules: bool) -> Selector:
        return Or(self.a.bind(names, strings_as_modules=strings_as_modules),
                    self.b.bind(names, strings_as_modules=strings_as_modules))

    def module_paths(self) -> list[str] | None:
        left, right = self.a.module_paths(), self.b.module_paths()
        return None if left is None or right is None else left + right

    def matches_op(self, op: Op) -> bool:
        return self.a.matches_op(op) or self.b.matches_op(op)

    def matches_call(self, call: ModuleCall) -> bool:
        return self.a.matches_call(call) or self.b.matches_call(call)

    def match(self, trace: Trace) -> list[Record]:
        # A union fails only when both sides find nothing (then with the first side's error).
        parts: list[Record] = []
        first_error: SiteError | None = None
        for side in (self.a, self.b):
            try:
                parts.extend(side.match(trace))
            except SiteError as exc:
                first_error = first_error or exc
        if not parts and first_error is not None:
            raise first_error
        seen: dict[int, Record] = {}
        for r in parts:
            seen.setdefault(id(r), r)
        return list(seen.values())

    def describe(self) -> str:
        return f"({self.a.describe()} | {self.b.describe()})"

    __repr__ = describe


def as_selector(value: Any) -> Selector:
    """Coerce what users pass as a site (selector, label string, list of them)."""
    if isinstance(value, Selector):
        return value
    if isinstance(value, str):
        return Label(value)
    if isinstance(value, (list, tuple)) and value:
        sel = as_selector(value[0])
        for item in value[1:]:
            sel = sel | as_selector(item)
        return sel
    raise InvalidArgumentError(
        f"a site must be a selector (tl.module/in_module/func), a label string or a list of them; "
        f"got {type(value).__name__}",
        site=repr(value),
    )


SITES_REMEDY = "e.g. sites=['transformer.h.3'] or sites={'resid3': 'transformer.h.3'}."


def as_sites(sites: Any) -> list[tuple[str, Any]]:
    """What users pass as ``sites=`` (one site, a list of sites, or a dict ``{name: site}``) as
    ``(name, site)`` pairs, in order: a dict's keys name its sites, any other site is named by
    its own text (the label or address string, a selector's ``str``). The one reading of
    ``sites=`` for ``extract``, ``cache_activations`` and the dataset runs.

    Raises:
        InvalidArgumentError: no site, a dict key that is not a non-empty string, or another type.
    """
    if isinstance(sites, dict):
        if not all(isinstance(k, str) and k for k in sites):
            raise InvalidArgumentError("site names (the keys of sites=) must be non-empty strings", remedy=SITES_REMEDY)
        pairs = list(sites.items())
    elif isinstance(sites, (list, tuple)):
        pairs = [(s if isinstance(s, str) else str(s), s) for s in sites]
    elif isinstance(sites, Selector) or isinstance(sites, str) and sites:
        pairs = [(sites if isinstance(sites, str) else str(sites), sites)]
    else:
        raise InvalidArgumentError(f"sites takes a site, a list of sites or a dict {{name: site}}, got "
                                   f"{type(sites).__name__} {sites!r:.60}", remedy=SITES_REMEDY)
    if not pairs:
        raise InvalidArgumentError("sites= names no site; at least one is needed", remedy=SITES_REMEDY)
    return pairs


def module(path: str) -> ModuleOutput:
    """Select a module's output by address (``'transformer.h.0'``, ``'blocks.3.mlp'``, ``'x:2'``)."""
    return ModuleOutput(path)


def in_module(path: str) -> InModule:
    """Select every op executed inside a module."""
    return InModule(path)


def func(name: str) -> Func:
    """Select ops by the name of the function or tensor method that produced them."""
    return Func(name)
