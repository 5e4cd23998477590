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
from typing import Any

import torch
from torch import nn

from ..arch.resolve import arch
from ..arch.views import ArchView
from ..core.records import ModuleCall
from ..core.sites import Site
from ..core.trace import Trace
from ..core.tree import first_tensor
from ..errors import InvalidArgumentError, SiteNotFoundError, UnsupportedModelError
from .patching import _as_trace, _model_of

__all__ = ["APPLY_LN", "accumulated_resid", "final_norm_scale", "find_final_norm", "resid_labels"]

APPLY_LN = (False, True, "per_row", "final_scale")

# Ops between the final norm and the unembedding that only move values around.
_PASS_THROUGH = frozenset({"view", "reshape", "getitem", "contiguous", "to", "float", "flatten", "dropout"})


def find_final_norm(trace: Trace) -> str:
    """The address of the module whose output feeds the unembedding ('' when there is none).

    Raises:
        SiteNotFoundError: the unembedding did not run in this trace.
    """
    model = _model_of(trace)
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


def resid_labels(n_layers: int, rows: Sequence[int] | None = None) -> list[str]:
    """TransformerLens's labels of the layer boundaries: ``0_pre`` ... ``{n-1}_pre``, ``final_post``."""
    rows = range(n_layers + 1) if rows is None else rows
    return ["final_post" if r == n_layers else f"{r}_pre" for r in rows]


def final_norm_scale(norm: nn.Module, final: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The scale ``[..., 1]`` the final norm divided ``final`` (its input) by, and whether it centres.

    LayerNorm: ``sqrt(var + eps)`` and centring; RMSNorm (a module with ``variance_epsilon``
    or ``eps`` and RMS in its class name): ``sqrt(mean(x²) + eps)``, no centring.

    Raises:
        UnsupportedModelError: a norm of another kind.
    """
    name = type(norm).__name__
    if isinstance(norm, nn.LayerNorm):
        return (final.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt(), True
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if "rms" in name.lower() and isinstance(eps, float):
        return (final.pow(2).mean(-1, keepdim=True) + eps).sqrt(), False
    raise UnsupportedModelError(
        f"apply_ln='final_scale' knows LayerNorm and RMSNorm final norms; this model's is a {name}",
        remedy="Use apply_ln=True (the model's own norm on each row), or divide by the scale yourself.")


def _positions(t: torch.Tensor, pos_slice: Any) -> torch.Tensor:
    """TransformerLens's ``pos_slice`` on the position axis (-2): an int drops the axis."""
    if pos_slice is None:
        return t
    if isinstance(pos_slice, (int, slice)) and not isinstance(pos_slice, bool):
        return t[..., pos_slice, :]
    try:
        index = torch.as_tensor(list(pos_slice), dtype=torch.long, device=t.device)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"pos_slice is an int, a slice or a list of ints, got {pos_slice!r}",
                                   remedy="pos_slice=-1 (the last position), slice(2, 5) or [0, 3].") from None
    return t.index_select(-2, index % t.shape[-2])


def _final_norm(trace: Trace, norm: str | bool) -> str:
    if norm is True:
        return find_final_norm(trace)
    if norm is False:
        return ""
    if not isinstance(norm, str):
        raise InvalidArgumentError(f"norm= is True, False or a module address, got {type(norm).__name__}",
                                   remedy="norm=True finds the final norm; norm='transformer.ln_f' names it.")
    return norm


def accumulated_resid(trace: Any, inputs: Any = None, *, layers: Sequence[int] | int | None = None,
                      apply_ln: bool | str = False, pos_slice: Any = None, norm: str | bool = True,
                      return_labels: bool = False) -> torch.Tensor | tuple[torch.Tensor, list[str]]:
    """The residual stream at every layer boundary, ``[n_layers + 1, batch, position, d_model]``.

    Row 0 is the embeddings' output (``blocks.0.resid_pre``); row ``L`` the output of block
    ``L-1`` (``blocks.{L}.resid_pre``); the last row the final residual. TransformerLens:
    ``cache.accumulated_resid()``.

    Args:
        trace: a trace (``tl.trace(model, ids)``), or a model with ``inputs``.
        inputs: the model's input ids when ``trace`` is a model.
        layers: which rows (default: all ``n_layers + 1``); ``-1`` is the final residual.
        apply_ln: False (default): the raw residual. True or ``"per_row"``: the final-norm
            module on each row (TransformerLens 3.9's ``accumulated_resid(apply_ln=True)``).
            ``"final_scale"``: centred (LayerNorm) and divided by the final norm's scale from
            this run's final residual, no weight or bias (TransformerLens's ``apply_ln_to_stack``).
        pos_slice: positions to keep: an int (the axis is dropped), a slice, or a list of ints.
        norm: the final norm, as in ``tl.logit_lens`` (True: found from the trace; an address; False: none).
        return_labels: also return TransformerLens's row labels (``0_pre`` ... ``final_post``).

    Raises:
        InvalidArgumentError: a bad ``apply_ln``, ``norm`` or ``pos_slice``, or a model without inputs.
        SiteNotFoundError: a row out of range, or a residual site this trace lacks.
        UnsupportedModelError: ``"final_scale"`` on a final norm that is neither LayerNorm nor RMSNorm.
    """
    if not any(apply_ln is v or (isinstance(v, str) and apply_ln == v) for v in APPLY_LN):
        raise InvalidArgumentError(f"apply_ln is False, True, 'per_row' or 'final_scale', got {apply_ln!r}",
                                   remedy="apply_ln=True normalises each row; 'final_scale' uses the final "
                                   "residual's scale (TransformerLens's apply_ln_to_stack).")
    trace = _trace_of(trace, inputs, "accumulated_resid")
    model = _model_of(trace)
    view = arch(model)
    rows = view.layer_indices(layers, boundaries=True)
    stack = torch.stack([_boundary(trace, view, r) for r in rows])
    address = _final_norm(trace, norm) if apply_ln is not False else ""
    with torch.no_grad():
        if address and apply_ln == "final_scale":
            scale, centre = final_norm_scale(model.get_submodule(address), _boundary(trace, view, view.n_layers))
            stack = ((stack - stack.mean(-1, keepdim=True)) if centre else stack) / scale
        elif address:
            stack = model.get_submodule(address)(stack)
    stack = _positions(stack, pos_slice)
    return (stack, resid_labels(view.n_layers, rows)) if return_labels else stack


def _trace_of(trace: Any, inputs: Any, name: str) -> Trace:
    if isinstance(trace, Trace):
        return trace
    if inputs is None:
        raise InvalidArgumentError(f"{name} takes a trace, or a model and its inputs",
                                   remedy=f"tl.{name}(tl.trace(model, ids)) or tl.{name}(model, ids).")
    return _as_trace(trace, inputs, "inputs")


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
