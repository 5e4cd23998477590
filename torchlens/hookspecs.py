"""Every hook a TorchLens plugin can implement — the one page a plugin author reads.

Plugins are discovered through the ``torchlens`` entry-point group (built-in engines,
helpers and adapters register exactly like third-party packages). An entry point names
an object (module, class or instance) carrying ``@hookimpl``-decorated functions.
Hook names all start with ``torchlens_``. Set ``TORCHLENS_TRACE_HOOKS=1`` to print every
hook call.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("torchlens")
hookimpl = pluggy.HookimplMarker("torchlens")


# -- capture engines ----------------------------------------------------------------------


@hookspec
def torchlens_engines() -> list[Any]:
    """Called once when the plugin manager starts; return capture engine objects.

    Each engine has ``name`` (str), ``cost(request) -> float | None`` (None: cannot serve
    this request; lower is cheaper) and ``capture(request) -> Trace``. Results from every
    plugin are collected; ``tl.trace(..., backend=name)`` picks one by name, otherwise the
    cheapest engine that can serve the request runs. Two engines with one name: PluginError.
    """


# -- architecture adapters ----------------------------------------------------------------


@hookspec
def torchlens_adapters() -> list[Any]:
    """Called once when the plugin manager starts; return adapter objects.

    An adapter has ``model_types`` (a tuple of ``config.model_type`` strings it serves) and
    ``view(model) -> ArchView`` (see ``torchlens.arch``). Results from every plugin are
    collected; the first adapter whose ``model_types`` contains the model's type is used.
    """


@hookspec(firstresult=True)
def torchlens_choose_adapter(model: Any) -> Any | None:
    """Called by ``tl.arch(model)`` before the ``model_types`` lookup; stops at the first
    non-None result. Return an adapter for models that have no ``config.model_type``."""


# -- edit helpers --------------------------------------------------------------------------


@hookspec
def torchlens_helpers() -> list[type]:
    """Called once when the plugin manager starts; return named edit helper classes.

    Each class has a unique ``name`` (str), parameters given as constructor keywords,
    ``params() -> dict`` and ``__call__(activation, *, ctx)``. Results are collected; the
    names are how saved recipes refer to helpers. A duplicate name: PluginError.
    """


# -- facets ------------------------------------------------------------------------------------


@hookspec
def torchlens_facets(site: Any) -> Any | None:
    """Called when ``site.facets`` is read; return a read-only facet object for sites you
    understand (e.g. attention ops), else None. The first non-None result is used, in
    plugin registration order (last registered first, as pluggy calls them)."""
