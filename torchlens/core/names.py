"""Name suggestions for error messages ("did you mean ...")."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["nearest"]


def nearest(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """Closest valid names to ``name``: fuzzy matches first, then same-prefix names."""
    pool = list(dict.fromkeys(candidates))
    close = difflib.get_close_matches(name, pool, n=n, cutoff=0.5)
    if len(close) < n:
        stem = name.rsplit(".", 1)[0]
        close += [c for c in pool if c.startswith(stem) and c not in close][: n - len(close)]
    return close[:n] or pool[:n]
