"""Resolving site names at the edge, once: canonical names become this model's real sites.

``blocks.3.mlp`` means ``transformer.h.3.mlp`` on GPT-2 and ``model.layers.3.mlp`` on Llama;
``blocks.3.resid_mid`` is an op, not a module output. Every entry point that takes a site
(``tl.trace``/``tl.when``/``tl.extract`` before capture, ``trace.bind`` for reads and
``fork.do``) passes it through :func:`bind`; core selectors then match real addresses only.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

from torch import nn

from ..capture._splice import SUB_SITE, SUB_SITE_PARTS, sub_site_label
from ..capture.hooks import resolve_module
from ..core.names import nearest
from ..core.selectors import Selector, split_pass
from ..errors import LayoutInferenceError, PluginError, SiteNotFoundError, TorchLensError, UnsupportedModelError
from ..plugins import adapter_with_owner, generation, report_failure
from .tl_names import is_transformerlens
from .views import ADAPTER_REMEDY, ArchView, is_canonical

__all__ = [
    "ModelNames", "arch", "arch_view", "bind", "canonical_selector", "real_address", "resolve_canonical",
    "view_or_none",
]

# model -> (plugin generation, structure token, ArchView): canonical names are resolved on every
# lookup that misses a real address, and building a view walks the model.
_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# How op labels look (``linear_3``, ``scaled_dot_product_attention_1``, ``input_0``, ``input_ids``).
# A canonical name with a negative block index (``blocks.-1.mlp``): refused, saying what it would mean.
_NEGATIVE_BLOCK = re.compile(r"^blocks\.(-\d+)(?=\.|$)")
_SUB_SITE_ENDS = tuple("." + part for part in SUB_SITE_PARTS)  # how every sub-site label (or its address) ends


def arch_view(model: Any) -> ArchView:
    """The serving adapter's view of ``model`` (what ``tl.arch`` returns).

    Raises:
        UnsupportedModelError: no adapter serves the model (remedy: how to write one).
        PluginError: the adapter raised something other than a TorchLens error.
    """
    adapter, owner = adapter_with_owner(model)
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
        report_failure(owner, f"adapter {name}.view()", exc)
        raise PluginError(
            f"adapter {name!r} (plugin {owner}) failed on {type(model).__name__}: {exc!r}",
            plugin=owner,
            remedy="Fix or uninstall the plugin named; real module paths work without an adapter.",
        ) from exc


def canonical_selector(model: Any, path: str) -> Selector | None:
    """The selector a canonical name (``blocks.3.resid_mid``, ``embed``) stands for in ``model``.

    Returns None when ``path`` is not a canonical name or no adapter serves the model, so
    callers fall back to treating it as a module path.

    Raises:
        SiteNotFoundError: the name is canonical but this model has no such site (a block
        index out of range, GPT-NeoX's parallel residual has no ``resid_mid`` ...).
    """
    if model is None:
        return None
    base = split_pass(path)[0]
    if not is_canonical(base) and is_transformerlens(base):
        view = _cached_view(model, strict=True)  # translated where the family declares it, else refused, explained
        return None if view is None else view.selector(path)
    if not is_canonical(base):
        if _NEGATIVE_BLOCK.match(base):
            _refuse_negative_block(model, base, path)
        return None
    view = _cached_view(model, strict=True)
    return None if view is None else view.selector(path)


def _refuse_negative_block(model: Any, base: str, path: str) -> None:
    """A canonical name is an address (``blocks.11.mlp``); ``-1`` counts from the end only in
    ``layers=`` arguments (``ArchView.layer_indices``), so a name saying ``blocks.-1`` is refused
    with what it would have meant."""
    view = _cached_view(model)
    if view is None or not view.n_layers:
        return
    found = _NEGATIVE_BLOCK.match(base)
    index, rest = int(found.group(1)), base[found.end():]
    meant = f"blocks.{view.n_layers + index}" if -view.n_layers <= index < 0 else None
    raise SiteNotFoundError(
        f"{base!r}: canonical names count blocks from 0 (blocks.0 .. blocks.{view.n_layers - 1}, this model has "
        f"{view.n_layers}); negative indices count from the end only in layers= arguments",
        site=path,
        remedy=(f"Name {meant + rest!r}, or pass layers=[{index}] to the workflow." if meant else
                f"Pick a block between 0 and {view.n_layers - 1}."),
    )


def view_or_none(model: Any) -> ArchView | None:
    """The serving adapter's view of ``model``, or None (no model, or no adapter serves it)."""
    return None if model is None else _cached_view(model)


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


def real_address(model: nn.Module, path: str) -> tuple[str, int | None]:
    """Address and pass of a module path, canonical adapter names resolved; raises if absent.

    Raises:
        SiteNotFoundError: no such module, or a canonical name this model does not have (or
        one that names an op, not a module output, such as ``blocks.0.resid_mid``).
    """
    address, pass_index = split_pass(path)
    try:
        resolve_module(model, address)
        return address, pass_index
    except LookupError:
        real = resolve_canonical(model, address)
        if real is None:
            raise
        resolve_module(model, real)
        return real, pass_index


def _canonical(model: nn.Module, path: str) -> Selector | None:
    """The adapter's selector for ``path`` when it is not a real module address of ``model``."""
    try:
        resolve_module(model, split_pass(path)[0])
        return None
    except LookupError:
        return canonical_selector(model, path)


class ModelNames:
    """One model's names, as selectors bind to them (:class:`torchlens.core.selectors.Names`):
    real module addresses, the serving adapter's canonical names, and splice sub-sites."""

    __slots__ = ("model",)

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def canonical(self, path: str) -> Selector | None:
        return _canonical(self.model, path)

    def is_module(self, path: str) -> bool:
        try:
            resolve_module(self.model, split_pass(path)[0])
        except LookupError:
            return False
        return True

    def sub_site(self, label: str) -> str | None:
        """A splice's sub-site (``blocks.6.features``: ``torchlens.capture._splice``) as the label the
        capture gives it (``transformer.h.6.features``), its module named however the caller likes."""
        if not (label.endswith(_SUB_SITE_ENDS) or label.rpartition(":")[0].endswith(_SUB_SITE_ENDS)):
            return None  # (what SUB_SITE would say, without running the pattern on every module site bound)
        found = SUB_SITE.match(label)
        if found is None or self.is_module(label):  # a real module of that name wins
            return None
        try:
            address, _ = real_address(self.model, found["site"])
        except LookupError:
            return None
        return sub_site_label(address, int(found["pass"] or 1), found["part"])

    def not_found(self, label: str) -> SiteNotFoundError:
        names = [n for n, _ in self.model.named_modules() if n]
        return SiteNotFoundError(
            f"{label!r} is neither a module of {type(self.model).__name__} nor an op label; "
            f"nearest modules: {nearest(label, names)}",
            site=label,
            candidates=nearest(label, names),
        )


def bind(model: nn.Module, selector: Selector, *, strings_as_modules: bool = True) -> Selector:
    """Resolve a selector's names against ``model``, once, before it is matched: ``selector.bind``
    with ``model``'s :class:`ModelNames` (each selector class binds itself; see ``Selector.bind``).

    Canonical adapter names (``blocks.3.mlp``, ``blocks.3.resid_mid``) are bound to the module
    output or op they stand for in this model. With ``strings_as_modules`` (capture-time sites
    and ``fork.do``), plain strings that name modules become module selectors (every pass, so
    hooks can serve them) and a string that is neither a module nor an op label is refused.

    Raises:
        SiteNotFoundError: a string site that names nothing (with ``strings_as_modules``), or a
        canonical name this model does not have.
    """
    return selector.bind(ModelNames(model), strings_as_modules=strings_as_modules)


def _cached_view(model: Any, strict: bool = False) -> ArchView | None:
    """The model's view, rebuilt when plugins changed or its config object or block list did.

    None when no adapter serves the model; with ``strict``, a layout that could not be inferred
    (two candidate block lists tie) raises its ``LayoutInferenceError`` instead (a canonical name was asked for).
    """
    current = generation()
    try:
        hit = _views.get(model)
    except TypeError:  # not weak-referenceable
        hit = None
    if hit is None or hit[0] != current or hit[1] != _view_token(model, hit[2]):
        error = None
        try:
            view = arch_view(model)
        except (UnsupportedModelError, PluginError):
            view = None
        except LayoutInferenceError as exc:
            view, error = None, exc
        hit = (current, _view_token(model, view), view, error)
        try:
            _views[model] = hit
        except TypeError:
            pass
    if strict and hit[3] is not None:
        raise type(hit[3])(hit[3].message, remedy=hit[3].remedy, **hit[3].fields)
    return hit[2]


def _view_token(model: Any, view: ArchView | None) -> tuple:
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


def arch(model: nn.Module) -> ArchView:
    """The architecture view of ``model`` from its adapter (or the generic one).

    Args:
        model: an eager ``nn.Module``; transformers models are matched by ``config.model_type``.

    Returns:
        an ArchView: ``n_layers``, ``n_heads``, ``n_kv_heads``, ``head_dim``, ``d_model``,
        ``blocks`` (real addresses) and the canonical sites (``names()``, ``selector()``,
        ``resolve()``).

    Raises:
        UnsupportedModelError: no adapter serves the model and no repeated block list was found.
        PluginError: the adapter that claimed the model failed.
    """
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"tl.arch() takes an nn.Module, got {type(model).__name__}",
                                    remedy="Pass the model itself (for an nnsight wrapper: model._model).")
    return arch_view(model)
