"""The notebook HTML (``_repr_html_``) of every TorchLens object, behind one lookup by type.

The objects that show themselves in a notebook live in several packages (``core/``'s ops,
module calls and traces, ``edit/``'s validation report, ``store/``'s recipe); the HTML for all
of them is written in one place, :mod:`torchlens.analysis.notebook`, which registers a renderer
per type when it is imported (``import torchlens`` imports it). The objects' ``_repr_html_``
asks :func:`repr_html`, so no package below ``analysis/`` imports the notebook code.
"""

from __future__ import annotations

from functools import singledispatch

from ..errors import TorchLensError

__all__ = ["repr_html"]


@singledispatch
def repr_html(obj: object) -> str:
    """The notebook HTML of ``obj``: the renderer registered for its type (or nearest base class).

    Renderers are registered with ``repr_html.register(SomeType, render)``.

    Raises:
        TorchLensError: no renderer is registered for ``type(obj)``.
    """
    raise TorchLensError(f"no notebook display is registered for {type(obj).__name__}",
                         remedy="import torchlens (torchlens.analysis.notebook registers the displays)")
