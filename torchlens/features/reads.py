"""Sparse views of feature activations: the top-k or the non-zero features of one position.

Both take a trace and a site (``tl.features.top(trace, "blocks.6", k=5)`` reads ``blocks.6.features``), or
the feature activations themselves (a tensor ``[..., seq, d_sae]``), and give indices with values.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..core.indices import python_indices
from ..errors import InvalidArgumentError

__all__ = ["FeatureList", "active", "feature_acts", "top"]


class FeatureList(NamedTuple):
    """Features of one position: ``indices`` and their ``values`` (1-D tensors, largest value first)."""

    indices: torch.Tensor
    values: torch.Tensor

    def tolist(self) -> list[tuple[int, float]]:
        """``[(feature, value), ...]``."""
        return list(zip(self.indices.tolist(), self.values.tolist()))


def feature_acts(source: Any, site: str | None = None) -> torch.Tensor:
    """The feature activations at ``site`` of a trace (``<site>.features``; ``site`` may name it already),
    or ``source`` itself when it is a tensor."""
    if isinstance(source, torch.Tensor):
        return source
    if site is None:
        raise InvalidArgumentError("name the site whose features to read: top(trace, 'blocks.6', ...)")
    key = site if site.rsplit(".", 1)[-1].split(":")[0] == "features" else f"{site}.features"
    return source[key].out


def _row(acts: torch.Tensor, position: int, batch: int) -> torch.Tensor:
    """One position's features; a position or batch row outside the activations is refused, never wrapped."""
    if acts.dim() == 1:
        return acts
    seq = acts.shape[-2]
    position = python_indices(position, seq, what="position", axis=f"the features have {seq} positions")[0]
    if acts.dim() == 2:  # [seq, d_sae]
        return acts[position]
    rows = acts.reshape(-1, *acts.shape[-2:])
    batch = python_indices(batch, rows.shape[0], what="batch row",
                           axis=f"the features have {rows.shape[0]} batch rows")[0]
    return rows[batch, position]


def top(source: Any, site: str | None = None, *, k: int = 10, position: int = -1, batch: int = 0) -> FeatureList:
    """The ``k`` most active features at ``position`` (of batch row ``batch``), largest first.

    Args:
        source: a trace captured with ``features=``, or feature activations ``[..., seq, d_sae]``.
        site: the site the dictionary is attached to (or its ``.features`` sub-site).
        k: how many (at most ``d_sae``).
        position: the sequence position (negative counts from the end).
        batch: the batch row.

    Returns:
        A :class:`FeatureList`.
    """
    row = _row(feature_acts(source, site), position, batch)
    got = torch.topk(row.detach(), min(int(k), row.shape[-1]))
    return FeatureList(got.indices, got.values)


def active(source: Any, site: str | None = None, *, position: int = -1, batch: int = 0) -> FeatureList:
    """Every feature with a non-zero activation at ``position`` (of batch row ``batch``), largest first."""
    row = _row(feature_acts(source, site), position, batch).detach()
    idx = torch.nonzero(row, as_tuple=True)[0]
    vals = row[idx]
    order = torch.argsort(vals, descending=True, stable=True)
    return FeatureList(idx[order], vals[order])
