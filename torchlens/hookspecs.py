"""Every hook a TorchLens plugin can implement — the one page a plugin author reads.

Third-party plugins are discovered through the ``torchlens`` entry-point group; the built-in
engines, helpers, facets and adapters are plugins too, registered in code first
(``torchlens.plugins.BUILTIN_PLUGINS``). An entry point names an object (module, class or
instance) carrying ``@hookimpl``-decorated functions; a running session can also add one with
``torchlens.plugins.register(obj, name=...)``.

Dispatch order, the same for every hook: the most recently registered plugin is asked
first (run-time registrations, then entry points, then built-ins). Where a hook hands out
named things (engines, helpers), a name belongs to the plugin that registered it first; a
later plugin offering the same name is reported as broken and that item skipped.
Hook names all start with ``torchlens_``; implementing a name that is not below is
reported as a broken plugin. A plugin that fails to import or whose hook raises is
reported by name (a warning, and ``tl.plugins()``) and skipped; TorchLens keeps working.
Set ``TORCHLENS_TRACE_HOOKS=1`` to print every hook call.
"""

from __future__ import annotations

from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("torchlens")
hookimpl = pluggy.HookimplMarker("torchlens")

__all__ = [
    "hookimpl", "hookspec", "torchlens_adapters", "torchlens_choose_adapter", "torchlens_engines", "torchlens_facets",
    "torchlens_helpers",
]


# -- capture engines ----------------------------------------------------------------------


@hookspec
def torchlens_engines() -> list[Any]:
    """Called once when the plugin manager starts; return capture engine objects.

    Each engine has ``name`` (str), ``cost(request) -> float | None`` (None: cannot serve
    this request; lower is cheaper; the built-ins cost 1 for module hooks, 10 for every op)
    and ``capture(request) -> Trace``. ``request`` is a ``torchlens.capture.request.
    CaptureRequest`` (model, args, kwargs, record_ops, sites, intervene, save, grad, until).
    Dispatch: results from every plugin are collected, most recently registered first;
    ``tl.trace(..., backend=name)`` picks one by name, otherwise the cheapest engine that can
    serve the request runs (equal costs: the one asked first). A name belongs to the first
    plugin that registered it; a later one offering it is reported as broken.
    An engine that records no op graph declares ``records_ops = False`` (``tl.trace(...,
    backend=name)`` then asks it for module outputs only) and builds its trace with
    ``tl.TraceBuilder(..., op_graph=False)`` (``builder.finish(output, steps=...)`` hands the
    trace back); replay and validate then refuse that trace with a remedy.
    An engine may delegate to another: ``torchlens.plugins.engines()["function_mode"]``.
    """


# -- architecture adapters ----------------------------------------------------------------


@hookspec
def torchlens_adapters() -> list[Any]:
    """Called once when the plugin manager starts; return adapter objects.

    An adapter has ``name`` (str), ``model_types`` (a tuple of ``config.model_type`` strings
    it serves) and ``view(model) -> ArchView`` (build one with ``torchlens.arch.Layout``);
    ``fallback = True`` marks an adapter tried for models no other adapter claims (the
    built-in generic one). Dispatch: results from every plugin are collected, most recently
    registered first; the first adapter whose ``model_types`` contains the model's type is used.
    ``view`` may raise ``UnsupportedModelError``; anything else it raises is reported as a
    broken plugin and surfaces from ``tl.arch`` as ``PluginError``.
    """


@hookspec(firstresult=True)
def torchlens_choose_adapter(model: Any) -> Any | None:
    """Called by ``tl.arch(model)`` and canonical-name resolution before the
    ``model_types`` lookup. Dispatch: most recently registered first; the first non-None
    result wins. Return an adapter for models
    that have no ``config.model_type``, or to override the adapter chosen by type."""


# -- edit helpers --------------------------------------------------------------------------


@hookspec
def torchlens_helpers() -> list[type]:
    """Called once when the plugin manager starts; return named edit helper classes.

    Each class has a unique ``name`` (str), parameters given as constructor keywords,
    ``params() -> dict`` and ``__call__(activation, *, ctx)``. Dispatch: results are collected,
    most recently registered first; the names are how saved recipes refer to helpers. A name
    belongs to the first plugin that registered it; a later one offering it is reported as
    broken. ``tl.register_helper(cls)`` registers one through this hook at run time.
    """


# -- facets ------------------------------------------------------------------------------------


@hookspec
def torchlens_facets(site: Any) -> Any | None:
    """Called when ``site.facets`` is read; return a read-only facet object for sites you
    understand (e.g. attention ops), else None. Dispatch: most recently registered first
    (``@hookimpl(tryfirst=True)`` goes before that order); the first non-None result is used."""
