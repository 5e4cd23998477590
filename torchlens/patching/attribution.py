"""Attribution patching: the first-order estimate of every activation-patching cell at once.

One forward on each prompt and one backward on the corrupted run give, for every site and
position, ``(clean - corrupted) · d metric / d activation`` summed over the features (Nanda,
"Attribution Patching", 2023). It is exact when the metric is linear in the activations (a
linear model), and an estimate otherwise; compare it with exact patching
(:func:`torchlens.patching.activation_patching`) on a subgrid before trusting it.

The backward uses plain autograd through module hooks (``torch.autograd.grad``, so no
parameter's ``.grad`` is touched); the hooks are removed before returning, also on errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..analysis._workflow_inputs import as_trace, model_of
from ..analysis.heads import attention_at
from ..api import trace as capture
from ..arch.resolve import arch
from ..capture._random import refuse_random
from ..core.tree import first_tensor, flatten, unflatten
from ..errors import InvalidArgumentError
from .activation import PatchingResult, _check_pair, _layers, _prompt_ids, site_kind_remedy
from .metrics import score

__all__ = ["ATTRIBUTION_KINDS", "attribution_patching"]

ATTRIBUTION_KINDS = ("resid_pre", "resid_post", "attn", "mlp", "heads")


def attribution_patching(clean: Any, corrupted: Any, metric: Callable[[Any], Any], *, model: Any = None,
                         site: str = "resid_pre", layers: Sequence[int] | None = None,
                         tokenizer: Any = None) -> PatchingResult:
    """Estimate the activation-patching grid of ``site`` from one backward pass.

    Args:
        clean: the clean trace, or its inputs with ``model=``: token ids, or a string / list of
            strings (tokenized with ``tokenizer``).
        corrupted: the corrupted trace, or its inputs with ``model=`` (as ``clean``).
        metric: ``metric(model_output) -> scalar tensor`` (differentiable, e.g.
            :func:`~torchlens.patching.logit_diff`).
        model: the model (default: the traces').
        site: ``resid_pre``, ``resid_post``, ``attn`` or ``mlp`` (a layer × position grid),
            or ``heads`` (a layer × head grid: each head's output at every position, read
            from a ``grad=True`` trace of the corrupted run through the attention facets).
        layers: which blocks (default: all); negative ones count from the end (``-1``: the last).
        tokenizer: tokenizes text prompts (default: the model's ``tokenizer`` attribute).

    Returns:
        a :class:`~torchlens.patching.PatchingResult` over ``("layer", "position")``
        (``("layer", "head")`` for heads): ``estimate`` is the raw first-order change of the
        metric per cell, ``(clean - corrupted) · d metric / d activation`` summed over the
        features (what TransformerLens-style attribution patching computes), and ``values``
        estimates ``metric(patched)``: the corrupted run's metric plus ``estimate`` (comparable
        with :func:`~torchlens.patching.activation_patching`'s values).

    Raises:
        InvalidArgumentError: an unsupported ``site``, a metric that is not a differentiable scalar.
        SiteNotFoundError: a layer out of range, or a site the model's adapter does not give its blocks.
        TokenizerRequiredError: text prompts and no tokenizer.
    """
    if site not in ATTRIBUTION_KINDS:
        raise InvalidArgumentError(f"attribution patching supports site= {ATTRIBUTION_KINDS}, got {site!r}",
                                   remedy="Use activation_patching for resid_mid." if site == "resid_mid" else
                                   site_kind_remedy(site, ATTRIBUTION_KINDS))
    clean, corrupted = as_trace(model, clean, "clean", tokenizer), as_trace(model, corrupted, "corrupted", tokenizer)
    _check_pair(clean, corrupted, metric)
    model = model if model is not None else model_of(corrupted, clean)
    refuse_random("attribution patching", clean, corrupted, model=model)  # its gradients would be a random graph's
    rows = _layers(model, site, layers)
    view = arch(model)
    if site == "heads":
        return _heads(clean, corrupted, metric, model, rows, view)
    donors = [first_tensor(clean[f"blocks.{layer}.{site}"].out) for layer in rows]
    seen: dict[int, torch.Tensor] = {}
    handles = []

    def keep(i: int, pre: bool):
        def hook(module, args, kwargs_or_output):
            if pre:  # a block's hidden-state input: its first positional tensor, else hidden_states=
                value = args[0] if args else kwargs_or_output.get("hidden_states")
            else:
                value = first_tensor(kwargs_or_output)
            if isinstance(value, torch.Tensor):
                seen[i] = value
        return hook

    try:
        handles.extend(_graph_from_embeddings(view))
        for i, layer in enumerate(rows):
            if site == "resid_pre":
                handles.append(view.module(f"blocks.{layer}").register_forward_pre_hook(keep(i, True),
                                                                                           with_kwargs=True))
            else:
                handles.append(view.module(f"blocks.{layer}.{site}").register_forward_hook(keep(i, False)))
        with torch.enable_grad():
            output = model(*corrupted.args, **corrupted.kwargs)
            value = _differentiable(metric(output))
            missing = [rows[i] for i in range(len(rows)) if i not in seen]
            if missing:
                raise InvalidArgumentError(f"blocks {missing} did not produce a {site} value in the forward")
            grads = torch.autograd.grad(value, [seen[i] for i in range(len(rows))], allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    seq = donors[0].shape[1]
    values = torch.zeros(len(rows), seq)
    for i, (g, donor) in enumerate(zip(grads, donors)):
        if g is None:
            continue
        delta = donor.detach() - seen[i].detach()
        values[i] = (delta * g).sum(-1).sum(0).detach().float()
    base_clean, base_corrupted = score(metric, clean.output), float(value.detach())
    return PatchingResult(values + base_corrupted, ("layer", "position"), {"layer": rows, "position": list(range(seq))},
                          getattr(metric, "__name__", "metric"), base_clean, base_corrupted,
                          {"estimate": "first-order (attribution patching)", "ids": _prompt_ids(clean)},
                          estimate=values)


def _heads(clean: Any, corrupted: Any, metric: Callable[[Any], Any], model: Any, rows: list[int],
           view: Any) -> PatchingResult:
    """Attribution of each head's output: ``(clean - corrupted) · d metric / d output`` summed over
    that head's slice at every position, the gradient read from a ``grad=True`` trace."""
    handles = _graph_from_embeddings(view)
    try:
        with torch.enable_grad():
            traced = capture(model, *corrupted.args, grad=True, **corrupted.kwargs)
            value = _differentiable(metric(traced.output))
            labels = [attention_at(traced, layer).target("output") for layer in rows]
            outs = [traced[label].out for label in labels]
            grads = torch.autograd.grad(value, outs, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    n_heads = outs[0].shape[-3]
    values = torch.zeros(len(rows), n_heads)
    for i, (layer, g, out) in enumerate(zip(rows, grads, outs)):
        if g is None:
            continue
        donor = clean[attention_at(clean, layer).target("output")].out  # [batch, heads, positions, head_dim]
        values[i] = ((donor - out.detach()) * g).transpose(0, -3).flatten(1).sum(1).detach().float()
    base_clean, base_corrupted = score(metric, clean.output), float(value.detach())
    return PatchingResult(values + base_corrupted, ("layer", "head"), {"layer": rows, "head": list(range(n_heads))},
                          getattr(metric, "__name__", "metric"), base_clean, base_corrupted,
                          {"estimate": "first-order (attribution patching)"}, estimate=values)


def _graph_from_embeddings(view: Any) -> list[Any]:
    """Hooks making the backward graph start at the embeddings, whatever ``requires_grad`` says
    (a frozen model); the caller removes them."""

    def leaf(module, args, output):
        leaves, spec = flatten(output)
        return unflatten([t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
                          else t for t in leaves], spec)

    return [view.module("embed").register_forward_hook(leaf)] if "embed" in view.names() else []


def _differentiable(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
        raise InvalidArgumentError("attribution patching needs a metric that returns a differentiable "
                                   "scalar tensor of the model output",
                                   remedy="Compute the metric with torch ops on the logits "
                                   "(e.g. tl.patching.logit_diff).")
    return value
