"""Per-feature direct logit attribution: each feature's decoder direction through the final norm and unembedding.

Feature ``i`` of a dictionary at a residual-stream site writes ``f_i(x) * W_dec[i]`` into the
stream. Its direct logit attribution is that vector sent through the rest of the unembedding path
as the run applied it: :func:`torchlens.analysis.residual_decompose.logit_attrs` (centred for
LayerNorm, divided by the final residual's norm scale at that row and position, times the norm's
weight and the answer's unembedding row, or the difference of two). The attributions of every
feature, plus those of the decoder bias ``b_dec`` and of the reconstruction error, sum to the
attribution of the site's value itself.
"""

from __future__ import annotations

from typing import Any

import torch

from ..analysis.residual_decompose import logit_attrs
from ..core.indices import python_indices
from ..core.tree import first_tensor
from ..dictionaries.attach import dictionaries
from ..dictionaries.wrap import FeatureDictionary, as_dictionary
from ..errors import FeatureWidthError, InvalidArgumentError

__all__ = ["feature_activations", "feature_logit_attrs"]

STACK_ELEMENTS = 1 << 24  # values per chunk of feature contributions (~64 MB in float32)


def _site_value(trace: Any, site: Any) -> tuple[Any, str]:
    """The site's recorded value (a tuple output's first tensor) and the site's name for messages."""
    name = site if isinstance(site, str) else site.describe() if hasattr(site, "describe") else repr(site)
    value = trace[site].out
    tensor = value if isinstance(value, torch.Tensor) else first_tensor(value)
    if tensor is None or isinstance(value, (list, dict)):
        tensor = value  # let the dictionary's own check name what the site gives
    return tensor, name


def feature_activations(trace: Any, site: Any, sae: Any) -> torch.Tensor:
    """The dictionary's feature activations at a site of a trace, ``[..., d_sae]``.

    On a trace (or fork) captured with this dictionary attached at the site (``features={site: sae}``),
    its ``<site>.features`` value, edits included; otherwise ``sae.encode`` of the site's recorded
    value (a module whose output is a tuple contributes its first tensor).

    Raises:
        SiteNotFoundError: the trace has no such site.
        FeatureWidthError, FeatureDtypeError, FeatureSiteError: the site's value does not fit the dictionary.
    """
    dictionary = as_dictionary(sae)
    value, name = _site_value(trace, site)
    dictionary.check_input(value, site=name)
    if any(d.module is dictionary.module for d in dictionaries(trace).values()):
        attached = trace[f"{name}.features"].out
        if isinstance(attached, torch.Tensor):
            return attached.detach()
    with torch.no_grad():
        return dictionary.encode(value)


def _directions(dictionary: FeatureDictionary, name: str) -> torch.Tensor:
    w_dec = dictionary.W_dec
    if w_dec is None:
        raise InvalidArgumentError(f"{dictionary.name} does not declare its decoder directions (W_dec)",
                                   remedy="Give the module a W_dec [d_sae, d_in] weight (SAELens SAEs have one).")
    return w_dec.detach()


@torch.no_grad()
def feature_logit_attrs(trace: Any, site: Any, sae: Any, tokens: Any, incorrect_tokens: Any = None, *,
                        position: int | None = -1, features: Any = None) -> torch.Tensor:
    """Direct logit attribution of each feature of a dictionary at a residual-stream site.

    Feature ``i``'s attribution is ``f_i * W_dec[i]`` through :func:`tl.logit_attrs` (the final norm's
    scale of this run, its weight, and the unembedding of ``tokens``, minus ``incorrect_tokens``').

    Args:
        trace: a capture of the model (``tl.trace(model, x)``).
        site: where the dictionary reads and writes the residual stream (a block's output, ``blocks.6``...).
        sae: the dictionary (any module with ``encode``/``decode`` and ``W_dec``, a SAELens ``SAE``).
        tokens: the answer: one token id, one per batch row, or ``[batch, position]`` ids.
        incorrect_tokens: the same forms; attributions are then to ``logit(tokens) - logit(incorrect_tokens)``.
        position: the position read (``-1``: the last); None: every position.
        features: feature indices to attribute (default: every feature; inactive ones get 0).

    Returns:
        ``[n_features, batch]`` (``[n_features, batch, position]`` with ``position=None``), in the order
        of ``features`` (default: ``0 .. d_sae - 1``).

    Raises:
        FeatureWidthError: the site's width is not the dictionary's ``d_in``, or not the residual stream's.
        FeatureIndexError: a feature index out of range.
        InvalidArgumentError: an answer id outside the vocabulary, or a dictionary without ``W_dec``.
        UnsupportedModelError: a final norm or unembedding :func:`tl.logit_attrs` cannot apply.
    """
    dictionary = as_dictionary(sae)
    codes = feature_activations(trace, site, dictionary)
    _, name = _site_value(trace, site)
    w_dec = _directions(dictionary, name)
    wanted = dictionary.check_feature(features) if features is not None else list(range(codes.shape[-1]))
    batch, n_pos, width = codes.shape[0], codes.shape[1], w_dec.shape[-1]
    at = None
    if position is not None:
        at = python_indices([position], n_pos, what="position", axis=f"the trace has {n_pos} positions")[0]
    read = codes[:, at] if at is not None else codes  # [batch(, pos), d_sae]
    # only features active somewhere in what is read can have a non-zero attribution
    index = torch.tensor(wanted, dtype=torch.long)
    active = (read.reshape(-1, read.shape[-1])[:, index] != 0).any(0)
    out = torch.zeros((len(wanted), batch) + ((n_pos,) if at is None else ()), dtype=torch.float32)
    todo = active.nonzero().flatten()
    step = max(1, STACK_ELEMENTS // max(1, batch * n_pos * width))
    for start in range(0, todo.numel(), step):
        rows = todo[start:start + step]
        feats = index[rows]
        # [n, batch, pos, d_in]: each feature's contribution at every position (logit_attrs reads its own)
        stack = codes[..., feats].permute(2, 0, 1)[..., None] * w_dec[feats][:, None, None, :].to(codes.dtype)
        try:
            out[rows] = logit_attrs(trace, stack, tokens, incorrect_tokens, position=position).float()
        except InvalidArgumentError as exc:
            expected = getattr(exc, "expected_shape", None)
            if expected is not None:
                resid = expected[-1]
                raise FeatureWidthError(
                    f"{name} has width {width}, not the residual stream's ({resid}): direct logit attribution "
                    f"needs a dictionary that writes the residual stream", site=name, d_in=width, site_width=resid,
                    remedy="Attach the dictionary to a residual-stream site (a block's output, resid_mid, an "
                           "attention or MLP output).") from None
            raise
    if not todo.numel():  # nothing active: still check the answers as logit_attrs would
        logit_attrs(trace, torch.zeros(1, batch, n_pos, width, dtype=codes.dtype), tokens, incorrect_tokens,
                    position=position)
    return out
