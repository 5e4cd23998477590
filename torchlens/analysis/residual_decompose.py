"""Residual-stream decomposition and direct logit attribution, TransformerLens-style.

``decompose_resid(trace, layer)`` splits the residual stream entering block ``layer`` (or the
final one) into what wrote it: the token embedding, the learned position embedding (where
the family has one, ``pos_embed``), each block's attention output and MLP output, and on
request each attention head's share of the output projection, with the projection's bias as
its own component. Components are read through the architecture adapter's canonical sites
(``embed``, ``pos_embed``, ``blocks.{i}.attn``, ``blocks.{i}.mlp``), so one call serves every
pre-norm family an adapter covers; heads come from the attention facets (so fused SDPA models
work) and the output projection's weight. The components of ``mode='all'`` are checked to sum
to the recorded residual; a model whose blocks add something else (a post-norm, a
post-attention norm) is refused.

Labels follow TransformerLens: ``'embed'``, ``'pos_embed'``, ``'3_attn_out'``, ``'3_mlp_out'``,
``'L3H5'`` (block 3, head 5) and ``'3_attn_bias'`` (block 3's output-projection bias, present
when the projection has one).

``logit_attrs(trace, stack, tokens)`` sends each component through the final norm *as the run
applied it* (centred for LayerNorm, divided by the final residual's norm scale at that position,
times the norm's weight) and the unembedding column of ``tokens`` (minus ``incorrect_tokens``'
for a logit difference). The attributions of a full decomposition sum to the logit less the
constant the norm's bias and the unembedding's bias add; this equals TransformerLens's
``cache.logit_attrs`` on a model loaded with ``fold_ln=True`` (its default).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from ..arch.infer import is_norm
from ..arch.resolve import arch
from ..core.indices import python_indices
from ..core.trace import Trace
from ..core.tree import first_tensor
from ..errors import InvalidArgumentError, SiteNotFoundError, UnsupportedModelError
from ._workflow_inputs import model_of
from .facets import _attention_feeding
from .residual import FinalNorm, final_norm_scale, find_final_norm

__all__ = ["MODES", "ResidualStack", "apply_ln_to_stack", "decompose_resid", "logit_attrs"]

MODES = ("all", "attn", "mlp")


class ResidualStack(NamedTuple):
    """Components ``[component, batch, position, d_model]`` and their labels (unpacks as a pair)."""

    stack: torch.Tensor
    labels: list[str]


# -- reading the components ---------------------------------------------------------------------


def _out(trace: Trace, name: str) -> torch.Tensor:
    return first_tensor(trace[name].out)


def _boundary(view: Any, layer: int | None) -> int:
    """The residual boundary index: 0 (the embeddings) .. n_layers (after the last block)."""
    if layer is None:
        return view.n_layers
    return view.layer_indices([layer], boundaries=True)[0]


def _residual_at(trace: Trace, boundary: int, n_layers: int) -> torch.Tensor:
    if boundary == n_layers:
        return _out(trace, f"blocks.{n_layers - 1}")
    return _out(trace, f"blocks.{boundary}.resid_pre")


def _missing(view: Any, what: str, site: str) -> SiteNotFoundError:
    have = [n for n in ("embed", "pos_embed", "blocks.0.attn", "blocks.0.mlp") if n in view.names()]
    return SiteNotFoundError(
        f"the {view.adapter!r} adapter has no {what} site ({site!r}) for this model; it has {have}",
        site=site,
        remedy="Ask for the components it has (mode='attn' / 'mlp', heads=False), or extend the adapter's "
        "Layout (docs/plugins.md).",
    )


def _projection_matrix(module: nn.Module, address: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W [d_in, d_out], bias)`` of an output projection: ``nn.Linear`` or transformers' ``Conv1D``."""
    weight = getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    if isinstance(module, nn.Linear):
        return weight.T, bias
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and getattr(module, "nf", None) == weight.size(1):
        return weight, bias  # transformers' Conv1D: x @ weight + bias
    raise UnsupportedModelError(
        f"the output projection {address!r} is a {type(module).__name__}; per-head outputs need a Linear or Conv1D",
        remedy="Decompose with heads=False (each block's attention output as one component).",
    )


def _head_components(trace: Trace, view: Any, layer: int) -> tuple[list[torch.Tensor], list[str]]:
    """Each head's share of block ``layer``'s output projection, then the projection's bias."""
    attn_address = view.resolve(f"blocks.{layer}.attn")
    found = None
    for name, module in model_of(trace).get_submodule(attn_address).named_modules():
        address = f"{attn_address}.{name}" if name else attn_address
        calls = trace.calls_of(address)
        facets = _attention_feeding(trace, calls[0]) if len(calls) == 1 else None
        if facets is not None:
            found = (address, module, calls[0], facets)
            break
    if found is None:
        raise UnsupportedModelError(
            f"no output projection fed by the attention heads was found in {attn_address!r} "
            f"(adapter {view.adapter!r})",
            remedy="Capture with tl.trace (every op recorded), or decompose with heads=False.",
        )
    address, module, call, facets = found
    weight, bias = _projection_matrix(module, address)
    head_out = facets.head_out.as_subclass(torch.Tensor)  # [batch, heads, q, head_dim]
    n_heads, head_dim = head_out.size(-3), head_out.size(-1)
    merged = head_out.transpose(-3, -2).flatten(-2)
    recorded = first_tensor((call.args, call.kwargs))
    eps = torch.finfo(merged.dtype).eps
    if weight.size(0) != n_heads * head_dim or (recorded is not None and recorded.shape == merged.shape
                                                and not torch.allclose(recorded, merged, rtol=16 * eps,
                                                                       atol=16 * eps)):
        raise UnsupportedModelError(
            f"{address!r} does not read the heads of {facets.label} concatenated head by head "
            f"({n_heads} heads x {head_dim})",
            remedy="Decompose with heads=False (each block's attention output as one component).",
        )
    w = weight.to(head_out.dtype).reshape(n_heads, head_dim, -1)
    heads = torch.einsum("bhqd,hde->hbqe", head_out, w)
    parts, labels = list(heads.unbind(0)), [f"L{layer}H{h}" for h in range(n_heads)]
    if bias is not None:
        parts.append(bias.to(head_out.dtype).expand_as(heads[0]))
        labels.append(f"{layer}_attn_bias")
    return parts, labels


@torch.no_grad()
def decompose_resid(trace: Any, layer: int | None = None, *, mode: str = "all", heads: bool = False,
                    mlp_input: bool = False) -> ResidualStack:
    """The residual stream at a layer boundary, split into the components that wrote it.

    Args:
        trace: a ``tl.trace(model, ids)`` capture of a pre-norm transformer an adapter covers.
        layer: the boundary: the residual entering block ``layer`` (0: the embeddings alone);
            None or ``n_layers``: after the last block (before the final norm). Negative ones
            count over the ``n_layers + 1`` boundaries, so ``-1`` is the final one (as in
            TransformerLens).
        mode: ``'all'`` (attention and MLP outputs), ``'attn'`` or ``'mlp'`` (embeddings plus
            that sublayer only; these do not sum to the residual).
        heads: split each attention output into its heads (``'L{i}H{h}'``) plus the output
            projection's bias (``'{i}_attn_bias'``).
        mlp_input: also include block ``layer``'s attention (the residual the MLP of block
            ``layer`` reads, ``resid_mid``).

    Returns:
        a :class:`ResidualStack` ``(stack [component, batch, position, d_model], labels)``.

    Raises:
        SiteNotFoundError: a layer out of range, or components the adapter does not have.
        UnsupportedModelError: the components do not sum to the recorded residual (a post-norm
            block, a norm after the attention), or heads cannot be read from the projection.
        InvalidArgumentError: a bad ``mode`` or a trace without a model.
    """
    if not isinstance(trace, Trace):
        raise InvalidArgumentError(f"decompose_resid takes a trace (tl.trace(model, ids)), got {type(trace).__name__}")
    if mode not in MODES:
        raise InvalidArgumentError(f"mode= is one of {MODES}, got {mode!r}")
    view = arch(model_of(trace))
    boundary = _boundary(view, layer)
    if mlp_input and boundary == view.n_layers:
        raise SiteNotFoundError(f"mlp_input=True needs a block's MLP input; layer {layer} is after the last block",
                                site="layers", remedy=f"Pick a layer below {view.n_layers}.")
    names = view.names()
    if "embed" not in names:
        raise _missing(view, "token embedding", "embed")
    resid = _residual_at(trace, boundary, view.n_layers)
    parts: list[torch.Tensor] = [_out(trace, "embed")]
    labels = ["embed"]
    if "pos_embed" in names:
        parts.append(_out(trace, "pos_embed"))
        labels.append("pos_embed")
    for i in range(boundary + (1 if mlp_input else 0)):
        if mode in ("all", "attn"):
            if f"blocks.{i}.attn" not in names:
                raise _missing(view, "attention", f"blocks.{i}.attn")
            if heads:
                more, more_labels = _head_components(trace, view, i)
                parts += more
                labels += more_labels
            else:
                parts.append(_out(trace, f"blocks.{i}.attn"))
                labels.append(f"{i}_attn_out")
        if mode in ("all", "mlp") and i < boundary:
            if f"blocks.{i}.mlp" not in names:
                raise _missing(view, "MLP", f"blocks.{i}.mlp")
            parts.append(_out(trace, f"blocks.{i}.mlp"))
            labels.append(f"{i}_mlp_out")
    stack = torch.stack([p.to(resid.dtype).expand_as(resid) for p in parts])
    if mode == "all":
        want = _out(trace, f"blocks.{boundary}.resid_mid") if mlp_input else resid
        _check_sum(stack, want, view, boundary)
    return ResidualStack(stack, labels)


def _check_sum(stack: torch.Tensor, resid: torch.Tensor, view: Any, boundary: int) -> None:
    total = stack.sum(0)
    scale = float(resid.abs().max()) if resid.numel() else 1.0
    tol = 64 * torch.finfo(resid.dtype).eps * stack.size(0) * max(scale, 1.0)
    err = float((total - resid).abs().max()) if resid.numel() else 0.0
    if err > tol:
        raise UnsupportedModelError(
            f"the components of this {view.adapter!r} model do not sum to its residual stream at boundary "
            f"{boundary} (max abs difference {err:.3g}): its blocks add something besides the attention and MLP "
            "outputs (a norm after a sublayer, a post-norm residual), or the adapter does not name something "
            "added to the residual stream (a learned position embedding: Layout(pos_embed=...))",
            remedy="Decomposition needs a pre-norm residual stream (GPT-2, Llama, Mistral, Qwen2, NeoX); read "
            "the sublayer outputs with trace['blocks.{i}.attn'] / ['blocks.{i}.mlp'] instead.",
        )


# -- through the final norm and the unembedding ----------------------------------------------------


def _applied_norm(trace: Trace, view: Any) -> FinalNorm:
    """The final norm as this run applied it (``scale [batch, pos, 1]``, weight, centred, bias); none: ones."""
    resid = _out(trace, f"blocks.{view.n_layers - 1}")
    address = find_final_norm(trace)
    if not address:
        return FinalNorm(torch.ones_like(resid[..., :1]).float(), torch.ones(resid.size(-1), dtype=resid.dtype),
                         False, None)
    return final_norm_scale(trace, address, resid, remedy="Apply the norm yourself to the stack.")


def _stack_tensor(stack: Any, resid_shape: torch.Size) -> torch.Tensor:
    tensor = stack.stack if isinstance(stack, ResidualStack) else stack
    if not isinstance(tensor, torch.Tensor) or tensor.shape[-3:] != resid_shape:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise InvalidArgumentError(
            f"the stack must be [..., batch, position, d_model] = [..., {', '.join(map(str, resid_shape))}] "
            f"like this trace's residual stream; got {got}",
            remedy="Pass what tl.decompose_resid(trace, ...) returned for the same trace.",
            expected_shape=tuple(resid_shape))
    return tensor


def _block_norm(trace: Trace, view: Any, boundary: int, mlp_input: bool) -> FinalNorm:
    """The norm of block ``boundary`` that reads its input (``mlp_input``: its ``resid_mid``), as this run applied
    it: the first norm module in the block whose input is that residual (TransformerLens's ``ln1`` / ``ln2``).

    Raises:
        SiteNotFoundError: no norm in the block reads that residual (a post-norm block, a model without norms).
    """
    site = f"blocks.{boundary}.resid_mid" if mlp_input else f"blocks.{boundary}.resid_pre"
    resid = _out(trace, site)
    block = view.blocks[boundary]
    calls = []
    for name, module in model_of(trace).get_submodule(block).named_modules():
        if name and is_norm(module):
            calls += trace.calls_of(f"{block}.{name}")[:1]
    for call in sorted(calls, key=lambda c: c.op_start):
        args, kwargs = call.args or (), call.kwargs or {}
        x = args[0] if args else kwargs.get("hidden_states")
        if isinstance(x, torch.Tensor) and x.shape == resid.shape and torch.equal(x, resid):
            return final_norm_scale(trace, call.address, resid, remedy="Apply the norm yourself to the stack.")
    raise SiteNotFoundError(
        f"no norm in {block} reads {site} (the norms TransformerLens's layer={boundary} would divide by)",
        site=site, remedy="Pass layer=None for the final norm, or scale the stack yourself.")


@torch.no_grad()
def apply_ln_to_stack(trace: Any, stack: Any, layer: int | None = None, *, mlp_input: bool = False) -> torch.Tensor:
    """Scale a stack of residual components as a norm scaled this run (TransformerLens's
    ``cache.apply_ln_to_stack``): centred for LayerNorm, divided by that norm's scale at each batch row and
    position. The norm's weight and bias are not applied.

    Args:
        trace: the capture the components come from.
        stack: a :class:`ResidualStack` or a tensor ``[..., batch, position, d_model]``.
        layer: None, ``-1`` or ``n_layers``: the final norm, on the final residual. A block index ``k``: block
            ``k``'s first norm on the residual entering it (TransformerLens's ``ln1`` scale, what its
            ``accumulated_resid(layer=k, apply_ln=True)`` and ``decompose_resid(layer=k, apply_ln=True)`` use).
        mlp_input: with ``layer=k``, block ``k``'s pre-MLP norm on its ``resid_mid`` (TransformerLens's ``ln2``).

    Raises:
        InvalidArgumentError: a stack of another shape.
        SiteNotFoundError: a layer out of range, ``mlp_input`` without a block, or a block without such a norm.
        UnsupportedModelError: a norm of another kind.
    """
    view = arch(model_of(trace))
    boundary = _boundary(view, layer)
    if mlp_input and boundary == view.n_layers:
        raise SiteNotFoundError(f"mlp_input=True needs a block's MLP input; layer {layer} is after the last block",
                                site="layers", remedy=f"Pick a layer below {view.n_layers}.")
    if boundary == view.n_layers:
        scale, _, centred, _ = _applied_norm(trace, view)
    else:
        scale, _, centred, _ = _block_norm(trace, view, boundary, mlp_input)
    tensor = _stack_tensor(stack, scale.shape[:-1] + (view.d_model or _out(trace, "embed").size(-1),))
    if centred:
        tensor = tensor - tensor.mean(-1, keepdim=True)
    return (tensor / scale.to(tensor.dtype)).to(tensor.dtype)


def _token_ids(tokens: Any, vocab: int, batch: int, what: str) -> torch.Tensor:
    """Answer ids as a ``[batch]`` (one per row) or ``[batch, position]`` tensor, checked against the vocabulary."""
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        ids = torch.full((batch,), tokens)
    else:
        try:
            ids = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError):
            ids = None
        if ids is None or ids.is_floating_point() or ids.dtype == torch.bool or ids.dim() > 2 \
                or (ids.dim() >= 1 and ids.size(0) != batch):
            raise InvalidArgumentError(
                f"{what}= is a token id, or one id per batch row ({batch}), or [batch, position] ids; got {tokens!r}")
        if ids.dim() == 0:
            ids = ids.expand(batch)
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise InvalidArgumentError(f"{what}= id {int(bad[0])} is outside the vocabulary (0 .. {vocab - 1})",
                                   remedy="Give token ids the unembedding has (tokenizer.convert_tokens_to_ids).")
    return ids.long()


@torch.no_grad()
def logit_attrs(trace: Any, stack: Any, tokens: Any, incorrect_tokens: Any = None, *,
                position: int | None = -1) -> torch.Tensor:
    """Direct logit attribution: each component's contribution to a logit (or logit difference).

    Each component goes through :func:`apply_ln_to_stack`, the final norm's weight and the
    unembedding row of the answer token (minus that of ``incorrect_tokens``).

    Args:
        trace: the capture the components come from.
        stack: a :class:`ResidualStack` (``tl.decompose_resid``) or a tensor ``[..., batch, position, d_model]``.
        tokens: the answer: one token id, one per batch row, or ``[batch, position]`` ids.
        incorrect_tokens: the same forms; attributions are then to ``logit(tokens) - logit(incorrect_tokens)``.
        position: the position read (``-1``: the last); None: every position.

    Returns:
        ``[..., batch]`` attributions (``[..., batch, position]`` with ``position=None``).

    Raises:
        InvalidArgumentError: an id outside the vocabulary, ids of the wrong shape, or a stack of another shape.
        SiteNotFoundError: no unembedding.
        UnsupportedModelError: a final norm of another kind, or an unembedding that is not a Linear.
    """
    model = model_of(trace)
    view = arch(model)
    scaled = apply_ln_to_stack(trace, stack)
    _, weight, _, _ = _applied_norm(trace, view)
    unembed = view.module("unembed")
    w_u = getattr(unembed, "weight", None)
    if not isinstance(unembed, nn.Linear) or w_u is None:
        raise UnsupportedModelError(f"the unembedding is a {type(unembed).__name__}, not a Linear",
                                    remedy="Multiply tl.apply_ln_to_stack(trace, stack) by your unembedding.")
    batch, n_pos = scaled.size(-3), scaled.size(-2)
    ids = _token_ids(tokens, w_u.size(0), batch, "tokens")
    directions = w_u[ids]
    if incorrect_tokens is not None:
        directions = directions - w_u[_token_ids(incorrect_tokens, w_u.size(0), batch, "incorrect_tokens")]
    directions = (directions * weight).to(scaled.dtype)  # the norm's weight, folded as fold_ln does
    if position is not None:
        pos = python_indices([position], n_pos, what="position", axis=f"the trace has {n_pos} positions")[0]
        scaled = scaled[..., pos, :]
        if directions.dim() == 3:
            directions = directions[:, pos]
        return (scaled * directions).sum(-1)
    if directions.dim() == 2:
        directions = directions.unsqueeze(-2)
    return (scaled * directions).sum(-1)
