"""``nnsight.modeling.processing``: how prompts and token ids are batched across invokes."""

from __future__ import annotations

from ..processing import *  # noqa: F403 - the same names, at nnsight's path
from ..processing import __all__ as _names

__all__ = list(_names)
