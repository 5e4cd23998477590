"""``nnsight.intervention.aliasing``: how ``rename=`` keys bind and how a path is spelled under them."""

from __future__ import annotations

from ..aliasing import bind, named, path_ends_with, spellings

__all__ = [
    "bind",
    "named",
    "path_ends_with",
    "spellings",
]
