"""Cutting a contiguous run of layers out of an ``nn.Sequential`` (baukit's subsequence).

Boundaries are dotted names and may point inside nested Sequentials:
``first_layer``/``last_layer`` are inclusive, ``after_layer``/``upto_layer`` exclusive,
``single_layer`` is shorthand for first == last. Chosen layers are deep-copied unless
``share_weights``; the result keeps the source's ``training`` flag; nested Sequentials
left empty are dropped, while the outermost result is always a Sequential.

Deviations: conflicting boundaries and descent into a non-Sequential raise
``InvalidArgumentError`` (baukit fails an assertion); a boundary that names no layer
raises ``LayerNotFoundError``, which is both the ``ValueError`` baukit raises and a
``SiteNotFoundError``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

from torch import nn

from torchlens.errors import InvalidArgumentError, SiteNotFoundError

__all__ = ["LayerNotFoundError", "hierarchical_subsequence", "subsequence"]

_KEYS = ("first", "last", "after", "upto")


class LayerNotFoundError(SiteNotFoundError, ValueError):
    """A subsequence boundary names no layer (a ValueError too, as baukit raises)."""

    remedy = "Use the dotted name of a layer of the Sequential (see module_names(model))."


def subsequence(
    sequential: nn.Sequential,
    first_layer: str | None = None,
    last_layer: str | None = None,
    after_layer: str | None = None,
    upto_layer: str | None = None,
    single_layer: str | None = None,
    share_weights: bool = False,
) -> nn.Sequential:
    """The layers of ``sequential`` between the given boundaries, as a new Sequential."""
    if single_layer is not None:
        if any(b is not None for b in (first_layer, last_layer, after_layer, upto_layer)):
            raise InvalidArgumentError(
                "subsequence: single_layer cannot be combined with first/last/after/upto_layer",
                remedy="Give single_layer alone, or first_layer and last_layer.",
            )
        first_layer = last_layer = single_layer
    names = (first_layer, last_layer, after_layer, upto_layer)
    first, last, after, upto = (None if name is None else name.split(".") for name in names)
    return hierarchical_subsequence(
        sequential, first=first, last=last, after=after, upto=upto, share_weights=share_weights
    )


def hierarchical_subsequence(
    sequential: nn.Module,
    first: list[str] | None,
    last: list[str] | None,
    after: list[str] | None,
    upto: list[str] | None,
    share_weights: bool = False,
    depth: int = 0,
) -> nn.Module | None:
    """One level of :func:`subsequence`; boundaries are name lists, ``depth`` the level."""
    bounds = dict(zip(_KEYS, (first, last, after, upto)))
    if last is not None and upto is not None:
        raise InvalidArgumentError("subsequence: give last_layer or upto_layer, not both")
    if first is not None and after is not None:
        raise InvalidArgumentError("subsequence: give first_layer or after_layer, not both")
    if all(b is None for b in bounds.values()):
        return sequential if share_weights else copy.deepcopy(sequential)
    if not isinstance(sequential, nn.Sequential):
        path = next(b for b in bounds.values() if b is not None)
        where = ".".join(path[:depth]) or "the model"
        raise InvalidArgumentError(
            f"subsequence: {where} is a {type(sequential).__name__}, not an nn.Sequential",
            remedy="Boundaries may only descend through nested nn.Sequential modules.",
        )

    # The name each boundary has at this level, and whether it continues below it.
    here = {k: (b[depth] if b is not None else None) for k, b in bounds.items()}
    goes_deeper = {k: b is not None and len(b) > depth + 1 for k, b in bounds.items()}
    unfound = {k for k, b in bounds.items() if b is not None}
    including = first is None and after is None
    chosen: OrderedDict[str, nn.Module] = OrderedDict()

    for name, child in sequential._modules.items():
        hit = {k for k in _KEYS if here[k] == name}
        unfound -= hit
        # Boundaries that take effect before this child.
        if "first" in hit or ("after" in hit and goes_deeper["after"]):
            including = True
        if "upto" in hit and not goes_deeper["upto"]:
            including = False
        if including:
            inner = {k: (bounds[k] if k in hit and goes_deeper[k] else None) for k in _KEYS}
            picked = hierarchical_subsequence(child, **inner, share_weights=share_weights, depth=depth + 1)
            if picked is not None:
                chosen[name] = picked
        # Boundaries that take effect after this child.
        if "last" in hit or ("upto" in hit and goes_deeper["upto"]):
            including = False
        if "after" in hit and not goes_deeper["after"]:
            including = True

    for key in _KEYS:
        if key in unfound:
            name = ".".join(bounds[key])
            raise LayerNotFoundError(f"Layer {name} not found", site=name)
    if not chosen and depth > 0:
        return None
    result = nn.Sequential(chosen)
    result.training = sequential.training
    return result
