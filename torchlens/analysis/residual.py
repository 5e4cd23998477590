"""Residual stream views: the accumulated residual at every layer boundary.

``accumulated_resid(trace)`` stacks the residual stream at the ``n_layers + 1`` layer
boundaries of a decoder, read from the canonical sites of the architecture adapter (so one
call works on GPT-2, Llama, NeoX ... ): row 0 is the embeddings' output (``blocks.0.resid_pre``),
row ``L`` is ``blocks.{L-1}.resid_post`` (= ``blocks.{L}.resid_pre``), the last row the final
residual, the final norm's input. The rows and their order are TransformerLens's
``cache.accumulated_resid()`` (labels ``0_pre`` ... ``final_post``).

Two ways of applying the final norm (``apply_ln=``):

* ``True`` / ``"per_row"``: the model's own final-norm module on each row, each with its own
  statistics. This is what TransformerLens 3.9's ``accumulated_resid(apply_ln=True)`` computes
  for the full stack, and what the logit lens reads.
* ``"final_scale"``: each row centred (LayerNorm models) and divided by the final norm's scale
  *of the actual run* (computed from the final residual), with no weight or bias: exactly
  TransformerLens's ``cache.apply_ln_to_stack(stack)``, the convention of direct logit attribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from ..arch.resolve import arch
from ..arch.views import ArchView
from ..core.indices import python_indices
from ..core.records import ModuleCall
from ..core.sites import Site
from ..core.trace import Trace
from ..core.tree import first_tensor
from ..errors import InvalidArgumentError, SiteNotFoundError, UnsupportedModelError
from ._workflow_inputs import as_trace, model_of

__all__ = ["APPLY_LN", "FinalNorm", "accumulated_resid", "final_norm_scale", "final_stage", "find_final_norm",
           "resid_labels"]

APPLY_LN = (False, True, "per_row", "final_scale")

_OWN_NORM = "Use apply_ln=True (the model's own norm on each row), or divide by the scale yourself."

# Ops between the final norm and the unembedding that only move values around.
_PASS_THROUGH = frozenset({"view", "reshape", "getitem", "contiguous", "to", "float", "flatten", "dropout"})


def find_final_norm(trace: Trace) -> str:
    """The address of the module whose output feeds the unembedding ('' when there is none).

    Raises:
        SiteNotFoundError: the unembedding did not run in this trace.
    """
    model = model_of(trace)
    unembed = arch(model).resolve("unembed")
    calls = trace.calls_of(unembed)
    if not calls or not trace.has_op_graph:
        raise SiteNotFoundError(f"the unembedding {unembed!r} did not run in this trace (or no ops were recorded)",
                                site="unembed", remedy="Capture with tl.trace(model, ids) on the LM-head model.")
    call: ModuleCall = calls[-1]
    trace.ensure_graph()
    op = trace.ops[call.op_start] if call.op_start < len(trace.ops) else None
    refs = list(op.parent_refs) if op is not None else []
    while refs:
        parent = trace.ops[refs[0].index]
        if parent.module and not parent.module.startswith(unembed) and parent.func_name not in _PASS_THROUGH:
            return parent.module if parent.module != arch(model).blocks[-1] else ""
        if parent.func_name not in _PASS_THROUGH:
            return ""
        refs = list(parent.parent_refs)
    return ""


def final_stage(trace: Trace) -> str:
    """The module that maps the final residual to the unembedding's input, as this run computed it ('' for none).

    The final norm (:func:`find_final_norm`) where its input is the final residual (GPT-2's ``ln_f``, Llama's
    ``norm``); else the nearest module holding it whose input is (BERT's LM head computes
    ``LayerNorm(gelu(dense(x)))``: ``cls.predictions.transform``), so a row read through it is what the
    unembedding would read.

    Raises:
        UnsupportedModelError: no module between the final residual and the unembedding does that.
        SiteNotFoundError: the unembedding did not run in this trace.
    """
    norm = find_final_norm(trace)
    if not norm:
        return ""
    model = model_of(trace)
    view = arch(model)
    final = _boundary(trace, view, view.n_layers)
    unembed_call = trace.calls_of(view.resolve("unembed"))[-1]
    read = _hidden_arg(unembed_call)
    parts = norm.split(".")
    for address in (".".join(parts[:n]) for n in range(len(parts), 0, -1)):
        calls = trace.calls_of(address)
        if not calls:
            continue
        x, out = _hidden_arg(calls[-1]), first_tensor(Site(trace, calls[-1]).out)
        if address == norm and not all(isinstance(t, torch.Tensor) for t in (x, out, final, read)):
            return norm  # values this capture did not keep: nothing to check the norm against
        if _same(x, final) and _same(out, read):
            return address
    raise UnsupportedModelError(
        f"the unembedding's input is not a module of the final residual: {norm!r} feeds it, but neither it nor a "
        "module holding it reads the last block's output", site="unembed",
        remedy="Pass norm= the module whose output the unembedding reads when given the final residual, or "
        "norm=False to unembed the raw residual.")


def _hidden_arg(call: ModuleCall) -> Any:
    args, kwargs = call.args or (), call.kwargs or {}
    return args[0] if args else kwargs.get("hidden_states", kwargs.get("input"))


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def resid_labels(n_layers: int, rows: Sequence[int] | None = None) -> list[str]:
    """TransformerLens's labels of the layer boundaries: ``0_pre`` ... ``{n-1}_pre``, ``final_post``."""
    rows = range(n_layers + 1) if rows is None else rows
    return ["final_post" if r == n_layers else f"{r}_pre" for r in rows]


class FinalNorm(NamedTuple):
    """The final norm as one run applied it: ``out = (x - mean if centred) / scale * weight + bias``."""

    scale: torch.Tensor  # [..., 1], float32: sqrt(mean(x_centred²) + eps) of the final residual
    weight: torch.Tensor  # [d_model] (ones for a norm without one)
    centred: bool  # LayerNorm: the mean is subtracted first; RMSNorm: not
    bias: torch.Tensor | None


def final_norm_scale(trace: Trace, address: str, final: torch.Tensor, *, remedy: str) -> FinalNorm:
    """The final norm at ``address`` as this run applied it to ``final`` (its input, the final residual).

    The one rule for the final norm's scale (``accumulated_resid(apply_ln="final_scale")``,
    ``apply_ln_to_stack``, ``logit_attrs``): a ``nn.LayerNorm`` centres and divides by
    ``sqrt(var + eps)``; any other norm with a float ``eps`` / ``variance_epsilon`` is taken as
    an RMSNorm, ``sqrt(mean(x²) + eps)``. Either way the norm's recorded output must equal
    ``(x - mean if centred) / scale * weight + bias``, else the norm is of another kind
    (Gemma's ``1 + weight``, a group norm ...) and is refused.

    Raises:
        UnsupportedModelError: the module is neither a LayerNorm nor an RMSNorm with weight and eps
            (``remedy`` says what the caller can do instead).
    """
    norm = model_of(trace).get_submodule(address)
    name = type(norm).__name__
    centred = isinstance(norm, nn.LayerNorm)
    eps = next((getattr(norm, a) for a in ("eps", "variance_epsilon") if isinstance(getattr(norm, a, None), float)),
               None)
    d_model = final.size(-1)
    weight = getattr(norm, "weight", None)
    weight = torch.ones(d_model, dtype=final.dtype, device=final.device) if weight is None else weight
    bias = getattr(norm, "bias", None) if centred else None
    if eps is None or not isinstance(weight, torch.Tensor) or weight.shape != (d_model,):
        raise UnsupportedModelError(f"the final-norm scale is defined for LayerNorm and RMSNorm final norms (with "
                                    f"weight and eps); {address!r} is a {name}", remedy=remedy)
    with torch.no_grad():
        x = final.float()
        if centred:
            x = x - x.mean(-1, keepdim=True)
        scale = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        normed = x / scale * weight.float() + (bias.float() if bias is not None else 0.0)
    recorded = first_tensor(trace[address].out)
    tol = max(1e-3, 4 * torch.finfo(recorded.dtype).eps)
    if recorded.shape != normed.shape or not torch.allclose(normed, recorded.float(), atol=tol, rtol=tol):
        raise UnsupportedModelError(
            f"the final-norm scale is defined for LayerNorm and RMSNorm final norms; {address!r} ({name}) does not "
            f"compute (x{' - mean' if centred else ''}) / scale * weight (+ bias) with its weight and eps",
            remedy=remedy)
    return FinalNorm(scale, weight, centred, bias)


def _positions(t: torch.Tensor, pos_slice: Any) -> torch.Tensor:
    """TransformerLens's ``pos_slice`` on the position axis (-2): an int drops the axis; a tuple is a slice's
    arguments (``(1, 4)``: positions 1 to 3, as TransformerLens's ``Slice``), a list the positions themselves."""
    if pos_slice is None:
        return t
    if isinstance(pos_slice, tuple):
        pos_slice = slice(*pos_slice)
    if isinstance(pos_slice, slice):  # a slice clips to the axis, as in Python and TransformerLens
        return t[..., pos_slice, :]
    seq = t.shape[-2]
    axis = f"the trace has {seq} positions"
    if isinstance(pos_slice, int) and not isinstance(pos_slice, bool):  # out of range: refused, never wrapped
        return t[..., python_indices(pos_slice, seq, what="position", axis=axis)[0], :]
    if isinstance(pos_slice, (str, bytes, bool)) or not hasattr(pos_slice, "__iter__"):
        raise InvalidArgumentError(f"pos_slice is an int, a slice or a list of ints, got {pos_slice!r}",
                                   remedy="pos_slice=-1 (the last position), slice(2, 5) or [0, 3].")
    index = python_indices(pos_slice, seq, what="position", axis=axis)
    return t.index_select(-2, torch.tensor(index, dtype=torch.long, device=t.device))


def _final_norm(trace: Trace, norm: str | bool) -> str:
    if norm is True:
        return final_stage(trace)
    if norm is False:
        return ""
    if not isinstance(norm, str):
        raise InvalidArgumentError(f"norm= is True, False or a module address, got {type(norm).__name__}",
                                   remedy="norm=True finds the final norm; norm='transformer.ln_f' names it.")
    return norm


def accumulated_resid(trace: Any, inputs: Any = None, *, layers: Sequence[int] | int | None = None,
                      apply_ln: bool | str = False, pos_slice: Any = None, norm: str | bool = True,
                      return_labels: bool = False, tokenizer: Any = None,
                      ) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
    """The residual stream at every layer boundary, ``[n_layers + 1, batch, position, d_model]``.

    Row 0 is the embeddings' output (``blocks.0.resid_pre``); row ``L`` the output of block
    ``L-1`` (``blocks.{L}.resid_pre``); the last row the final residual. TransformerLens:
    ``cache.accumulated_resid()``.

    Args:
        trace: a trace (``tl.trace(model, ids)``), or a model with ``inputs``.
        inputs: the model's inputs when ``trace`` is a model: token ids, or text (with ``tokenizer``).
        layers: which rows (default: all ``n_layers + 1``); ``-1`` is the final residual.
        apply_ln: False (default): the raw residual. True or ``"per_row"``: the final-norm
            module on each row (TransformerLens 3.9's ``accumulated_resid(apply_ln=True)``).
            ``"final_scale"``: centred (LayerNorm) and divided by the final norm's scale from
            this run's final residual, no weight or bias (TransformerLens's ``apply_ln_to_stack``).
        pos_slice: positions to keep: an int (the axis is dropped), a slice (or a tuple of its arguments,
            ``(1, 4)``, as TransformerLens reads one), or a list of ints.
        norm: the final norm, as in ``tl.logit_lens`` (True: found from the trace; an address; False: none).
        return_labels: also return TransformerLens's row labels (``0_pre`` ... ``final_post``).
        tokenizer: tokenizes text ``inputs`` (default: the model's ``tokenizer`` attribute).

    Raises:
        InvalidArgumentError: a bad ``apply_ln``, ``norm`` or ``pos_slice``, or a model without inputs.
        SiteNotFoundError: a row out of range, or a residual site this trace lacks.
        UnsupportedModelError: ``"final_scale"`` on a final norm that is neither LayerNorm nor RMSNorm.
        TokenizerRequiredError: text ``inputs`` and no tokenizer.
    """
    if not any(apply_ln is v or (isinstance(v, str) and apply_ln == v) for v in APPLY_LN):
        raise InvalidArgumentError(f"apply_ln is False, True, 'per_row' or 'final_scale', got {apply_ln!r}",
                                   remedy="apply_ln=True normalises each row; 'final_scale' uses the final "
                                   "residual's scale (TransformerLens's apply_ln_to_stack).")
    trace = _trace_of(trace, inputs, "accumulated_resid", tokenizer)
    model = model_of(trace)
    view = arch(model)
    rows = view.layer_indices(layers, boundaries=True)
    stack = torch.stack([_boundary(trace, view, r) for r in rows])
    address = _final_norm(trace, norm) if apply_ln is not False else ""
    with torch.no_grad():
        if address and apply_ln == "final_scale":
            applied = final_norm_scale(trace, address, _boundary(trace, view, view.n_layers), remedy=_OWN_NORM)
            stack = ((stack - stack.mean(-1, keepdim=True)) if applied.centred else stack) / applied.scale.to(
                stack.dtype)
        elif address:
            stack = model.get_submodule(address)(stack)
    stack = _positions(stack, pos_slice)
    return (stack, resid_labels(view.n_layers, rows)) if return_labels else stack


def _trace_of(trace: Any, inputs: Any, name: str, tokenizer: Any = None) -> Trace:
    """``trace``, or the model ``trace`` run on ``inputs`` (token ids, or text through ``tokenizer``)."""
    if isinstance(trace, Trace):
        return trace
    if inputs is None:
        raise InvalidArgumentError(f"{name} takes a trace, or a model and its inputs",
                                   remedy=f"tl.{name}(tl.trace(model, ids)) or tl.{name}(model, ids).")
    return as_trace(trace, inputs, "inputs", tokenizer)


def _boundary(trace: Trace, view: ArchView, row: int) -> torch.Tensor:
    """Layer boundary ``row``: ``blocks.{row}.resid_pre``, or the last block's output for ``n_layers``.

    Matched through the view's selector (not ``trace[name]``, whose canonical-name path also
    ranks near-miss module names, ~50 ms a lookup on GPT-2 small); a site that is not exactly
    one record goes through ``trace[name]`` for its error.
    """
    n = view.n_layers
    site = f"blocks.{n - 1}.resid_post" if row == n else f"blocks.{row}.resid_pre"
    found = view.selector(site).match(trace)
    return first_tensor((Site(trace, found[0]) if len(found) == 1 else trace[site]).out)
