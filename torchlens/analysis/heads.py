"""Head-level interventions: ablate, patch or set one attention head's output or pattern.

``patch_head(trace, layer, head, ...)`` returns a fork with the edit pushed down the
recorded graph. On a model whose attention is one fused ``scaled_dot_product_attention``
op, the head's slice of that op's output is replaced; a new *pattern* is applied by
recomputing that head as ``pattern @ v`` from the op's recorded inputs, so nothing has to
be reloaded in eager mode. On an eager model the same call edits the real ``softmax`` /
``matmul`` ops. The edit itself is a named helper (``HeadPatch``), so it also works during
capture: ``tl.trace(model, x, intervene=tl.when(op_label, head_edit(h, ...)))``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..arch.resolve import resolve_canonical, view_or_none
from ..core.fork import Fork
from ..core.indices import python_indices
from ..core.records import Op
from ..core.sites import Site
from ..core.trace import Trace
from ..edit.helpers import Helper
from ..errors import (
    EditShapeError,
    FusedKernelError,
    InvalidArgumentError,
    ReplayNotExactError,
    SiteNotFoundError,
)
from ..hookspecs import hookimpl
from .facets import SDPA, _Facets, attention_facets, expand_kv, facets_for_site, facets_of_op, sdpa_arguments

WHATS = ("output", "pattern", "scores")
_FACET_OF = {"output": "head_out", "pattern": "pattern", "scores": "scores"}


# -- the edit ---------------------------------------------------------------------------------


class HeadPatch(Helper):
    """Replace one head's slice (dim -3) of an attention op's output.

    On a ``scaled_dot_product_attention`` op, ``what='output'`` sets the head's output and
    ``what='pattern'`` sets its attention pattern and recomputes the head as ``pattern @ v``
    from the op's recorded v. On any other op (an eager softmax or matmul) the head's slice
    of that op is set. ``value``: None (zeros), a tensor broadcasting to the slice, or a
    trace whose same op supplies it. ``positions``: the query positions (dim -2 of the slice)
    set, the rest of the head left as it is (None: every position; negative ones count from
    the end).
    """

    name = "patch_head"

    def __init__(self, head: int, what: str = "output", value: Any = None,
                 positions: list[int] | None = None) -> None:
        self.head = _check_head_index(head)
        self.what = _check_what(what)
        if value is not None and not isinstance(value, (torch.Tensor, Trace)):
            raise InvalidArgumentError(
                f"a head patch's value is None (zero-ablate), a tensor or a trace; got {type(value).__name__}"
            )
        self.value = value
        self.positions = None if positions is None else [positions] if isinstance(positions, int) \
            else list(positions)

    def params(self) -> dict[str, Any]:
        found = {"head": self.head, "what": self.what, "value": self.value}
        if self.positions is not None:  # recipes saved before positions existed stay equal
            found["positions"] = self.positions
        return found

    def __call__(self, activation: Any, *, ctx: Any) -> torch.Tensor:
        op = ctx.op
        if not isinstance(op, Op) or not isinstance(activation, torch.Tensor) or activation.dim() < 3:
            raise InvalidArgumentError(
                f"patch_head edits an attention op's per-head tensor; {ctx.site} is not one",
                site=ctx.site,
                remedy="Use torchlens.mechinterp.patch_head(trace, layer, head), or select the "
                "scaled_dot_product_attention op (eager: the softmax or matmul op).",
            )
        n_heads = activation.size(-3)
        if self.head >= n_heads:
            raise InvalidArgumentError(f"head {self.head} does not exist at {ctx.label} ({n_heads} heads)",
                                       site=ctx.label, remedy=f"Pick a head between 0 and {n_heads - 1}.")
        fused = op.func_name == SDPA
        if fused and self.what == "scores":
            raise FusedKernelError(f"the scores of {ctx.label} exist only inside the fused attention kernel",
                                   site=ctx.label)
        out = activation.clone()
        slot = out.select(-3, self.head)
        value = self._value(ctx)
        if fused and self.what == "pattern":
            new = _head_from_pattern(ctx, op, activation, self.head, value)
        else:
            new = torch.zeros_like(slot) if value is None else value
        _check_broadcast(new, slot.shape, ctx.label, self.what)
        if self.positions is None:
            slot.copy_(new)
        else:
            rows = python_indices(self.positions, slot.size(-2), what="position",
                                  axis=f"{ctx.label} has {slot.size(-2)} query positions")
            slot[..., rows, :] = new.expand(slot.shape)[..., rows, :]
        return out

    def _value(self, ctx: Any) -> torch.Tensor | None:
        if isinstance(self.value, Trace):  # resolved per op: the same op of another run
            site = self.value[ctx.label]
            if site.record.func_name != SDPA:  # an eager op: its own head slice is the donor
                return site.out.select(-3, self.head).clone()
            donor = facets_of_op(self.value, site.record)
            if donor is None:
                raise SiteNotFoundError(f"{ctx.label} of the source trace is not an attention op", site=ctx.label)
            return _donor_slice(donor, self.what, self.head)
        return self.value


def head_edit(head: int, source: Any = None, what: str = "output", positions: list[int] | None = None) -> HeadPatch:
    """The edit ``patch_head`` applies, for ``tl.when`` (capture time) or ``fork.do``.

    Select the attention op itself: the ``scaled_dot_product_attention`` op of a fused model
    (for ``what='output'`` or ``'pattern'``), or on an eager model the op that holds the
    tensor (the matmul for outputs, the softmax for patterns). ``positions``: only these query
    positions of the head (None: all).
    """
    return HeadPatch(head, what, source, positions)


def _head_from_pattern(ctx: Any, op: Op, activation: torch.Tensor, head: int, pattern: Any) -> torch.Tensor:
    """Recompute one head of a fused attention op as ``pattern @ v`` from its recorded v."""
    trace = ctx.trace
    args = sdpa_arguments(trace, op)
    if float(args["dropout_p"] or 0.0) > 0.0:
        raise FusedKernelError(
            f"{op.label} applies dropout inside the fused kernel; a recomputed head would not match it",
            site=op.label,
            remedy="Call model.eval() before capturing, or re-capture with attn_implementation='eager'.",
        )
    if not hasattr(trace, "recipe") and op.saved and op._out is not None and not torch.equal(activation, op.out):
        # A capture-time edit re-applied on a fork whose upstream changed: its context still
        # points at the original run, whose v is no longer the one this op saw.
        raise ReplayNotExactError(
            f"the pattern edit at {op.label} was made during capture; after an upstream edit its recorded v "
            "is stale",
            op_label=op.label,
            remedy="Re-execute: fork.do(site, edit, model=model, inputs=x), or apply the pattern edit on the fork "
            "with patch_head.",
        )
    v = expand_kv(args["value"], activation.size(-3)).select(-3, head)
    if pattern is None:
        return torch.zeros_like(activation.select(-3, head))
    want = (*v.shape[:-2], activation.size(-2), v.size(-2))
    _check_broadcast(pattern, want, op.label, "pattern")
    return torch.matmul(pattern.to(v.dtype).expand(want), v)


def _check_broadcast(value: torch.Tensor, shape: Any, label: str, what: str) -> None:
    try:
        ok = torch.broadcast_shapes(value.shape, shape) == tuple(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise EditShapeError(
            f"a head {what} of shape {tuple(value.shape)} does not broadcast to {tuple(shape)} at {label}",
            site=label,
            edit_shape=tuple(value.shape),
            activation_shape=tuple(shape),
            remedy=f"Give a tensor broadcasting to {tuple(shape)} (one head's {what}), or patch between prompts "
            "of the same length.",
        )


def _check_head_index(head: Any) -> int:
    if isinstance(head, bool) or not isinstance(head, int) or head < 0:
        raise InvalidArgumentError(f"head must be a non-negative int, got {head!r}")
    return head


def _check_what(what: Any) -> str:
    if what not in WHATS:
        raise InvalidArgumentError(f"what= is one of {WHATS}, got {what!r}",
                                   remedy="Use 'output' (the head's output before the output projection) or "
                                   "'pattern' (its attention weights).")
    return what


def _donor_slice(facets: _Facets, what: str, head: int) -> torch.Tensor:
    attr = _FACET_OF[what]
    if head >= facets.n_heads:
        raise InvalidArgumentError(f"the source attention {facets.label} has only {facets.n_heads} heads")
    return getattr(facets, attr).select(-3, head).as_subclass(torch.Tensor).clone()


# -- finding a layer's attention ------------------------------------------------------------


def attention_at(trace: Trace, layer: Any) -> _Facets:
    """The attention of ``layer``: an int (``blocks.{layer}.attn`` through the adapter, else the
    layer-th attention op of the trace; ``-1`` is the last), an op label / module address, or a Site.

    Raises:
        SiteNotFoundError: no such layer, or no attention inside it.
    """
    if isinstance(layer, Site):
        site = layer
    elif isinstance(layer, str):
        site = trace[layer]
    elif isinstance(layer, int) and not isinstance(layer, bool):
        view = view_or_none(trace.model)
        if view is not None and view.n_layers:  # -1: the last block, as in every workflow's layers=
            layer = view.layer_indices([layer])[0]
        site = _canonical_attention(trace, layer)
        if site is None:
            found = attention_facets(trace)
            labels = [f.label for f in found][:6]
            return found[python_indices(layer, len(found), what="layer", error=SiteNotFoundError, site=str(layer),
                                        axis=f"this trace has {len(found)} attention ops ({labels})")[0]]
    else:
        raise InvalidArgumentError(f"layer is an int, an op label, a module address or a Site; got "
                                   f"{type(layer).__name__}")
    facets = facets_for_site(site)
    if facets is None:
        raise SiteNotFoundError(
            f"{site.label} holds no attention (no scaled_dot_product_attention or softmax-matmul ops)",
            site=site.label,
            remedy="Pass the attention module (e.g. 'blocks.0.attn') or the attention op's label.",
        )
    return facets


def _canonical_attention(trace: Trace, layer: int) -> Site | None:
    path = f"blocks.{layer}.attn"
    try:
        real = resolve_canonical(trace.model, path) if trace.model is not None else None
    except Exception:  # noqa: BLE001 - no adapter (or a broken one): fall back to op order
        return None
    calls = trace.calls_of(real) if real is not None else None
    if not calls or len(calls) != 1:
        return None
    return Site(trace, calls[0])


def _named_inputs(trace: Trace) -> Any:
    """The trace's inputs in the one form ``fork.do(..., inputs=)`` takes."""
    args, kwargs = trace.args, trace.kwargs
    if not kwargs:
        return tuple(args)
    if not args:
        return dict(kwargs)
    try:
        bound = inspect.signature(trace.model.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    named: dict[str, Any] = {}
    for pname, value in (bound.arguments.items() if bound else ()):
        kind = bound.signature.parameters[pname].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                bound = None
                break
        elif kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[pname] = value
    if bound is None:
        raise InvalidArgumentError(
            "cannot re-run this trace's inputs by name (positional and keyword inputs mixed)",
            remedy="Capture with keyword inputs only (model(input_ids=..., attention_mask=...)), or use rerun=False.",
        )
    return named


# -- the public call -------------------------------------------------------------------------


def patch_head(trace: Trace, layer: Any, head: int, source: Any = None, what: str = "output", *,
               positions: list[int] | None = None, name: str | None = None, rerun: bool = False) -> Fork:
    """Ablate, patch or set one attention head, on a new fork of ``trace``.

    Args:
        trace: the captured trace (or a fork) to branch from; it is never changed.
        layer: an int (``blocks.{layer}.attn``, else the layer-th attention op), an op label,
            a module address, or a Site.
        head: the query head (0-based).
        source: None zero-ablates; another trace patches the same head from that run (same
            sequence length); a tensor sets the value (broadcasting to one head's slice).
        what: ``'output'`` (the head's output before the output projection, [batch, q,
            head_dim]) or ``'pattern'`` (its attention weights, [batch, q, k]; on a fused
            model the head is recomputed as ``pattern @ v``). ``'scores'`` works on eager
            models only.
        positions: only these query positions of the head are set (its output rows, or its
            pattern rows); None: every position. Negative ones count from the end.
        name: the fork's name.
        rerun: re-execute the real forward with the edit applied during capture instead of
            replaying the recorded graph.

    Returns:
        the fork holding the edit (its ``output`` is the edited model output).

    Raises:
        FusedKernelError: the edit targets an intermediate of a fused kernel (scores).
        SiteNotFoundError / InvalidArgumentError / EditShapeError: bad layer, head or value.
    """
    label, edit = head_patch_site(trace, layer, head, source, what, positions=positions)
    at = "" if positions is None else f"@{positions}"
    fork = trace.fork(name or f"{trace.name}/patch_head[{layer}.{head}.{what}{at}]")
    if rerun:
        return fork.do(label, edit, model=trace.model, inputs=_named_inputs(trace))
    return fork.do(label, edit)


def head_patch_site(trace: Trace, layer: Any, head: int, source: Any = None, what: str = "output", *,
                    positions: list[int] | None = None) -> tuple[str, HeadPatch]:
    """The op label :func:`patch_head` edits and the edit it applies there (every argument checked).

    Raises:
        the errors of :func:`patch_head`.
    """
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(f"patch_head takes a Trace (tl.trace(model, x)), got {type(trace).__name__}")
    what = _check_what(what)
    head = _check_head_index(head)
    facets = attention_at(trace, layer)
    if head >= facets.n_heads:
        raise InvalidArgumentError(f"head {head} does not exist in {facets.label} ({facets.n_heads} heads)",
                                   site=facets.label, remedy=f"Pick a head between 0 and {facets.n_heads - 1}.")
    label = facets.target(what)  # FusedKernelError for the scores of a fused op
    if isinstance(source, Trace):
        value = _donor_slice(attention_at(source, layer), what, head)
    elif source is None or isinstance(source, torch.Tensor):
        value = source
    else:
        raise InvalidArgumentError(
            f"source= is None (zero-ablate), a trace or a tensor; got {type(source).__name__}")
    if value is not None or positions is not None:
        ref = getattr(facets, _FACET_OF[what]).select(-3, head)
        if value is not None:
            _check_broadcast(value, ref.shape, facets.label, what)
        if positions is not None:
            positions = python_indices(positions, ref.size(-2), what="position",
                                       axis=f"{facets.label} has {ref.size(-2)} query positions")
    return label, HeadPatch(head, what, value, positions)


class HeadsPlugin:
    """Registers the ``patch_head`` edit helper, so recipes holding head patches load by name."""

    @staticmethod
    @hookimpl
    def torchlens_helpers():
        return [HeadPatch]


__all__ = ["HeadPatch", "HeadsPlugin", "attention_at", "head_edit", "head_patch_site", "patch_head"]
