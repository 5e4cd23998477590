"""``nnsight.intervention.errors``: the errors a trace raises (TorchLens errors with a remedy)."""

from __future__ import annotations

from ..errors import *  # noqa: F403 - the same names, at nnsight's path
from ..errors import __all__ as _names

__all__ = list(_names)
