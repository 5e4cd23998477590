"""The one plugin manager: created on first use, loading the ``torchlens`` entry points.

Built-in engines, helpers and adapters come in through the same entry-point group as a
third party's, so nothing in the core names them. A plugin that fails to import, implements
a hook that does not exist, or whose hook raises is reported (``tl.plugins()``, a warning
naming it) and skipped, never fatal: TorchLens keeps working with the other plugins.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import pluggy

from . import hookspecs
from .errors import InvalidArgumentError, PluginError, SiteNotFoundError, TorchLensError, UnsupportedModelError

_lock = threading.RLock()
_pm: pluggy.PluginManager | None = None
_failures: dict[tuple[str, str], PluginInfo] = {}
_cache: dict[str, Any] = {}
# model -> (structure token, ArchView): canonical names are resolved on every lookup that
# misses a real address, and building a view walks the model; cleared with _cache.
_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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
        for ep in md.entry_points(group="torchlens"):
            dist = ep.dist.name if ep.dist else "?"
            name = f"{dist}:{ep.name}"
            try:
                obj = ep.load()
                if obj is None:  # a placeholder entry point: nothing to register yet
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


def reload() -> None:
    """Forget every plugin and rediscover the entry points (after installing a plugin package)."""
    global _pm
    with _lock:
        _pm = None
        _cache.clear()
        _views.clear()
        _failures.clear()
        importlib.invalidate_caches()


def register(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object at run time (tests, notebooks); entry points need no call."""
    pm = _manager()
    pm.register(plugin, name=name)
    _check_unknown_hooks(pm, plugin, name or pm.get_name(plugin) or repr(plugin))
    _cache.clear()
    _views.clear()


def unregister(plugin: Any = None, name: str | None = None) -> None:
    """Remove a plugin registered with ``register`` (or an entry point's, by name)."""
    pm = _manager()
    gone = name or (pm.get_name(plugin) if plugin is not None else None)
    pm.unregister(plugin=plugin, name=name)
    for key in [k for k in _failures if k[0] == gone]:
        del _failures[key]
    _cache.clear()
    _views.clear()


def _collect(hook_name: str, registration_order: bool = False) -> list[tuple[str, Any]]:
    """Call a collecting hook plugin by plugin, isolating failures by plugin name.

    Pluggy's call order is last-registered first (so a plugin registered at run time can
    override a built-in); ``registration_order`` reverses that where the first one must win.
    """
    pm = _manager()
    impls = getattr(pm.hook, hook_name).get_hookimpls()
    found: list[tuple[str, Any]] = []
    for impl in impls if registration_order else reversed(impls):
        try:
            items = list(_call(hook_name, impl) or ())
        except Exception as exc:  # noqa: BLE001
            _fail(impl.plugin_name, hook_name, exc)
            continue
        found.extend((impl.plugin_name, item) for item in items)
    return found


# -- engines -------------------------------------------------------------------------------


def engines() -> dict[str, Any]:
    """Every registered capture engine by name (the first registered wins a name clash)."""
    cached = _cache.get("engines")
    if cached is None:
        cached = {}
        owners: dict[str, str] = {}
        for plugin_name, engine in _collect("torchlens_engines", registration_order=True):
            name = getattr(engine, "name", None)
            if not isinstance(name, str) or not callable(getattr(engine, "capture", None)) or not callable(
                getattr(engine, "cost", None)
            ):
                _fail(plugin_name, "torchlens_engines", f"{engine!r} lacks name/cost()/capture()")
                continue
            if name in cached:
                _fail(plugin_name, "torchlens_engines", f"a capture engine named {name!r} is already registered")
                continue
            cached[name] = engine
            owners[name] = plugin_name
        _cache["engines"] = cached
        _cache["engine_owners"] = owners
    return cached


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
    """Every edit helper class registered by plugins, by name (the first registered wins)."""
    cached = _cache.get("helpers")
    if cached is None:
        cached = {}
        for plugin_name, cls in _collect("torchlens_helpers", registration_order=True):
            name = getattr(cls, "name", None)
            if name in cached and cached[name] is not cls:
                _fail(plugin_name, "torchlens_helpers", f"an edit helper named {name!r} is already registered")
                continue
            cached[name] = cls
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


def _adapter_for(model: Any) -> tuple[Any | None, str]:
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
    return _adapter_for(model)[0]


def arch_view(model: Any) -> Any:
    """``tl.arch(model)``: the serving adapter's view of the model.

    Raises:
        UnsupportedModelError: no adapter serves the model (remedy: how to write one).
        PluginError: the adapter raised something other than a TorchLens error.
    """
    from .arch import ADAPTER_REMEDY

    adapter, owner = _adapter_for(model)
    if adapter is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise UnsupportedModelError(
            f"no architecture adapter serves {type(model).__name__} (config.model_type={model_type!r})",
            remedy=ADAPTER_REMEDY,
        )
    name = getattr(adapter, "name", type(adapter).__name__)
    try:
        return adapter.view(model)
    except TorchLensError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported with the plugin's name
        _fail(owner, f"adapter {name}.view()", exc)
        raise PluginError(
            f"adapter {name!r} (plugin {owner}) failed on {type(model).__name__}: {exc!r}",
            plugin=owner,
            remedy="Fix or uninstall the plugin named; real module paths work without an adapter.",
        ) from exc


def canonical_selector(model: Any, path: str) -> Any | None:
    """The selector a canonical name (``blocks.3.resid_mid``, ``embed``) stands for in ``model``.

    Returns None when ``path`` is not a canonical name or no adapter serves the model, so
    callers fall back to treating it as a module path.

    Raises:
        SiteNotFoundError: the name is canonical but this model has no such site (a block
        index out of range, GPT-NeoX's parallel residual has no ``resid_mid`` ...).
    """
    from .arch import is_canonical

    if model is None or not is_canonical(path):
        return None
    view = _cached_view(model)
    return None if view is None else view.selector(path)


def _cached_view(model: Any) -> Any | None:
    """The model's view, rebuilt when its config object or block list changed."""
    try:
        hit = _views.get(model)
    except TypeError:  # not weak-referenceable
        hit = None
    if hit is not None and hit[0] == _view_token(model, hit[1]):
        return hit[1]
    try:
        view = arch_view(model)
    except (UnsupportedModelError, PluginError):
        view = None
    try:
        _views[model] = (_view_token(model, view), view)
    except TypeError:
        pass
    return view


def _view_token(model: Any, view: Any) -> tuple:
    """What a cached view depends on, cheap to recompute (no walk over every module)."""
    token: tuple = (id(getattr(model, "config", None)),)
    if view is not None and view.blocks:
        container = view.blocks[0].rpartition(".")[0]
        try:
            blocks = model.get_submodule(container) if container else model
        except AttributeError:
            return (*token, None)
        token += (id(blocks), len(blocks._modules))
    else:
        token += (len(model._modules),)
    return token


def resolve_canonical(model: Any, path: str) -> str | None:
    """Real module address for a canonical name (``blocks.3.mlp``), or None if not canonical
    or if the site is not a module's output (``resid_mid`` is an op: use ``canonical_selector``).

    Raises:
        SiteNotFoundError: the name is canonical but this model has no such site.
    """
    sel = canonical_selector(model, path)
    if sel is None:
        return None
    paths = sel.module_paths()
    return paths[0] if paths and len(paths) == 1 else None


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
