"""Edits of feature activations, for any API that takes an edit (``tl.when``, ``fork().do``, ``forks``, patching).

Apply them at a ``<site>.features`` sub-site (``[..., d_sae]``)::

    fork = trace.fork().do("blocks.6.features", tl.features.ablate(1234, positions=-1))

``ablate`` / ``scale`` / ``clamp`` change the listed features (at every position, or at ``positions``
along the sequence axis, dim -2); ``steer`` adds decoder directions to a site of width ``d_in`` (the
site itself or its ``.recon``). Feature indices are checked against the activation's width when the
edit is applied (``FeatureIndexError`` names ``d_sae``). All are named helpers, so recipes save them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.indices import python_indices
from ..dictionaries.wrap import as_dictionary
from ..edit.helpers import Add, Helper, register_helper
from ..errors import FeatureIndexError, InvalidArgumentError

__all__ = ["FeatureEdit", "ablate", "clamp", "scale", "steer"]

_HOW = ("zero", "scale", "clamp")


def _indices(features: Any) -> list[int]:
    if isinstance(features, torch.Tensor):
        return [int(i) for i in features.reshape(-1).tolist()]
    if isinstance(features, int) or hasattr(features, "__index__"):
        return [int(features)]
    try:
        found = [int(i) for i in features]
    except TypeError:
        raise InvalidArgumentError(f"features are an int or a list of ints, got {type(features).__name__}") from None
    if not found:
        raise InvalidArgumentError("name at least one feature")
    return found


def _positions(positions: Any) -> list[int] | None:
    if positions is None:
        return None
    return [int(positions)] if isinstance(positions, int) or hasattr(positions, "__index__") else \
        [int(p) for p in positions]


@register_helper
class FeatureEdit(Helper):
    """Set feature activations: ``zero`` them, ``scale`` them by ``value``, or ``clamp`` them to ``value``."""

    name = "feature_edit"
    may_change_nothing = True  # ablating a feature that does not fire changes nothing, legitimately

    def __init__(self, features: Any, how: str = "zero", value: float = 0.0, positions: Any = None) -> None:
        if how not in _HOW:
            raise InvalidArgumentError(f"how= is one of {_HOW}, got {how!r}")
        self.features = _indices(features)
        self.how = how
        self.value = float(value)
        self.positions = _positions(positions)

    def params(self) -> dict[str, Any]:
        return {"features": self.features, "how": self.how, "value": self.value, "positions": self.positions}

    def touches(self, activation: Any) -> tuple[int, list[int]] | None:
        """With ``positions``, only those rows along dim -2 change (replay compares only them)."""
        if self.positions is None or not isinstance(activation, torch.Tensor) or activation.ndim < 2:
            return None
        return activation.ndim - 2, self.positions

    def __call__(self, activation: Any, *, ctx: Any) -> Any:
        if not isinstance(activation, torch.Tensor):
            raise InvalidArgumentError(f"a feature edit takes the feature activations (a tensor) at "
                                       f"{getattr(ctx, 'site', 'the site')}, got {type(activation).__name__}")
        d_sae = activation.shape[-1]
        for i in self.features:
            if not -d_sae <= i < d_sae:
                raise FeatureIndexError(
                    f"feature {i} is out of range at {getattr(ctx, 'site', 'the site')}: it has d_sae={d_sae} "
                    f"features (0 .. {d_sae - 1})", feature=i, d_sae=d_sae)
        positions = None if self.positions is None else python_indices(  # refused, never wrapped
            self.positions, activation.shape[-2], what="position",
            axis=f"{getattr(ctx, 'site', 'the site')} has {activation.shape[-2]} positions (dim -2)")
        out = activation.clone()
        index = torch.tensor(self.features, device=out.device)
        rows = out if positions is None else out[..., positions, :]
        chosen = rows.index_select(-1, index)
        if self.how == "zero":
            chosen = torch.zeros_like(chosen)
        elif self.how == "scale":
            chosen = chosen * self.value
        else:
            chosen = torch.full_like(chosen, self.value)
        rows = rows.index_copy(-1, index, chosen)
        if positions is None:
            return rows
        out[..., positions, :] = rows
        return out


def ablate(features: Any, positions: Any = None) -> FeatureEdit:
    """Zero feature(s) ``features`` (an int or a list), at every position or at ``positions`` (dim -2)."""
    return FeatureEdit(features, "zero", 0.0, positions)


def scale(features: Any, k: float, positions: Any = None) -> FeatureEdit:
    """Multiply feature(s) ``features`` by ``k``, at every position or at ``positions``."""
    return FeatureEdit(features, "scale", k, positions)


def clamp(features: Any, value: float, positions: Any = None) -> FeatureEdit:
    """Set feature(s) ``features`` to ``value`` (firing or not), at every position or at ``positions``."""
    return FeatureEdit(features, "clamp", value, positions)


def steer(sae: Any, feature: int, coeff: float, positions: Any = None) -> Add:
    """Add ``coeff`` times feature ``feature``'s decoder direction (steering), at a site of width ``d_in``.

    Args:
        sae: the dictionary whose ``W_dec`` row is added.
        feature: the feature index (checked against ``d_sae``).
        coeff: how much of the direction to add.
        positions: every position (None) or these positions along dim -2.

    Raises:
        FeatureIndexError: ``feature`` is out of range.
        InvalidArgumentError: the dictionary declares no decoder matrix.
    """
    d = as_dictionary(sae)
    (i,) = d.check_feature(int(feature))
    w_dec = d.W_dec
    if w_dec is None:
        raise InvalidArgumentError(f"{d.name} declares no decoder matrix (W_dec) to steer along",
                                   remedy="Pass the direction yourself: tl.add(coeff * direction, positions).")
    return Add(coeff * w_dec[i].detach().clone(), positions)
