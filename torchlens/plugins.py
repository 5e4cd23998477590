"""The one plugin manager: created on first use, loading the ``torchlens`` entry points.

Built-in engines, helpers and adapters come in through the same entry-point group as a
third party's, so nothing in the core names them. A plugin that fails to import or whose
hook raises is reported (``tl.plugins()``, a warning) and skipped, never fatal.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .errors import InvalidArgumentError, PluginError

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_failures: list[PluginInfo] = []
_cache: dict[str, Any] = {}


@dataclass
class PluginInfo:
    """One registered plugin, as ``tl.plugins()`` lists it."""

    name: str
    kind: str
    version: str
    origin: str
    error: str | None = None


def _manager() -> pluggy.PluginManager:
    global _pm
    if _pm is not None:
        return _pm
    with _lock:
        if _pm is not None:
            return _pm
        pm = pluggy.PluginManager("torchlens")
        pm.add_hookspecs(hookspecs)
        for ep in md.entry_points(group="torchlens"):
            dist = ep.dist.name if ep.dist else "?"
            try:
                obj = ep.load()
                if obj is None:
                    continue
                pm.register(obj, name=f"{dist}:{ep.name}")
            except Exception as exc:  # noqa: BLE001 - a broken plugin must not break TorchLens
                _failures.append(PluginInfo(f"{dist}:{ep.name}", "broken", _version(dist), dist, repr(exc)))
                warnings.warn(f"TorchLens plugin {dist}:{ep.name} failed to load: {exc!r}", stacklevel=2)
        if os.environ.get("TORCHLENS_TRACE_HOOKS"):
            pm.trace.root.setwriter(lambda s: sys.stderr.write(s))
            pm.enable_tracing()
        _pm = pm
        return pm


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "?"


def register(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object at run time (tests, notebooks); entry points need no call."""
    pm = _manager()
    pm.register(plugin, name=name)
    _cache.clear()


def unregister(plugin: Any = None, name: str | None = None) -> None:
    _manager().unregister(plugin=plugin, name=name)
    _cache.clear()


def _collect(hook_name: str) -> list[tuple[str, Any]]:
    """Call a collecting hook plugin by plugin, isolating failures by plugin name."""
    pm = _manager()
    found: list[tuple[str, Any]] = []
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        try:
            result = impl.function()
        except Exception as exc:  # noqa: BLE001
            _failures.append(PluginInfo(impl.plugin_name, "broken", "?", impl.plugin_name, repr(exc)))
            warnings.warn(f"TorchLens plugin {impl.plugin_name} raised in {hook_name}: {exc!r}", stacklevel=3)
            continue
        for item in result or ():
            found.append((impl.plugin_name, item))
    return found


def engines() -> dict[str, Any]:
    cached = _cache.get("engines")
    if cached is None:
        cached = {}
        for plugin_name, engine in _collect("torchlens_engines"):
            if engine.name in cached:
                raise PluginError(f"two plugins register a capture engine named {engine.name!r} ({plugin_name})")
            cached[engine.name] = engine
        _cache["engines"] = cached
    return cached


def choose_engine(request: Any, backend: str | None) -> Any:
    available = engines()
    if backend is not None:
        engine = available.get(backend)
        if engine is None:
            raise InvalidArgumentError(
                f"no capture engine named {backend!r}; registered: {sorted(available)}",
                remedy="Pick one of the registered engines, or install the plugin that provides it.",
            )
        if engine.cost(request) is None:
            raise InvalidArgumentError(
                f"engine {backend!r} cannot serve this request ({request.describe()})",
                remedy="Omit backend= to let TorchLens pick an engine that can.",
            )
        return engine
    best, best_cost = None, None
    for engine in available.values():
        cost = engine.cost(request)
        if cost is not None and (best_cost is None or cost < best_cost):
            best, best_cost = engine, cost
    if best is None:
        raise PluginError(f"no registered capture engine can serve {request.describe()}")
    return best


def helpers() -> dict[str, type]:
    cached = _cache.get("helpers")
    if cached is None:
        cached = {}
        for plugin_name, cls in _collect("torchlens_helpers"):
            if cls.name in cached and cached[cls.name] is not cls:
                raise PluginError(f"two plugins register an edit helper named {cls.name!r} ({plugin_name})")
            cached[cls.name] = cls
        _cache["helpers"] = cached
    return cached


def adapters() -> list[Any]:
    cached = _cache.get("adapters")
    if cached is None:
        cached = [adapter for _, adapter in _collect("torchlens_adapters")]
        _cache["adapters"] = cached
    return cached


def adapter_for(model: Any) -> Any | None:
    """The adapter serving ``model``: a plugin's explicit choice, else by ``config.model_type``."""
    chosen = _manager().hook.torchlens_choose_adapter(model=model)
    if chosen is not None:
        return chosen
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return None
    for adapter in adapters():
        if model_type in adapter.model_types:
            return adapter
    return None


def resolve_canonical(model: Any, path: str) -> str | None:
    """Real module address for a canonical name (``blocks.3.mlp``), or None if not canonical."""
    adapter = adapter_for(model)
    if adapter is None:
        return None
    try:
        return adapter.view(model).resolve(path)
    except (KeyError, LookupError, AttributeError):
        return None


def facets_for(site: Any) -> Any:
    result = None
    for impl in _manager().hook.torchlens_facets.get_hookimpls()[::-1]:
        result = impl.function(site=site)
        if result is not None:
            return result
    from .errors import SiteNotFoundError

    raise SiteNotFoundError(
        f"no facet plugin understands site {site.label!r} ({site.kind})",
        site=site.label,
        remedy="Facets exist for attention ops (scaled_dot_product_attention); install a facet plugin for others.",
    )


def plugins() -> list[PluginInfo]:
    """Every registered plugin (name, kind, version, origin package), broken ones included."""
    pm = _manager()
    listed: list[PluginInfo] = []
    dists = {}
    for ep in md.entry_points(group="torchlens"):
        if ep.dist:
            dists[f"{ep.dist.name}:{ep.name}"] = ep.dist.name
    for name, plugin in pm.list_name_plugin():
        kinds = []
        for hook, kind in (("torchlens_engines", "engine"), ("torchlens_adapters", "adapter"),
                           ("torchlens_choose_adapter", "adapter"), ("torchlens_helpers", "helpers"),
                           ("torchlens_facets", "facet")):
            if any(impl.plugin is plugin for impl in getattr(pm.hook, hook).get_hookimpls()):
                if kind not in kinds:
                    kinds.append(kind)
        origin = dists.get(name, getattr(plugin, "__module__", None) or getattr(plugin, "__name__", "?"))
        listed.append(PluginInfo(name, "+".join(kinds) or "none", _version(origin), origin))
    return listed + list(_failures)
