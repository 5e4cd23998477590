"""Every hook a TorchLens plugin can implement — the one page a plugin author reads.

Plugins are discovered through the ``torchlens`` entry-point group (built-in engines,
helpers and adapters register exactly like third-party packages). An entry point names
an object (module, class or instance) carrying ``@hookimpl``-decorated functions; a
running session can also add one with ``torchlens.plugins.register(obj, name=...)``.
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


# -- capture engines ----------------------------------------------------------------------


@hookspec
def torchlens_engines() -> list[Any]:
    """Called once when the plugin manager starts; return capture engine objects.

    Each engine has ``name`` (str), ``cost(request) -> float | None`` (None: cannot serve
    this request; lower is cheaper; the built-ins cost 1 for module hooks, 10 for every op)
    and ``capture(request) -> Trace``. ``request`` is a ``torchlens.capture.request.
    CaptureRequest`` (model, args, kwargs, record_ops, sites, intervene, save, grad, until).
    Results from every plugin are collected; ``tl.trace(..., backend=name)`` picks one by
    name, otherwise the cheapest engine that can serve the request runs. When two plugins
    register one name the first registered keeps it and the other is reported as broken.
    An engine may delegate to another: ``torchlens.plugins.engines()["function_mode"]``.
    """


# -- architecture adapters ----------------------------------------------------------------


@hookspec
def torchlens_adapters() -> list[Any]:
    """Called once when the plugin manager starts; return adapter objects.

    An adapter has ``name`` (str), ``model_types`` (a tuple of ``config.model_type`` strings
    it serves) and ``view(model) -> ArchView`` (build one with ``torchlens.arch.Layout``);
    ``fallback = True`` marks an adapter tried for models no other adapter claims (the
    built-in generic one). Results from every plugin are collected; the first adapter whose
    ``model_types`` contains the model's type is used, later-registered plugins first.
    ``view`` may raise ``UnsupportedModelError``; anything else it raises is reported as a
    broken plugin and surfaces from ``tl.arch`` as ``PluginError``.
    """


@hookspec(firstresult=True)
def torchlens_choose_adapter(model: Any) -> Any | None:
    """Called by ``tl.arch(model)`` and canonical-name resolution before the
    ``model_types`` lookup; the first non-None result wins. Return an adapter for models
    that have no ``config.model_type``, or to override the adapter chosen by type."""


# -- edit helpers --------------------------------------------------------------------------


@hookspec
def torchlens_helpers() -> list[type]:
    """Called once when the plugin manager starts; return named edit helper classes.

    Each class has a unique ``name`` (str), parameters given as constructor keywords,
    ``params() -> dict`` and ``__call__(activation, *, ctx)``. Results are collected; the
    names are how saved recipes refer to helpers. A duplicate name keeps the first
    registered class and reports the other plugin as broken.
    """


# -- facets ------------------------------------------------------------------------------------


@hookspec
def torchlens_facets(site: Any) -> Any | None:
    """Called when ``site.facets`` is read; return a read-only facet object for sites you
    understand (e.g. attention ops), else None. The first non-None result is used, in
    pluggy's call order (last registered first; ``@hookimpl(tryfirst=True)`` goes first)."""
