"""The public entry points: ``tl.trace`` (every op) and ``tl.extract`` (module reads, fast)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .arch.resolve import bind
from .capture.request import CaptureRequest, module_address
from .core.inputs import split_inputs
from .core.selectors import Selector, as_selector
from .core.steps import Step
from .core.trace import Trace
from .errors import (
    AmbiguousSiteError,
    EditNotAppliedError,
    InvalidArgumentError,
    SiteNotFoundError,
    UnsupportedModelError,
)
from .plugins import choose_engine, engines

__all__ = ["check_model", "extract", "rerun", "trace", "trace_until"]


def check_model(model: Any) -> nn.Module:
    """Refuse objects TorchLens cannot capture eagerly, with what to pass instead."""
    if isinstance(model, torch.jit.ScriptModule) or isinstance(model, torch.jit.ScriptFunction):
        raise UnsupportedModelError(
            f"{type(model).__name__} is a TorchScript module; its forward does not run Python ops",
            remedy="Capture the original eager nn.Module before torch.jit.script/trace.",
        )
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise UnsupportedModelError(
            "the model was compiled with torch.compile; compiled graphs hide their ops from capture",
            remedy="Pass model._orig_mod (the eager module torch.compile wrapped).",
        )
    if not isinstance(model, nn.Module):
        attr = next((a for a in ("_module", "_model") if isinstance(getattr(model, a, None), nn.Module)), None)
        hint = (
            f"Pass the module it wraps: model.{attr} (an nnsight wrapper keeps it there)."
            if attr
            else "Wrap the callable in an nn.Module."
        )
        raise UnsupportedModelError(f"expected a torch.nn.Module, got {type(model).__name__}", remedy=hint)
    return model


def _as_steps(intervene: Any, model: nn.Module | None = None) -> list[Step]:
    """Capture-time edits from a When, a list of them, or a loaded recipe (checked against ``model``)."""
    if intervene is None:
        return []
    if hasattr(intervene, "as_whens"):  # a saved recipe
        return list(intervene.as_whens(model))
    items = intervene if isinstance(intervene, (list, tuple)) else [intervene]
    whens = []
    for item in items:
        if hasattr(item, "as_whens"):
            whens.extend(item.as_whens(model))
        elif isinstance(item, Step):
            whens.append(item.for_capture())  # fresh copy: 'fired' is per capture
        else:
            raise InvalidArgumentError(
                f"intervene= takes tl.when(site, edit), a list of them, or a loaded recipe; got {type(item).__name__}"
            )
    return whens


def _as_save(save: Any) -> Selector | None:
    if save is None:
        return None
    if isinstance(save, (Selector, str)) or (isinstance(save, (list, tuple)) and save):
        return as_selector(save)
    raise InvalidArgumentError(
        f"save= takes a selector, a label, or a list of them (or None to keep everything); got {type(save).__name__}"
    )


def _check_fired(whens: list[Step], trace: Trace) -> None:
    for when in whens:
        if not when.fired:
            fired = trace.module_addresses or [op.label for op in trace.ops[:20]]
            seen = f"modules that ran include {fired[:12]}"
            if not fired:  # the hooks engine observed only the edited modules, and none ran
                seen = "none of the hooked modules ran (run tl.trace without backend='hooks' to list those that did)"
            raise EditNotAppliedError(
                f"the edit at {when.site.describe()} never fired during the forward; {seen}",
                site=when.site.describe(),
                fired=fired,
            )


def _capture(request: CaptureRequest, backend: str | None) -> Trace:
    engine = choose_engine(request, backend)
    trace = engine.capture(request)
    if trace.complete:
        _check_fired(request.intervene, trace)
    return trace


def trace(
    model: nn.Module,
    *args: Any,
    save: Any = None,
    intervene: Any = None,
    backend: str | None = None,
    grad: bool = False,
    **kwargs: Any,
) -> Trace:
    """Run ``model(*args, **kwargs)`` once and record every executed op.

    Args:
        model: an eager ``nn.Module``; it is left exactly as it was, also if it raises.
        save: keep only the outputs of ops matching this selector (the graph is still recorded).
            With ``intervene=`` and only module sites in both, module hooks serve the
            capture: the trace then holds those module outputs and the model output, no ops.
        intervene: ``tl.when(site, edit)``, a list of them, or a loaded recipe, applied while
            the forward runs.
        backend: a capture engine by name (``tl.plugins()`` lists them); default: the cheapest
            that can serve the request.
        grad: run with autograd enabled (default off: faster, no graph kept).

    Returns:
        the Trace.

    Raises:
        UnsupportedModelError: the model is not an eager nn.Module (compiled, scripted, a wrapper).
        SiteNotFoundError: a site names no module or op of the model.
        EditNotAppliedError: an edit's site never fired during the forward.
        InvalidArgumentError: ``save=`` or ``intervene=`` has the wrong type.
        FingerprintMismatchError: a loaded recipe was saved for a different model.
    """
    model = check_model(model)
    whens = _bound_steps(model, intervene)
    saved = _as_save(save)
    if saved is not None:
        saved = bind(model, saved)
    request = CaptureRequest(model, args, kwargs, record_ops=True, intervene=whens, save=saved, grad=grad)
    module_request = replace(request, record_ops=False, sites=saved, save=None)
    if backend is None:
        if whens and saved is not None and module_request.module_only():
            # An edit plus a module read needs no op graph: module hooks serve it at hook cost.
            request = module_request
    else:
        named = engines().get(backend)
        if named is not None and not getattr(named, "records_ops", True):
            request = module_request  # an engine that records module outputs only (a capability it declares)
    return _capture(request, backend)


def _bound_steps(model: nn.Module, intervene: Any) -> list[Step]:
    """Fresh capture-time steps, their sites resolved against ``model``."""
    return [Step(bind(model, s.site), s.edit) for s in _as_steps(intervene, model)]


def rerun(model: nn.Module, args: tuple, kwargs: dict, steps: list[Step], until: Selector | None = None) -> Trace:
    """Capture ``model`` again on (args, kwargs) with ``steps`` applied during capture;
    with ``until``, stop right after it (a partial trace)."""
    if until is not None:
        return trace_until(model, args, kwargs, until, intervene=steps or None)
    return trace(model, *args, intervene=steps or None, **kwargs)


def trace_until(model: nn.Module, args: tuple, kwargs: dict, until: Any, intervene: Any = None) -> Trace:
    """Record the forward and stop right after ``until`` fires (a partial trace)."""
    model = check_model(model)
    request = CaptureRequest(model, args, kwargs, intervene=_bound_steps(model, intervene),
                             until=bind(model, as_selector(until)))
    result = _capture(request, None)
    if result.complete:
        raise EditNotAppliedError(
            f"the forward finished without reaching {request.until.describe()}",
            site=request.until.describe(),
            remedy="Pick a site that runs in this forward (see trace.modules).",
        )
    return result


def extract(model: nn.Module, x: Any, sites: Any, *, grad: bool = False, backend: str | None = None) -> dict:
    """Read activations in one forward; module outputs are read with forward hooks only.

    Args:
        model: an eager ``nn.Module``.
        x: the input: a tensor, a tuple of positional inputs, or a dict of keyword inputs.
        sites: a list of module addresses / selectors (result keyed by each), or a dict
            ``{name: address_or_selector}`` (result keyed by name).

    Returns:
        ``{key: value}`` where a module's value is exactly what a forward hook on it sees;
        a selector matching several ops gives a list.
    """
    model = check_model(model)
    if isinstance(sites, dict):
        named = dict(sites)
    elif isinstance(sites, (list, tuple)):
        named = {s if isinstance(s, str) else str(s): s for s in sites}
    elif isinstance(sites, (str, Selector)):
        named = {sites if isinstance(sites, str) else str(sites): sites}
    else:
        raise InvalidArgumentError(f"sites must be a list or dict of sites, got {type(sites).__name__}")
    if not named:
        raise InvalidArgumentError("extract() needs at least one site")
    selectors = {k: bind(model, as_selector(v)) for k, v in named.items()}
    union = None
    for sel in selectors.values():
        union = sel if union is None else union | sel
    args, kwargs = split_inputs(x)
    request = CaptureRequest(model, args, kwargs, record_ops=False, sites=union, save=union, grad=grad)
    if not request.module_only():
        request.record_ops = True
    result = _capture(request, backend)
    out: dict[str, Any] = {}
    for key, sel in selectors.items():
        paths = sel.module_paths()
        if paths is not None and len(paths) == 1:
            out[key] = _module_value(result, paths[0], key)
        else:
            found = result.find_sites(sel)
            out[key] = found.first().out if len(found) == 1 else [s.out for s in found]
    return out


def _module_value(result: Trace, path: str, key: str) -> Any:
    address, pass_index = module_address(result.model, path)
    calls = result.calls_of(address)
    if not calls:
        raise SiteNotFoundError(f"module {address!r} exists but did not run in this forward", site=key,
                                remedy="Check the model's forward: this module is skipped for this input.")
    if pass_index is None:
        if len(calls) > 1:
            passes = [f"{address}:{i + 1}" for i in range(len(calls))]
            raise AmbiguousSiteError(f"module {address!r} ran {len(calls)} times; say which pass: {passes}",
                                     site=key, passes=passes)
        return result.module_output(calls[0])
    if not 1 <= pass_index <= len(calls):
        raise SiteNotFoundError(f"module {address!r} ran {len(calls)} time(s); there is no pass {pass_index}",
                                site=key, remedy=f"Use a pass between 1 and {len(calls)}.")
    return result.module_output(calls[pass_index - 1])

