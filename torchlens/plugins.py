"""The one plugin manager: created on first use, built-ins registered in code, then the
``torchlens`` entry points (third parties), then whatever is registered at run time.

Built-in engines, helpers, facets and adapters are plugins like a third party's (listed in
``BUILTIN_PLUGINS``; a source checkout works without installing), so nothing in the core
names them. A plugin that fails to import, implements a hook that does not exist, or whose
hook raises is reported (``tl.plugins()``, a warning naming it) and skipped, never fatal.

One dispatch order for every hook: the most recently registered plugin is asked first
(pluggy's order: run-time registrations, then entry points, then built-ins), so a later
plugin can specialise an earlier one. For hooks that hand out named things (engines,
helpers) a name belongs to the plugin that registered it first; a later plugin offering
the same name is reported and skipped, so a third party cannot silently replace a built-in.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .errors import InvalidArgumentError, PluginError, SiteNotFoundError, TorchLensError

__all__ = [
    "BUILTIN_PLUGINS", "PluginInfo", "adapter_for", "adapter_with_owner", "adapters", "builtin_engines_only",
    "choose_engine", "engines",
    "facets_for", "generation", "helpers", "is_registered", "plugins", "register", "reload", "report_failure",
    "unregister",
]

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_failures: dict[tuple[str, str], PluginInfo] = {}
_cache: dict[str, Any] = {}
_generation = 0  # bumped whenever the set of plugins changes (caches elsewhere compare it)
# The built-in plugins, registered in code before any entry point: (name, module, attribute).
BUILTIN_PLUGINS = (
    ("torchlens:engine_hooks", "torchlens.capture.engines", "HooksEnginePlugin"),
    ("torchlens:engine_function_mode", "torchlens.capture.engines", "FunctionModeEnginePlugin"),
    ("torchlens:helpers_builtin", "torchlens.edit.helpers", "BuiltinHelpersPlugin"),
    ("torchlens:facets_builtin", "torchlens.analysis.facets", "FacetPlugin"),
    ("torchlens:heads_builtin", "torchlens.analysis.heads", "HeadsPlugin"),
    ("torchlens:adapters_builtin", "torchlens_adapters", "plugin"),
)
_HOOK_KINDS = (("torchlens_engines", "engine"), ("torchlens_adapters", "adapter"),
               ("torchlens_choose_adapter", "adapter"), ("torchlens_helpers", "helpers"),
               ("torchlens_facets", "facet"))


@dataclass
class PluginInfo:
    """One registered plugin, as ``tl.plugins()`` lists it; ``error`` is set for a broken one."""

    name: str
    kind: str
    version: str
    origin: str
    error: str | None = None


def _fail(name: str, where: str, exc: BaseException | str, origin: str | None = None) -> None:
    """Record and warn about a broken plugin, once per (plugin, place)."""
    text = exc if isinstance(exc, str) else repr(exc)
    key = (name, where)
    if key in _failures:
        return
    dist = origin or name.split(":", 1)[0]
    _failures[key] = PluginInfo(name, "broken", _version(dist), dist, f"{where}: {text}")
    warnings.warn(f"TorchLens plugin {name} failed in {where}: {text} (skipped; TorchLens keeps working)",
                  stacklevel=3)


def _manager() -> pluggy.PluginManager:
    global _pm
    if _pm is not None:
        return _pm
    with _lock:
        if _pm is not None:
            return _pm
        pm = pluggy.PluginManager("torchlens")
        pm.add_hookspecs(hookspecs)
        for name, module_name, attribute in BUILTIN_PLUGINS:
            try:
                obj = getattr(importlib.import_module(module_name), attribute)
                pm.register(obj, name=name)
            except Exception as exc:  # noqa: BLE001 - a broken built-in is reported like any plugin
                _fail(name, "import", exc, "torchlens")
                continue
            _check_unknown_hooks(pm, obj, name)
        for ep in md.entry_points(group="torchlens"):
            dist = ep.dist.name if ep.dist else "?"
            name = f"{dist}:{ep.name}"
            try:
                obj = ep.load()
                if obj is None or pm.is_registered(obj):  # a placeholder, or a built-in listed again
                    continue
                pm.register(obj, name=name)
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break TorchLens
                _fail(name, "import", exc, dist)
                continue
            _check_unknown_hooks(pm, obj, name)
        _pm = pm
        return pm


def _call(hook_name: str, impl: Any, **kwargs: Any) -> Any:
    """Call one plugin's hook implementation; with TORCHLENS_TRACE_HOOKS set, print the call.

    TorchLens calls implementations one by one (not through ``pm.hook``) so that one
    raising plugin can be skipped without losing the others' results.
    """
    result = impl.function(**kwargs)
    if os.environ.get("TORCHLENS_TRACE_HOOKS"):
        shown = ", ".join(f"{k}={type(v).__name__}" for k, v in kwargs.items())
        sys.stderr.write(f"torchlens hook {hook_name}({shown}) [{impl.plugin_name}] -> {result!r}\n")
    return result


def _check_unknown_hooks(pm: pluggy.PluginManager, plugin: Any, name: str) -> None:
    """A misspelt hook would silently never be called; report it with the valid names."""
    for caller in pm.get_hookcallers(plugin) or ():
        if caller.spec is None and caller.name.startswith("torchlens_"):
            known = sorted(n for n in dir(hookspecs) if n.startswith("torchlens_"))
            _fail(name, "registration", f"implements unknown hook {caller.name!r}; hooks are {known}")


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except (md.PackageNotFoundError, ValueError):
        return "?"


def generation() -> int:
    """A number that changes whenever plugins are registered, removed or reloaded."""
    return _generation


def _changed() -> None:
    global _generation
    _cache.clear()
    _generation += 1


def report_failure(name: str, where: str, exc: BaseException | str) -> None:
    """Report a plugin that failed outside the manager (an adapter's ``view()`` ...)."""
    _fail(name, where, exc)


def reload() -> None:
    """Forget every plugin and rediscover the entry points (after installing a plugin package)."""
    global _pm
    with _lock:
        _pm = None
        _changed()
        _failures.clear()
        importlib.invalidate_caches()


def register(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object at run time (tests, notebooks); entry points need no call."""
    pm = _manager()
    pm.register(plugin, name=name)
    _check_unknown_hooks(pm, plugin, name or pm.get_name(plugin) or repr(plugin))
    _changed()


def is_registered(name: str) -> bool:
    """Whether a plugin of that name is registered."""
    return _manager().get_plugin(name) is not None


def unregister(plugin: Any = None, name: str | None = None) -> None:
    """Remove a plugin registered with ``register`` (or an entry point's, by name)."""
    pm = _manager()
    gone = name or (pm.get_name(plugin) if plugin is not None else None)
    pm.unregister(plugin=plugin, name=name)
    for key in [k for k in _failures if k[0] == gone]:
        del _failures[key]
    _changed()


def _collect(hook_name: str) -> list[tuple[str, Any]]:
    """Call a collecting hook plugin by plugin, in the dispatch order (most recent first),
    isolating failures by plugin name."""
    pm = _manager()
    found: list[tuple[str, Any]] = []
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        try:
            items = list(_call(hook_name, impl) or ())
        except Exception as exc:  # noqa: BLE001
            _fail(impl.plugin_name, hook_name, exc)
            continue
        found.extend((impl.plugin_name, item) for item in items)
    return found


def _named(hook_name: str, valid: Any, what: str) -> dict[str, tuple[str, Any]]:
    """Named items of a collecting hook: ``{name: (plugin, item)}`` in dispatch order; a name
    belongs to the plugin that registered first, a later one offering it is reported."""
    owners: dict[str, tuple[str, Any]] = {}
    for plugin_name, item in reversed(_collect(hook_name)):  # registration order decides ownership
        problem = valid(item)
        name = getattr(item, "name", None)
        if problem is not None:
            _fail(plugin_name, hook_name, f"{item!r} {problem}")
        elif name in owners and owners[name][1] is not item:
            _fail(plugin_name, hook_name, f"{what} named {name!r} is already registered")
        else:
            owners.setdefault(name, (plugin_name, item))
    return dict(reversed(owners.items()))


# -- engines -------------------------------------------------------------------------------


def _engine_problem(engine: Any) -> str | None:
    if not isinstance(getattr(engine, "name", None), str) or not callable(getattr(engine, "capture", None)) \
            or not callable(getattr(engine, "cost", None)):
        return "lacks name/cost()/capture()"
    return None


def engines() -> dict[str, Any]:
    """Every registered capture engine by name, in dispatch order (see the module docstring)."""
    cached = _cache.get("engines")
    if cached is None:
        named = _named("torchlens_engines", _engine_problem, "a capture engine")
        cached = {name: engine for name, (_, engine) in named.items()}
        _cache["engines"] = cached
        _cache["engine_owners"] = {name: owner for name, (owner, _) in named.items()}
    return cached


def builtin_engines_only() -> bool:
    """True when every registered capture engine is TorchLens's own, so the engine a request gets
    is known without asking each one's ``cost`` (``tl.extract``'s module reads go to the hooks
    engine's ``read`` then; a third party's engine may be cheaper and is asked)."""
    found = _cache.get("builtin_engines")
    if found is None:
        engines()
        builtin = {name for name, _, _ in BUILTIN_PLUGINS}
        found = _cache["builtin_engines"] = all(owner in builtin for owner in _cache["engine_owners"].values())
    return found


def choose_engine(request: Any, backend: str | None) -> Any:
    """The engine that runs a capture: ``backend`` by name, else the cheapest that can serve it.

    Raises:
        InvalidArgumentError: no engine has that name, or it cannot serve the request.
        PluginError: no registered engine can serve the request.
    """
    available = engines()
    if backend is not None:
        engine = available.get(backend)
        if engine is None:
            raise InvalidArgumentError(
                f"no capture engine named {backend!r}; registered: {sorted(available)}",
                remedy="Pick one of the registered engines (tl.plugins()), or install the plugin that provides it.",
            )
        if engine.cost(request) is None:
            raise InvalidArgumentError(
                f"engine {backend!r} cannot serve this request ({request.describe()})",
                remedy="Omit backend= to let TorchLens pick an engine that can.",
            )
        return engine
    best, best_cost = None, None
    for engine in available.values():
        try:
            cost = engine.cost(request)
        except Exception as exc:  # noqa: BLE001 - a broken engine is skipped, not fatal
            owner = _cache.get("engine_owners", {}).get(engine.name, engine.name)
            _fail(owner, f"engine {engine.name!r} cost()", exc)
            continue
        if cost is not None and (best_cost is None or cost < best_cost):
            best, best_cost = engine, cost
    if best is None:
        raise PluginError(f"no registered capture engine can serve {request.describe()}",
                          remedy="Check tl.plugins() for broken engine plugins.")
    return best


# -- helpers -------------------------------------------------------------------------------


def helpers() -> dict[str, type]:
    """Every edit helper class registered by plugins, by name (see the module docstring)."""
    cached = _cache.get("helpers")
    if cached is None:
        named = _named("torchlens_helpers", lambda cls: None, "an edit helper")
        cached = {name: cls for name, (_, cls) in named.items()}
        _cache["helpers"] = cached
    return cached


# -- adapters ------------------------------------------------------------------------------


def _adapters_with_owner() -> list[tuple[str, Any]]:
    cached = _cache.get("adapters")
    if cached is None:
        cached = _collect("torchlens_adapters")
        _cache["adapters"] = cached
    return cached


def adapters() -> list[Any]:
    """Every registered adapter, in lookup order (later-registered plugins first)."""
    return [adapter for _, adapter in _adapters_with_owner()]


def adapter_with_owner(model: Any) -> tuple[Any | None, str]:
    """The adapter serving ``model`` and the plugin that offered it (``(None, "")``: none)."""
    pm = _manager()
    for impl in reversed(pm.hook.torchlens_choose_adapter.get_hookimpls()):
        try:
            chosen = _call("torchlens_choose_adapter", impl, model=model)
        except Exception as exc:  # noqa: BLE001
            _fail(impl.plugin_name, "torchlens_choose_adapter", exc)
            continue
        if chosen is not None:
            return chosen, impl.plugin_name
    pairs = _adapters_with_owner()
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is not None:
        for owner, adapter in pairs:
            if model_type in getattr(adapter, "model_types", ()):
                return adapter, owner
    for owner, adapter in pairs:
        if getattr(adapter, "fallback", False):
            return adapter, owner
    return None, ""


def adapter_for(model: Any) -> Any | None:
    """The adapter serving ``model``: a plugin's explicit choice, else by ``config.model_type``,
    else a fallback adapter (the generic one, which looks for a repeated block list)."""
    return adapter_with_owner(model)[0]


# -- facets --------------------------------------------------------------------------------


def facets_for(site: Any) -> Any:
    """The first facet object a plugin offers for ``site`` (a raising plugin is skipped)."""
    for impl in reversed(_manager().hook.torchlens_facets.get_hookimpls()):
        try:
            result = _call("torchlens_facets", impl, site=site)
        except TorchLensError:
            raise  # a typed answer from the plugin (ambiguous site ...) is for the user
        except Exception as exc:  # noqa: BLE001
            _fail(impl.plugin_name, "torchlens_facets", exc)
            continue
        if result is not None:
            return result
    raise SiteNotFoundError(
        f"no facet plugin understands site {site.label!r} ({site.kind})",
        site=site.label,
        remedy="Facets exist for attention ops (scaled_dot_product_attention); install a facet plugin for others.",
    )


# -- listing -------------------------------------------------------------------------------


def plugins() -> list[PluginInfo]:
    """Every registered plugin (name, kind, version, origin package), broken ones included.

    A plugin whose hook raised is listed with ``error`` set; one that failed to import is
    listed with kind ``'broken'``.
    """
    pm = _manager()
    # collecting hooks run lazily; run them now so a raising hook shows up in the listing
    engines(), helpers(), adapters()
    dists = {}
    for ep in md.entry_points(group="torchlens"):
        if ep.dist:
            dists[f"{ep.dist.name}:{ep.name}"] = ep.dist.name
    dists.update({name: "torchlens" for name, _, _ in BUILTIN_PLUGINS})
    listed: dict[str, PluginInfo] = {}
    for name, plugin in pm.list_name_plugin():
        kinds = []
        for hook, kind in _HOOK_KINDS:
            if any(impl.plugin is plugin for impl in getattr(pm.hook, hook).get_hookimpls()) and kind not in kinds:
                kinds.append(kind)
        origin = dists.get(name) or (getattr(plugin, "__module__", None) or getattr(plugin, "__name__", "?"))
        origin = origin.split(".", 1)[0]
        listed[name] = PluginInfo(name, "+".join(kinds) or "none", _version(origin), origin)
    broken: list[PluginInfo] = []
    for (name, _), info in _failures.items():
        if name in listed:
            prior = listed[name].error
            listed[name].error = info.error if prior is None else f"{prior}; {info.error}"
        else:
            broken.append(info)
    return [*listed.values(), *broken]
