"""The methods of ``Trace`` (and ``Site``) that are carried out above the core.

Running the model again is the core's to ask for: :class:`TraceActions` calls the installed
services (``core.services``: replay and re-execution, the one thing the core cannot import).
Everything else a trace offers above the core is a method its owning package adds when it is
imported, with :func:`provide_methods`: a mixin class of typed methods, written next to their
implementation, whose methods become the target class's.

- ``Trace.validate``: ``torchlens.edit.validate`` (``ValidateMethod``)
- ``Trace.save``: ``torchlens.store.traces`` (``SaveMethod``)
- ``Trace.save_intervention``: ``torchlens.store.recipes`` (``SaveInterventionMethod``)
- ``Trace.table``: ``torchlens.analysis.display`` (``TableMethod``)
- ``Trace.to_dot``, ``Trace.draw``: ``torchlens.analysis.draw`` (``DrawMethods``)
- ``Trace.summary``, ``Trace.to_pandas``: ``torchlens.analysis.summary`` (``SummaryMethods``)
- ``Site.facets``: ``torchlens.analysis.facets`` (``FacetsProperty``)

``import torchlens`` imports every provider (``torchlens/__init__.py``), so the methods are there
whenever a trace is. Type checkers do not run ``provide_methods``: each provided method is also
declared, signature only, under ``if TYPE_CHECKING:`` in its target's body (``TraceActions`` below for
``Trace``, ``Site`` for ``facets``); tests/test_architecture.py checks the declarations match the owners.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..errors import TorchLensError
from .inputs import call_inputs, split_inputs
from .repr_html import repr_html
from .selectors import as_selector
from .services import services

if TYPE_CHECKING:
    import os
    from pathlib import Path

    from .trace import Trace

__all__ = ["TraceActions", "provide_methods", "provided_methods"]

M = TypeVar("M", bound=type)

# (class, method name) -> the mixin that provided it ("module.Class")
_PROVIDED: dict[tuple[type, str], str] = {}


def provide_methods(target: type) -> Callable[[M], M]:
    """Class decorator: add the decorated mixin's methods (and properties) to ``target``.

    Used by a package above the core to give a core class (``Trace``, ``Site``) the methods it
    implements; the mixin is returned unchanged.

    Args:
        target: the core class that gains the methods (its subclasses inherit them).

    Returns:
        the decorator.

    Raises:
        TorchLensError: a method of that name is already defined on ``target`` or provided by
            another mixin (each method has one owner).
    """
    def add(mixin: M) -> M:
        owner = f"{mixin.__module__}.{mixin.__qualname__}"
        for name, member in vars(mixin).items():
            if name.startswith("__") and name.endswith("__"):
                continue
            before = _PROVIDED.get((target, name))
            # defined by the class itself or a torchlens base: not what ``object`` carries (nnsight,
            # imported first, gives every object a ``save``; the provided method wins on Trace)
            defined = any(name in vars(klass) for klass in target.__mro__ if klass is not object)
            if (before is None and defined) or (before is not None and before != owner):
                raise TorchLensError(f"{target.__name__}.{name} already exists ({before or 'defined by the class'}); "
                                     f"{owner} cannot provide it too",
                                     remedy="Give the method one owner: rename it or drop one definition.")
            setattr(target, name, member)
            _PROVIDED[(target, name)] = owner
        return mixin

    return add


def provided_methods() -> dict[tuple[type, str], str]:
    """``{(class, method name): "module.Mixin"}``: every method a package above the core provided."""
    return dict(_PROVIDED)


class TraceActions:
    """Methods of ``Trace`` that run the model again (through the installed services)."""

    if TYPE_CHECKING:
        # Provided above the core on import (provide_methods; the owners are listed at the top of this
        # module), declared here for type checkers only: never defined at run time. The same signatures
        # as the owners'; a return type owned above the core is Any, since the core names nothing above
        # it, not even for type checkers (tests/test_architecture.py checks both).
        def validate(self, *, atol: float = 1e-5, rerun: bool = True, progress: bool | None = None) -> Any: ...

        def save(self, path: Any, *, selector: Any = None, overwrite: bool = False) -> Path: ...

        def save_intervention(self, path: Any, level: str = "portable", *, overwrite: bool = False) -> Path: ...

        def table(self, selector: Any = None, limit: int | None = None) -> str: ...

        def to_dot(self, *, depth: int | str | None = "auto", focus: Any = None, rolled: bool = False,
                   highlight: Any = None) -> str: ...

        def draw(self, path: str | os.PathLike | None = None, *, fmt: str | None = None,
                 depth: int | str | None = "auto", focus: Any = None, rolled: bool = False,
                 highlight: Any = None) -> Any: ...

        def summary(self) -> Any: ...

        def to_pandas(self) -> Any: ...

    def run(self, model: torch.nn.Module | None = None, *args: Any, **kwargs: Any) -> Trace:
        """Run the model again with this trace's steps as capture-time edits; a new trace."""
        model = model if model is not None else self.model
        if args or kwargs:  # text is tokenized with this trace's tokenizer (else the model's)
            args, kwargs = call_inputs(args, kwargs, model=model, tokenizer=self.tokenizer)
        else:
            args, kwargs = self.args, self.kwargs
        steps = [s.for_capture() for s in self.all_steps()]
        return services().rerun(self, model, args, kwargs, steps, None)

    def run_transaction(self, *, inputs: Any = None, until: Any, model=None) -> Trace:
        """Run the forward again and stop right after ``until``; return the partial trace.

        ``inputs`` follows the one input convention (a tensor, a tuple of positional
        inputs, a dict of keyword inputs); default: this trace's own inputs.
        """
        model = model if model is not None else self.model
        args, kwargs = (self.args, self.kwargs) if inputs is None else \
            split_inputs(inputs, model=model, tokenizer=self.tokenizer)
        return services().rerun(self, model, args, kwargs, [s.for_capture() for s in self.steps],
                                as_selector(until))

    def _repr_html_(self) -> str:
        return repr_html(self)
