"""The actions of a trace that are carried out above the core, through its services.

Running the model again, validating, saving, tables, pictures and notebook displays are
implemented in ``edit/``, ``store/`` and ``analysis/``; ``Trace`` inherits these thin methods,
which reach them through :func:`torchlens.core.services.services`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .inputs import call_inputs, split_inputs
from .repr_html import repr_html
from .selectors import as_selector
from .services import services

if TYPE_CHECKING:
    from .trace import Trace

__all__ = ["TraceActions"]


class TraceActions:
    """Methods of ``Trace`` that delegate to the installed services."""

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
        return repr_html(self)
