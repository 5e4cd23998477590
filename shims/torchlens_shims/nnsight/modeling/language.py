"""``nnsight.modeling.language``: the deprecated `LanguageModel` name."""

from __future__ import annotations

from .transformers import LanguageModel

__all__ = [
    "LanguageModel",
]
