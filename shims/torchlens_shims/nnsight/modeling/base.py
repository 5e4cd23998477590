"""``nnsight.modeling.base``: `NNsight`, the wrapper of any ``torch.nn.Module``."""

from __future__ import annotations

from ..envoy import NNsight

__all__ = [
    "NNsight",
]
