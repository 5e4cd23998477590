"""Declared replay fallbacks: a strategy that cannot take an op (or a fork) says so, with its reason.

Each strategy of the replay engine (``torchlens.edit._engine``: the sweep of fresh forks,
batched rows, one fork's rows, partial reads; re-execution when a guard changes) checks what it
cannot do before it runs and, when it cannot, the engine hands the work to the next strategy
and records the decision in each concerned fork's replay record (``ReplayLog.decisions``, on the
fork's ``edits[-1].replay``); a fallback is never a caught exception, so an error a strategy
does not expect propagates.

With ``TORCHLENS_STRICT_FALLBACKS=1`` in the environment a declared fallback raises
``ReplayFallbackError`` instead: a test proves the fast path ran, not a slower one beside it.
"""

from __future__ import annotations

import os

from ..errors import ReplayFallbackError

__all__ = ["STRICT_ENV", "declare", "strict_fallbacks"]

STRICT_ENV = "TORCHLENS_STRICT_FALLBACKS"


def strict_fallbacks() -> bool:
    """Whether a declared fallback raises (``TORCHLENS_STRICT_FALLBACKS`` set, and not ``0``)."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def declare(strategy: str, reason: str) -> tuple[str, str]:
    """Declare that ``strategy`` hands work to a slower path because of ``reason``: the
    ``(strategy, reason)`` entry for the replay record of each fork concerned.

    Raises:
        ReplayFallbackError: ``TORCHLENS_STRICT_FALLBACKS`` is set.
    """
    if strict_fallbacks():
        raise ReplayFallbackError(f"replay strategy {strategy!r} fell back: {reason}", strategy=strategy,
                                  reason=reason)
    return strategy, reason
