"""The public entry points: ``tl.trace`` (every op) and ``tl.extract`` (module reads, fast)."""

from __future__ import annotations

import inspect
import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .arch.resolve import ModelNames, bind
from .capture._estimate import estimate_capture
from .capture._offload import ValueOffload
from .capture._trace_store import TraceStore, check_recompute
from .capture.request import CaptureRequest, module_address
from .core.inputs import call_inputs, split_inputs
from .core.selectors import ModuleOutput, Selector, as_selector, as_sites, split_pass
from .core.steps import Step
from .core.text import tokenizer_for
from .core.trace import Trace
from .dictionaries.attach import feature_steps, sub_site_reads
from .errors import (
    CaptureMemoryError,
    EditNotAppliedError,
    InvalidArgumentError,
    LegacyArgumentError,
    SiteNotFoundError,
    UnsupportedModelError,
)
from .plugins import builtin_engines_only, choose_engine, engines

__all__ = ["check_model", "extract", "rerun", "stops_on_modules", "trace", "trace_until"]


def check_model(model: Any) -> nn.Module:
    """Refuse objects TorchLens cannot capture eagerly, with what to pass instead."""
    if type(model) in _EAGER_TYPES:  # a type checked before (every check below reads the type alone)
        return model
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
    if type(model).__name__ != "OptimizedModule":  # (that one is refused by its instance's _orig_mod)
        _EAGER_TYPES.add(type(model))
    return model


_EAGER_TYPES: set[type] = set()  # module types check_model accepted


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
    for when in request.intervene or ():
        why = when.site.capture_refusal()
        if why is not None:
            raise EditNotAppliedError(
                f"the edit at {when.site.describe()} cannot fire during the forward: {why}", site=when.site.describe(),
                fired=[], remedy="Edit the input you pass to the model instead (every reader of it then sees the "
                                 "edit), or, after capture, trace.fork().do(site, edit), which replays it from the "
                                 "recorded input.")
    trace = choose_engine(request, backend).capture(request)
    if request.intervene and trace.complete:
        _check_fired(request.intervene, trace)
    return trace


# Keywords of the older TorchLens package's ``log_forward_pass`` and what to write here instead.
_VIS = "drop it: TorchLens draws after capture, with tl.draw(trace) or trace.table() for the ops"
_LEGACY_KEYWORDS = {
    "input_args": "pass the inputs positionally: tl.trace(model, x) or tl.trace(model, *args)",
    "input_kwargs": "pass keyword inputs as keywords or as a dict: tl.trace(model, {'input_ids': ids})",
    "layers_to_save": "save= (a selector: save=tl.func('relu') | tl.module('fc1'); omit it to keep every op)",
    "which_layers": "save= (a selector: save=tl.func('relu') | tl.module('fc1'); omit it to keep every op)",
    "keep_unsaved_layers": "nothing: the graph always keeps every op; save= only decides whose values stay",
    "output_device": "move values when you read them: trace[label].out.to('cpu')",
    "activation_postfunc": "post-process values when you read them (site.out), or edit with intervene=tl.when(...)",
    "gradient_postfunc": "grad=True, then post-process the gradients you read",
    "save_raw_activation": "nothing: values are kept as the forward produced them",
    "save_raw_gradient": "grad=True",
    "save_gradients": "grad=True",
    "save_grads": "grad=True",
    "gradients_to_save": "grad=True (with save= a selector for the values to keep)",
    "detach_saved_tensors": "grad=False (the default) records without autograd",
    "save_function_args": "nothing: every op's arguments are recorded (op.args_spec, op.parents)",
    "mark_distances": "nothing: walk op.parents / op.children",
    "mark_input_output_distances": "nothing: walk op.parents / op.children",
    "save_source_context": "nothing: every op records its model line (op.source)",
    "num_context_lines": "nothing: every op records its model line (op.source)",
    "save_rng_states": "nothing: ops that draw random numbers are flagged, and replay refuses them",
    "random_seed": "seed before capturing: torch.manual_seed(n); tl.trace(model, x)",
    "vis_opt": _VIS, "vis_nesting_depth": _VIS, "vis_outpath": _VIS, "vis_save_only": _VIS,
    "vis_fileformat": _VIS, "vis_buffer_layers": _VIS, "vis_direction": _VIS, "vis_graph_overrides": _VIS,
    "vis_node_overrides": _VIS, "vis_nested_node_overrides": _VIS, "vis_edge_overrides": _VIS,
    "vis_gradient_edge_overrides": _VIS, "vis_module_overrides": _VIS,
}


_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # forward function -> its parameters


def _forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter] | None:
    """The parameters of ``model.forward`` by name (None when its signature cannot be read)."""
    forward = model.forward
    func = getattr(forward, "__func__", None)
    if func is not None and func in _SIGNATURES:  # reading a signature costs ~0.1 ms on a transformers model
        return _SIGNATURES[func]
    try:
        params = dict(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        return None
    if func is not None:
        _SIGNATURES[func] = params
    return params


def _check_keywords(model: nn.Module, given: dict, from_dict: dict) -> None:
    """Refuse keywords meant for the older TorchLens package, and dict inputs the model cannot take.

    A keyword the model's ``forward`` names explicitly always passes through to the model.
    """
    legacy = [k for k in given if k in _LEGACY_KEYWORDS]
    if not legacy and not from_dict:
        return
    params = _forward_parameters(model)
    if params is None:
        return
    legacy = [k for k in legacy if k not in params]
    if legacy:
        raise LegacyArgumentError(
            f"{', '.join(f'{k}=' for k in legacy)} is spelled as in the older TorchLens package (log_forward_pass) "
            f"and is not a parameter of {type(model).__name__}.forward; here: "
            + "; ".join(f"{k}= -> {_LEGACY_KEYWORDS[k]}" for k in legacy),
            keywords=legacy,
        )
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in from_dict if k not in params]
    if unknown and not takes_any:
        raise InvalidArgumentError(
            f"the input dict's keys {unknown} are not parameters of {type(model).__name__}.forward "
            f"({list(params)}); a dict input is passed as keyword inputs",
            remedy="To pass the dict itself as the one positional input, wrap it in a tuple: tl.trace(model, (d,)).",
        )


def trace(
    model: nn.Module,
    *args: Any,
    save: Any = None,
    intervene: Any = None,
    backend: str | None = None,
    grad: bool = False,
    strict: bool = False,
    store: Any = None,
    store_recompute: bool = True,
    offload_values: Any = None,
    max_bytes: int | str | None = "auto",
    tokenizer: Any = None,
    features: Any = None,
    **kwargs: Any,
) -> Trace:
    """Run ``model(*args, **kwargs)`` once and record every executed op.

    Inputs follow the one input convention (docs/concepts.md, "Inputs"): a tensor, a tuple of
    positional inputs, a dict of keyword inputs, text (a string or a list of strings, with a
    tokenizer: docs/concepts.md, "Text in"), or the model's ``*args, **kwargs`` directly.

    Args:
        model: an eager ``nn.Module``; it is left exactly as it was, also if it raises.
        *args: the model's positional inputs; one tuple or dict is read by the input convention.
        **kwargs: the model's keyword inputs.
        save: keep only the outputs of ops matching this selector (the graph is still recorded).
            With ``intervene=`` and only module sites in both, module hooks serve the
            capture: the trace then holds those module outputs and the model output, no ops.
        intervene: ``tl.when(site, edit)``, a list of them, or a loaded recipe, applied while
            the forward runs.
        backend: a capture engine by name (``tl.plugins()`` lists them); default: the cheapest
            that can serve the request.
        grad: run with autograd enabled (default off: faster, no graph kept).
        strict: an edit that changes no element raises ``EditHadNoEffectError`` instead of
            warning ``tl.EditHadNoEffect``, during this capture and on every fork of the trace.
        store: a directory: every kept value is written there (safetensors shards) as the
            forward produces it and read back lazily; memory holds the graph, not the values.
        store_recompute: with ``store=``, a value an exactly reproducible elementwise op
            (``add``, ``mul``, ``div``, ``where``, ``clone`` ...: docs/big-models.md) made from
            other stored values is recomputed on read instead of written, once the capture has
            checked that the recompute gives it bit for bit. False writes every value.
        offload_values: a device (``"cpu"``) to keep recorded values on while the model runs
            on an accelerator; they are moved back to the op's device when replay needs them.
        max_bytes: the most bytes an in-memory capture may add to the process's resident
            memory before it is stopped with ``CaptureMemoryError`` (checked every 64 ops);
            ``"auto"``: 90% of the memory available when the capture starts; None: no limit.
            A number, or ``"estimate"`` (90% of the memory available), is also checked
            *before* the forward: the capture first runs on fake tensors (shapes only, no
            compute) and sums the bytes its values would hold (``save=`` applied, capture-time
            edits left out). Where the model cannot run on fake tensors (it reads tensor data
            in Python), only the check during the forward remains, and its error says so.
        tokenizer: tokenizes text inputs (padded on its ``padding_side``, with an attention
            mask) and gives the trace ``tokens``, ``str_tokens`` and ``position(token)``;
            default: the model's ``tokenizer`` attribute, if it has one.
        features: ``{site: sae}``: splice feature dictionaries (SAEs, transcoders: anything with
            ``encode`` / ``decode``) into module outputs for this capture only; their ops are ops of
            the trace, with sub-sites ``<site>.features``, ``<site>.recon``, ``<site>.error``
            (docs/features.md). With nothing edited the output is the model's own, bit for bit.

    Returns:
        the Trace.

    Raises:
        UnsupportedModelError: the model is not an eager nn.Module (compiled, scripted, a wrapper).
        SiteNotFoundError: a site names no module or op of the model.
        EditNotAppliedError: an edit's site never fired during the forward.
        EditHadNoEffectError: with ``strict=True``, an edit changed nothing.
        InvalidArgumentError: ``save=``, ``intervene=`` or ``store_recompute=`` has the wrong
            type, or a dict input's keys are not parameters of the model's forward.
        LegacyArgumentError: a keyword spelled as in the older TorchLens package
            (``layers_to_save=`` ...) that the model's forward does not take.
        TokenizerRequiredError: the input is text and no tokenizer is given or set on the model.
        PaddingNotSupportedError: strings of different lengths, and the forward takes no attention_mask.
        FingerprintMismatchError: a loaded recipe was saved for a different model.
        CaptureMemoryError: the values would not fit in ``max_bytes`` (raised before the
            forward, from the estimate), or the capture grew the process by more than it (the
            forward is stopped before memory runs out); ``save=`` or ``store=`` bound it.
    """
    model = check_model(model)
    tokenizer = tokenizer_for(model, tokenizer)
    call_args, call_kwargs = call_inputs(args, kwargs, model=model, tokenizer=tokenizer)
    _check_keywords(model, kwargs, call_kwargs if len(args) == 1 and isinstance(args[0], Mapping) else {})
    in_memory = store is None or offload_values is not None
    limit = _byte_limit(max_bytes) if in_memory else None
    failure = None
    if limit is not None and max_bytes != "auto":
        failure = _check_estimate(model, call_args, call_kwargs, save, backend, limit)
    sink = _sink(store, offload_values, store_recompute)
    try:
        result = _trace(model, call_args, call_kwargs, save=save, intervene=intervene, backend=backend, grad=grad,
                        strict=strict, sink=sink, max_bytes=limit, features=features)
    except CaptureMemoryError as err:
        if failure is None:
            raise
        raise CaptureMemoryError(f"{err.message}; no estimate could stop it before the forward, because the "
                                 f"model does not run on fake tensors ({failure})", **err.fields) from err
    if tokenizer is not None:
        result.tokenizer = tokenizer
    return result


def _check_estimate(model: nn.Module, args: tuple, kwargs: dict, save: Any, backend: str | None,
                    limit: int) -> str | None:
    """Raise ``CaptureMemoryError`` before any real compute when the values the capture would hold,
    estimated on fake tensors, exceed ``limit``; return why there is no estimate (None: there is)."""
    estimate = estimate_capture(model, args, kwargs, lambda a, k: _trace(model, a, k, save=save, backend=backend))
    if estimate.nbytes is None:
        return estimate.failure
    if estimate.nbytes > limit:
        raise CaptureMemoryError(
            f"an in-memory capture of this forward would hold about {estimate.nbytes / 2**20:,.0f} MiB of values "
            f"({estimate.n_ops} ops, estimated on fake tensors: no compute ran), more than "
            f"max_bytes={limit / 2**20:,.0f} MiB",
            estimated=estimate.nbytes, max_bytes=limit,
        )
    return None


def _sink(store: Any, offload_values: Any, store_recompute: Any = True) -> Any:
    """Where values go as the forward produces them: a disk store, a device, or nowhere (None)."""
    check_recompute(store_recompute)
    if store is not None and offload_values is not None:
        raise InvalidArgumentError("store= and offload_values= both say where values go; pass one",
                                   remedy="store=path keeps them on disk; offload_values='cpu' in CPU memory.")
    if store is not None:
        if not isinstance(store, (str, os.PathLike)):
            raise InvalidArgumentError(f"store= takes a directory path, got {type(store).__name__}")
        return TraceStore(store, recompute=store_recompute)
    if offload_values is not None:
        try:
            return ValueOffload(offload_values)
        except (RuntimeError, TypeError) as exc:
            raise InvalidArgumentError(f"offload_values= takes a device such as 'cpu', got {offload_values!r}",
                                       remedy="Pass offload_values='cpu'.") from exc
    return None


def _byte_limit(max_bytes: int | str | None) -> int | None:
    if max_bytes is None:
        return None
    if max_bytes in ("auto", "estimate"):
        available = _available_memory()
        return None if available is None else int(available * 0.9)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise InvalidArgumentError(
            f"max_bytes= takes a positive number of bytes, 'auto', 'estimate' or None; got {max_bytes!r}")
    return max_bytes


_AVAILABLE: list[float] = [-1.0, 0.0]  # (when read, bytes): read at most once a second


def _available_memory() -> int | None:
    """Bytes of memory available to new allocations (MemAvailable on Linux), None when unknown."""
    now = time.monotonic()
    if now - _AVAILABLE[0] < 1.0:
        return int(_AVAILABLE[1]) or None
    _AVAILABLE[0], _AVAILABLE[1] = now, _read_available() or 0
    return int(_AVAILABLE[1]) or None


def _read_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _trace(model: nn.Module, args: tuple, kwargs: dict, *, save: Any = None, intervene: Any = None,
           backend: str | None = None, grad: bool = False, strict: bool = False, sink: Any = None,
           max_bytes: int | None = None, features: Any = None) -> Trace:
    """``tl.trace`` on inputs already split into the model's (args, kwargs)."""
    whens = _bound_steps(model, intervene)
    if features is not None:  # spliced first: an edit of the same module output sees the spliced value
        whens = feature_steps(model, features) + whens
        _check_records_ops(backend)
    saved = _as_save(save)
    if saved is not None:
        saved = bind(model, saved)
    if backend is None and features is None and whens and saved is not None and saved.module_paths() is not None \
            and all(w.site.module_paths() is not None for w in whens):
        # An edit plus a module read needs no op graph: module hooks serve it at hook cost.
        return _capture(CaptureRequest(model, args, kwargs, record_ops=False, sites=saved, intervene=whens, grad=grad,
                                       strict=strict, max_bytes=max_bytes), backend)
    request = CaptureRequest(model, args, kwargs, record_ops=True, intervene=whens, save=saved, grad=grad,
                             strict=strict, sink=sink, max_bytes=max_bytes)
    if backend is not None:
        named = engines().get(backend)
        if named is not None and not getattr(named, "records_ops", True):
            # an engine that records module outputs only (a capability it declares)
            request = replace(request, record_ops=False, sites=saved, save=None, sink=None)
    return _capture(request, backend)


def _check_records_ops(backend: str | None) -> None:
    """Feature dictionaries are spliced in as recorded ops: an engine recording module outputs only cannot."""
    named = engines().get(backend) if backend is not None else None
    if named is not None and not getattr(named, "records_ops", True):
        raise InvalidArgumentError(
            f"features= records the dictionary's ops, but backend={backend!r} records module outputs only",
            remedy="Drop backend= (the default engine records every op) when passing features=.")


def _bound_steps(model: nn.Module, intervene: Any) -> list[Step]:
    """Fresh capture-time steps, their sites resolved against ``model``."""
    return [Step(bind(model, s.site), s.edit) for s in _as_steps(intervene, model)]


def rerun(model: nn.Module, args: tuple, kwargs: dict, steps: list[Step], until: Selector | None = None, *,
          strict: bool = False, tokenizer: Any = None) -> Trace:
    """Capture ``model`` again on (args, kwargs) with ``steps`` applied during capture;
    with ``until``, stop right after it (a partial trace). The new trace keeps ``tokenizer``
    (default: the model's own)."""
    if until is not None:
        result = trace_until(model, args, kwargs, until, intervene=steps or None, strict=strict)
    else:
        result = _trace(check_model(model), args, kwargs, intervene=steps or None, strict=strict)
    tokenizer = tokenizer_for(model, tokenizer)
    if tokenizer is not None:
        result.tokenizer = tokenizer
    return result


def trace_until(model: nn.Module, args: tuple, kwargs: dict, until: Any, intervene: Any = None, *,
                strict: bool = False) -> Trace:
    """Record the forward and stop right after ``until`` fires (a partial trace)."""
    model = check_model(model)
    request = CaptureRequest(model, args, kwargs, intervene=_bound_steps(model, intervene),
                             until=bind(model, as_selector(until)), strict=strict)
    result = _capture(request, None)
    if result.complete:
        raise EditNotAppliedError(
            f"the forward finished without reaching {request.until.describe()}",
            site=request.until.describe(),
            remedy="Pick a site that runs in this forward (see trace.modules).",
        )
    return result


def extract(model: nn.Module, x: Any, sites: Any, *, grad: bool = False, backend: str | None = None,
            intervene: Any = None, stop: bool = False, tokenizer: Any = None, features: Any = None) -> dict:
    """Read activations in one forward; module outputs are read with forward hooks only.

    Args:
        model: an eager ``nn.Module``.
        x: the input: a tensor, a tuple of positional inputs, a dict of keyword inputs, or
            text with a tokenizer (the one input convention of every entry point:
            docs/concepts.md, "Inputs" and "Text in").
        sites: a list of module addresses / selectors (result keyed by each), or a dict
            ``{name: address_or_selector}`` (result keyed by name).
        intervene: ``tl.when(site, edit)``, a list of them, or a loaded recipe, applied while
            the forward runs (module edits with module reads still run on hooks only).
        stop: stop the forward as soon as every site module has returned, so the rest of the
            model (the final layers, the unembedding) never runs. Only for module sites
            without a pass index; a site module the model would call again later is read at
            its first call (``extract`` without ``stop`` refuses such an ambiguous read).
        tokenizer: tokenizes a text ``x`` (default: the model's ``tokenizer`` attribute).
        features: ``{site: sae}`` as in ``tl.trace``: the dictionaries are spliced in for this call, and
            ``sites`` may name their sub-sites (``'blocks.6.features'``); every op is then recorded.

    Returns:
        ``{key: value}`` where a module's value is exactly what a forward hook on it sees;
        a selector matching several ops gives a list.

    Raises:
        InvalidArgumentError: ``stop=True`` with an op site, an op edit or a module pass index.
        TokenizerRequiredError: ``x`` is text and no tokenizer is given or set on the model.
        PaddingNotSupportedError: strings of different lengths, and the forward takes no attention_mask.
    """
    model = check_model(model)
    plain = intervene is None and features is None and not stop and backend is None and builtin_engines_only()
    # Plain strings naming modules (the commonest call) need no selector: what binding would make of them.
    reads = _named_modules(model, sites) if plain else None
    selectors = None
    if reads is None:
        selectors = {k: bind(model, as_selector(v)) for k, v in as_sites(sites)}
        reads = _plain_reads(selectors) if plain else None
    args, kwargs = split_inputs(x, model=model, tokenizer=tokenizer)
    if reads is not None:
        got = engines()["hooks"].read(model, args, kwargs, list(dict.fromkeys(reads.values())), grad=grad)
        if type(got) is dict:  # every module ran once: its output, as the trace would hold it
            return {key: got[address] for key, address in reads.items()}
        result = got
        subs: dict[str, Any] = {}
        if selectors is None:
            selectors = {key: ModuleOutput(address) for key, address in reads.items()}
    else:
        splices = feature_steps(model, features) if features is not None else []
        # Sub-sites of a spliced dictionary are read from the splice itself when module hooks serve the rest.
        subs = sub_site_reads(selectors, splices) if splices else {}
        union = None
        for key, sel in selectors.items():
            if key not in subs:
                union = sel if union is None else union | sel
        request = CaptureRequest(model, args, kwargs, record_ops=False, sites=union, save=union, grad=grad,
                                 intervene=splices + _bound_steps(model, intervene) if intervene is not None
                                 else splices)
        if not request.module_only():
            request.record_ops = True
            for key in subs:
                request.sites = request.save = selectors[key] if request.sites is None \
                    else request.sites | selectors[key]
            subs = {}
        if stop:
            _check_stop(request)
            request.stop_after_sites = True
        result = _capture(request, backend)
    out: dict[str, Any] = {}
    for key, sel in selectors.items():
        if key in subs and not result.has_op_graph:
            splice, part, pass_index = subs[key]
            out[key] = splice.sub_site_value(part, pass_index)
            continue
        paths = sel.module_paths()
        if paths is not None and len(paths) == 1:
            out[key] = _module_value(result, paths[0], key)
        else:
            found = result.find_sites(sel)
            out[key] = found.first().out if len(found) == 1 else [s.out for s in found]
    return out


def _named_modules(model: nn.Module, sites: Any) -> dict[str, str] | None:
    """``{site: site}`` when ``sites`` is a string or a list of strings each naming one of ``model``'s
    modules whole (no pass index): what binding makes of them (a module output, every pass, keyed by
    its own text), found without making a selector. None for anything else."""
    if type(sites) is str:
        sites = [sites] if sites else None  # (a bare '' is refused, as as_sites does)
    elif type(sites) is not list and type(sites) is not tuple:
        return None
    if not sites:
        return None
    names = ModelNames(model)
    for site in sites:
        if type(site) is not str or split_pass(site)[1] is not None or not names.is_module(site):
            return None
    return dict(zip(sites, sites))


def _plain_reads(selectors: dict[str, Selector]) -> dict[str, str] | None:
    """``{key: module address}`` when every site is one whole module (no pass index), else None."""
    found = {}
    for key, sel in selectors.items():
        paths = sel.module_paths()
        if paths is None or len(paths) != 1 or split_pass(paths[0])[1] is not None:
            return None
        found[key] = paths[0]
    return found


def _check_stop(request: CaptureRequest) -> None:
    """``extract(stop=True)`` stops on module hooks: every site and edit must be a whole module."""
    paths = [p for sel in request.selectors() for p in (sel.module_paths() or [None])]
    reads = set(request.sites.module_paths() or []) if request.sites is not None else set()
    # A pass index on a read cannot be told apart from an earlier pass once stopped; on an edit it can.
    bad = next((p for p in paths if p is None or (p in reads and module_address(request.model, p)[1] is not None)), 0)
    if bad != 0:
        what = "an op site or op edit" if bad is None else f"the pass index in {bad!r}"
        raise InvalidArgumentError(f"extract(stop=True) stops after module outputs, but the request has {what}",
                                   remedy="Read whole modules (no ':N' pass, no op selectors) or pass stop=False.")


def stops_on_modules(model: nn.Module, sites: Any, intervene: Any = None) -> bool:
    """True when ``extract(model, x, sites, intervene=..., stop=True)`` is allowed (module sites only)."""
    selectors = [bind(model, as_selector(s)) for _, s in as_sites(sites)]
    request = CaptureRequest(model, (), {}, record_ops=False, intervene=_bound_steps(model, intervene))
    request.sites = selectors[0] if selectors else None
    for sel in selectors[1:]:
        request.sites = request.sites | sel
    try:
        _check_stop(request)
    except InvalidArgumentError:
        return False
    return True


def _module_value(result: Trace, path: str, key: str) -> Any:
    address, pass_index = split_pass(path)  # a bound path: the capture hooked that module
    calls = result.calls_of(address)
    if not calls:
        raise SiteNotFoundError(f"module {address!r} exists but did not run in this forward", site=key,
                                remedy="Check the model's forward: this module is skipped for this input.")
    if pass_index is None and len(calls) == 1:  # its one call (what module_call would pick)
        return result.module_output(calls[0])
    # The trace picks the pass (and names the real passes when the address alone is ambiguous).
    return result.module_output(result.module_call(path))

