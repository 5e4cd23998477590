"""Name suggestions for error messages ("did you mean ...").

Suggestions are ranked by likely intent, not only by string similarity: a name typed
with a look-alike character (``transformer.h.O`` with the letter O) first suggests the
name it looks like (``transformer.h.0``), and among equally similar names the one whose
numbers are closest to the typed ones comes first (``h.1`` before ``h.9`` for ``h.O``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from difflib import SequenceMatcher

__all__ = ["nearest"]

# Characters people confuse when typing or reading names: each maps to the digit it looks like.
_LOOK_ALIKE = str.maketrans({"O": "0", "o": "0", "l": "1", "I": "1", "|": "1"})
_NUMBER = re.compile(r"\d+")
_CUTOFF = 0.5


def _numbers(name: str) -> list[int]:
    return [int(n) for n in _NUMBER.findall(name)]


def _numeric_distance(want: list[int], have: list[int]) -> float:
    """How far apart the numbers in two names are (0 when they agree; inf when their count differs)."""
    if len(want) != len(have):
        return float("inf")
    return float(sum(abs(a - b) for a, b in zip(want, have)))


def nearest(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    """The valid names ``name`` most likely meant, best first.

    Ranking: a candidate ``name`` spells exactly once look-alike characters (O/0, l/1, I/1)
    are read as digits comes first; then string similarity, ties going to the candidate
    closer by look-alikes, then to the one whose numbers are closest to ``name``'s, then to
    the earlier candidate. Names sharing ``name``'s dotted prefix fill up
    the list when fewer than ``n`` are similar enough; with none of either, the first ``n``.

    Args:
        name: what the user typed.
        candidates: the valid names, in a meaningful order (execution order, say).
        n: how many to return at most.

    Returns:
        up to ``n`` names.
    """
    pool = list(dict.fromkeys(candidates))
    typed = name.translate(_LOOK_ALIKE)
    typed_numbers = _numbers(typed)
    raw, alike = SequenceMatcher(), SequenceMatcher()
    raw.set_seq2(name)
    alike.set_seq2(typed)
    scored = []
    for order, cand in enumerate(pool):
        looks = cand.translate(_LOOK_ALIKE)
        same = looks == cand and typed == name  # no look-alike characters: one comparison is enough
        raw.set_seq1(cand)
        if not same:
            alike.set_seq1(looks)
        # Cheap upper bounds first (as difflib.get_close_matches does); most names stop here.
        if raw.real_quick_ratio() < _CUTOFF and (same or alike.real_quick_ratio() < _CUTOFF):
            continue
        if raw.quick_ratio() < _CUTOFF and (same or alike.quick_ratio() < _CUTOFF):
            continue
        r = raw.ratio()
        a = r if same else alike.ratio()
        if max(r, a) < _CUTOFF:
            continue
        # The name it spells with look-alikes undone comes first; then plain similarity.
        key = (a != 1.0, -r, -a, _numeric_distance(typed_numbers, _numbers(looks)), order)
        scored.append((key, cand))
    close = [cand for _, cand in sorted(scored)[:n]]
    if len(close) < n:
        stem = name.rsplit(".", 1)[0]
        close += [c for c in pool if c.startswith(stem) and c not in close][: n - len(close)]
    return close[:n] or pool[:n]
