"""Progress bars for long user-facing work (validate, saving and loading big traces, sweeps, caching).

One rule for every caller: a bar is shown when the work takes more than about a second *and*
progress is on. ``progress=None`` (the default everywhere) means "on when stderr is a terminal",
``False`` silences it, ``True`` forces it; the environment variable ``TORCHLENS_PROGRESS=0``
silences every bar (for logs and CI). Bars need ``tqdm`` (in the ``torchlens[viz]`` extra); without
it the automatic mode is silent and an explicit ``progress=True`` raises ``OptionalDependencyError``.

Usage::

    from torchlens._progress import track, progress_bar

    for op in track(trace.ops, desc="validate", unit="op", progress=progress):
        ...

    with progress_bar(total=n_bytes, desc="save", unit="B", progress=progress) as bar:
        bar.update(len(chunk))
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from .errors import OptionalDependencyError

try:
    from tqdm import tqdm as _tqdm
except ImportError:  # optional: the viz extra brings it
    _tqdm = None

__all__ = ["ProgressBar", "progress_bar", "progress_enabled", "track"]

T = TypeVar("T")

DELAY_SECONDS = 1.0  # work that finishes sooner never shows a bar


def progress_enabled(progress: bool | None = None) -> bool:
    """Whether a bar should be drawn for a call that received ``progress``.

    Args:
        progress: ``True`` (always), ``False`` (never) or ``None`` (when stderr is a terminal
            and ``TORCHLENS_PROGRESS`` is not ``0``).

    Returns:
        True when a bar should be drawn.

    Raises:
        OptionalDependencyError: ``progress=True`` but tqdm is not installed.
    """
    if progress is False:
        return False
    if progress is True:
        if _tqdm is None:
            raise OptionalDependencyError("progress=True needs tqdm, which is not installed",
                                          remedy="pip install 'torchlens[viz]' (or pip install tqdm).")
        return True
    if os.environ.get("TORCHLENS_PROGRESS", "").strip() in ("0", "false", "no", "off"):
        return False
    stream = sys.stderr
    return _tqdm is not None and stream is not None and hasattr(stream, "isatty") and stream.isatty()


class ProgressBar:
    """A bar to advance by hand (``update(n)``); a silent no-op when progress is off."""

    def __init__(self, total: int | None, *, desc: str, unit: str, enabled: bool) -> None:
        self._bar = (_tqdm(total=total, desc=desc, unit=unit, delay=DELAY_SECONDS, leave=False,
                           unit_scale=unit == "B", dynamic_ncols=True)
                     if enabled else None)

    @property
    def active(self) -> bool:
        """Whether a real bar is attached (False when progress is off)."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        """Advance by ``n`` units."""
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def progress_bar(total: int | None = None, *, desc: str, unit: str = "it",
                 progress: bool | None = None) -> ProgressBar:
    """A bar advanced by hand, for work that is not one loop over a sequence.

    Args:
        total: how many units the work has (None: unknown).
        desc: a few words shown before the bar ("save trace").
        unit: what one unit is ("op", "B", "prompt").
        progress: see :func:`progress_enabled`.

    Returns:
        a :class:`ProgressBar`, usable as a context manager.

    Raises:
        OptionalDependencyError: ``progress=True`` but tqdm is not installed.
    """
    return ProgressBar(total, desc=desc, unit=unit, enabled=progress_enabled(progress))


def track(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it",
          progress: bool | None = None) -> Iterator[T]:
    """Iterate ``items`` with a bar (when progress is on and the loop runs past about a second).

    Args:
        items: what to iterate.
        desc: a few words shown before the bar ("validate").
        total: the number of items when ``len(items)`` does not work.
        unit: what one item is ("op", "shard").
        progress: see :func:`progress_enabled`.

    Returns:
        an iterator over ``items``, unchanged.

    Raises:
        OptionalDependencyError: ``progress=True`` but tqdm is not installed.
    """
    if not progress_enabled(progress):  # checked here, not on first next(), so errors come at the call
        return iter(items)
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    return _tracked(items, ProgressBar(total, desc=desc, unit=unit, enabled=True))


def _tracked(items: Iterable[T], bar: ProgressBar) -> Iterator[T]:
    with bar:
        for item in items:
            yield item
            bar.update()
