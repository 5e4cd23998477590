"""``envoy.source.<op>_<n>``: the operations inside one module's ``forward``, and inside what it calls.

A module's own ``.input``/``.output`` are the only values its hooks see. To reach
what happens *between* them, the module's ``forward`` is recompiled from its
source with every call and every single-name assignment routed through an op
callback (see `_source_compile`), labelled as nnsight 0.8 labels them
(``self_c_attn_0``, ``attention_interface_0``, ``torch_relu_0``).

During a run a sourced module's gate runs the recompiled forward; each operation
reports ``{path}.source.{label}.input``, ``.skip`` and ``.output`` to the run,
which serves and edits them like a module's. Outside a run the recompiled
forward is never called.

Drilling (``op.source``) goes one level deeper, to any depth: the function an
operation calls is often a local variable (an attention implementation picked at
run time), so it is resolved from the live call. The block asks the run for
``{op path}.fn``, which the operation offers just before it calls; the block
instruments the callable it is handed (``Run.drilled`` keeps the copy for the
rest of the run) and the operation calls that copy instead, whose operations
report under ``{op path}.source.{label}``.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

from torch import nn

from torchlens.core.names import nearest

from . import _worker
from ._served import Served, first_input_repack, first_input_view
from ._source_compile import Compiled, compile_function, instrument
from ._unsupported import STATE, Controller
from .errors import SourceNotAvailableError
from .interleaver import NO_SKIP

if TYPE_CHECKING:
    from .envoy import Envoy
    from .interleaver import Tree

__all__ = [
    "STATE",
    "Compiled",
    "Controller",
    "Source",
    "SourceNotAvailable",
    "SourceOp",
    "compile_forward",
    "install",
    "instrument",
    "make_op",
]

SourceNotAvailable = SourceNotAvailableError  # nnsight's name for it
compile_forward = compile_function  # the name this module exported before drilling existed


def make_op(tree: Tree, prefix: str) -> Any:
    """The ``__tl_op__`` of one instrumented function whose operations live under ``{prefix}.source``.

    Args:
        tree: the wrapped model's shared state (its run in progress).
        prefix: the path of the sourced module, or of the operation drilled into.

    Returns:
        ``op(label, fn, *args, **kwargs)``: calls straight through outside a run; inside
        one it reports the operation's input, skip and output, and offers ``fn`` to a
        block drilling into it.
    """
    prefix = f"{prefix}.source."
    get_ident = threading.get_ident
    # The tree keeps the sourced forward, whose globals hold this op: a strong link back
    # would be a cycle keeping the model alive until a GC pass (the gates link weakly too).
    tree_ref = weakref.ref(tree)
    locations: dict[str, tuple[str, str, str, str, str]] = {}

    def op(label: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        tree = tree_ref()
        run = None if tree is None else tree.run
        if run is None or run.owner != get_ident():
            return fn(*args, **kwargs)
        where = locations.get(label)
        if where is None:
            base = prefix + label
            where = locations[label] = (
                f"{base}.input", f"{base}.skip", f"{base}.output", f"{base}.fn", base
            )
        args, kwargs = run.handle(where[0], (args, kwargs))
        value = run.handle(where[1], NO_SKIP)
        if value is NO_SKIP:
            # Every call is counted at `.fn`, so a drill first asked for at a later
            # generation step waits for that step's call, not the next one.
            run.handle(where[3], fn)
            drilled = run.drilled
            if drilled:  # a block drilled into some call: is it this one?
                entry = drilled.get(where[4])
                if entry is not None:
                    fn = entry[0]
            value = fn(*args, **kwargs)
        return run.handle(where[2], value)

    return op


class SourceOp:
    """One operation of a sourced function: ``.output``, ``.input``, ``.inputs``, ``.skip(v)``, ``.source``."""

    output = Served("output")
    inputs = Served("input")
    input = Served("input", view=first_input_view, repack=first_input_repack)

    def __init__(self, envoy: Envoy, label: str, compiled: Compiled, prefix: str | None = None) -> None:
        self.envoy = envoy
        self.name = label
        self.label = label
        self.path = f"{envoy.path if prefix is None else prefix}.source.{label}"
        self._compiled = compiled

    def skip(self, replacement: Any) -> None:
        """Do not run this operation; ``replacement`` becomes its output.

        Args:
            replacement: the value the forward goes on with.
        """
        _worker.skip(f"{self.path}.skip", replacement)

    @property
    def source(self) -> Source:
        """The operations inside the function this operation calls, to any depth.

        Only inside a trace: the called function is the live one (often a local
        variable), so the block waits until this operation is about to call it.

        Returns:
            A `Source` over the called function, under ``{self.path}.source``.

        Raises:
            SourceNotAvailableError: this operation is an assignment, the call is outside a
                trace, it calls a submodule (use that submodule's own ``.source``), or the
                callee has no Python source (a builtin or C function).
        """
        if self.label in self._compiled.assignments:
            raise SourceNotAvailableError(
                f"{self.path} is an assignment, not a call: there is no function to drill into",
                remedy="Read or replace its .output (the assigned value); drill into the call on its right-hand side.",
            )
        if not _worker.in_worker():
            raise SourceNotAvailableError(
                f"{self.path}.source: drilling into a called function is only available inside a trace "
                "(the function is the one the live call makes)",
                remedy="Ask for it inside `with model.trace(...):`; print(envoy.source) lists the top level anywhere.",
            )
        run = _worker.current(self.path).run
        drilled = run.drilled
        entry = drilled.get(self.path)
        if entry is None:
            # Wait for the call itself: the operation offers its callable at `.fn`. A second
            # block drilling the same call is served at the same visit and reuses this copy.
            fn = _worker.read(f"{self.path}.fn")
            if isinstance(fn, nn.Module):
                raise SourceNotAvailableError(
                    f"{self.path} calls a submodule ({type(fn).__name__}), not a function",
                    remedy="Use that submodule's own envoy: model.<path to it>.source.",
                )
            entry = drilled.get(self.path)
            if entry is None:
                entry = drilled[self.path] = instrument(fn, make_op(self.envoy._tree, self.path))
        return Source(self.envoy, self.path, entry[1])

    def __repr__(self) -> str:
        lines = self._compiled.text.split("\n")
        at = self._compiled.lines[self.label] - 1
        window = range(max(0, at - 3), min(len(lines), at + 4))
        body = [f"--> {lines[i]} <--" if i == at else f"    {lines[i]}" for i in window]
        return f"{self.path}:\n" + "\n".join(body)


class Source:
    """The labelled operations of one function: a module's ``forward`` or a drilled-into callable."""

    def __init__(self, envoy: Envoy, prefix: str | None = None, compiled: Compiled | None = None) -> None:
        object.__setattr__(self, "_envoy", envoy)
        object.__setattr__(self, "_prefix", envoy.path if prefix is None else prefix)
        object.__setattr__(self, "_compiled", install(envoy) if compiled is None else compiled)

    def __getattr__(self, name: str) -> SourceOp:
        compiled = self._compiled
        if name.startswith("__") or name not in compiled.lines:
            raise SourceNotAvailableError(
                f"{self._prefix}.source has no operation {name!r}; nearest: "
                f"{', '.join(nearest(name, compiled.labels, n=3)) or '(none)'}; "
                f"available: {', '.join(compiled.labels) or '(none)'}"
            )
        return SourceOp(self._envoy, name, compiled, self._prefix)

    @property
    def compiled(self) -> Compiled:
        """The recompiled function (``.names`` lists its operations, as nnsight's does)."""
        return self._compiled

    @property
    def names(self) -> list[str]:
        """The operation labels, in the order the function reaches them."""
        return list(self._compiled.labels)

    def __dir__(self) -> list[str]:
        return list(self._compiled.labels)

    def __iter__(self):
        """The operations (`SourceOp`), in execution order."""
        return (SourceOp(self._envoy, label, self._compiled, self._prefix) for label in self._compiled.labels)

    def __repr__(self) -> str:
        compiled = self._compiled
        lines = compiled.text.split("\n")
        by_line: dict[int, list[str]] = {}
        for label in compiled.labels:
            by_line.setdefault(compiled.lines[label] - 1, []).append(label)
        width = max((len(label) for label in compiled.labels), default=0)
        out = []
        # nnsight's layout: the def line marked '*', an op's line '->', more ops on it '+'
        for index, line in enumerate(lines):
            labels = by_line.get(index, [])
            if labels:
                out.append(f"{labels[0]:>{width}} -> {line}")
                out.extend(f"{label:>{width}}  + " for label in labels[1:])
            elif line.lstrip().startswith(("def ", "async def ")):
                out.append(f"{'':>{width}}  * {line.lstrip()}")
            else:
                out.append(f"{'':>{width}}    {line}")
        return "\n".join(out).rstrip()


def install(envoy: Envoy) -> Compiled:
    """Source-instrument ``envoy``'s module for every later run (and the current one).

    Args:
        envoy: the module's envoy.

    Returns:
        The recompiled ``forward``.

    Raises:
        SourceNotAvailableError: the forward has no readable Python source.
    """
    tree = envoy._tree
    module = envoy._module
    entry = tree.sourced.get(id(module))
    if entry is None:
        try:
            forward, compiled = instrument(type(module).forward, make_op(tree, envoy.path))
        except SyntaxError as error:
            raise SourceNotAvailableError(f"could not recompile {type(module).__name__}.forward") from error
        entry = tree.sourced[id(module)] = (forward.__get__(module), compiled)
        tree.source_installed(module)
    return entry[1]
