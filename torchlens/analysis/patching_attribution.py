"""Attribution patching: the first-order estimate of every activation-patching cell at once.

One forward on each prompt and one backward on the corrupted run give, for every site and
position, ``(clean - corrupted) · d metric / d activation`` summed over the features (Nanda,
"Attribution Patching", 2023). It is exact when the metric is linear in the activations (a
linear model), and an estimate otherwise; compare it with exact patching
(:func:`torchlens.analysis.patching.activation_patching`) on a subgrid before trusting it.

The backward uses plain autograd through module hooks (``torch.autograd.grad``, so no
parameter's ``.grad`` is touched); the hooks are removed before returning, also on errors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..arch.resolve import arch
from ..core.tree import first_tensor, flatten, unflatten
from ..errors import InvalidArgumentError
from .patching import PatchingResult, _as_trace, _check_pair, _layers, _model_of, _score

__all__ = ["ATTRIBUTION_KINDS", "attribution_patching"]

ATTRIBUTION_KINDS = ("resid_pre", "resid_post", "attn", "mlp")


def attribution_patching(clean: Any, corrupted: Any, metric: Callable[[Any], Any], *, model: Any = None,
                         site: str = "resid_pre", layers: Sequence[int] | None = None) -> PatchingResult:
    """Estimate the activation-patching grid of ``site`` from one backward pass.

    Args:
        clean: the clean trace, or its input ids with ``model=``.
        corrupted: the corrupted trace, or its input ids with ``model=``.
        metric: ``metric(model_output) -> scalar tensor`` (differentiable, e.g.
            :func:`~torchlens.analysis.patching.logit_diff`).
        model: the model (default: the traces').
        site: ``resid_pre``, ``resid_post``, ``attn`` or ``mlp``.
        layers: which blocks (default: all).

    Returns:
        a :class:`~torchlens.analysis.patching.PatchingResult` over ``("layer", "position")``
        whose values estimate ``metric(patched) - metric(corrupted)`` (``notes["estimate"]``).

    Raises:
        InvalidArgumentError: an unsupported ``site``, a metric that is not a differentiable scalar.
    """
    if site not in ATTRIBUTION_KINDS:
        raise InvalidArgumentError(f"attribution patching supports site= {ATTRIBUTION_KINDS}, got {site!r}",
                                   remedy="Use activation_patching for resid_mid and heads.")
    clean, corrupted = _as_trace(model, clean, "clean"), _as_trace(model, corrupted, "corrupted")
    _check_pair(clean, corrupted)
    model = model if model is not None else _model_of(corrupted, clean)
    rows = _layers(model, site, layers)
    view = arch(model)
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

    def leaf(module, args, output):  # the graph starts at the embeddings, whatever requires_grad says
        leaves, spec = flatten(output)
        return unflatten([t.detach().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point()
                          else t for t in leaves], spec)

    try:
        if "embed" in view.names():
            handles.append(view.module("embed").register_forward_hook(leaf))
        for i, layer in enumerate(rows):
            if site == "resid_pre":
                handles.append(view.module(f"blocks.{layer}").register_forward_pre_hook(keep(i, True),
                                                                                           with_kwargs=True))
            else:
                handles.append(view.module(f"blocks.{layer}.{site}").register_forward_hook(keep(i, False)))
        with torch.enable_grad():
            output = model(*corrupted.args, **corrupted.kwargs)
            value = metric(output)
            if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
                raise InvalidArgumentError("attribution patching needs a metric that returns a differentiable "
                                           "scalar tensor of the model output",
                                           remedy="Compute the metric with torch ops on the logits "
                                           "(e.g. tl.patching.logit_diff).")
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
    base_clean, base_corrupted = _score(metric, clean.output), float(value.detach())
    return PatchingResult(values + base_corrupted, ("layer", "position"), {"layer": rows, "position": list(range(seq))},
                          getattr(metric, "__name__", "metric"), base_clean, base_corrupted,
                          {"estimate": "first-order (attribution patching)"})
