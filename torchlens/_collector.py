"""The cyclic garbage collector held off while TorchLens builds records it keeps (``with GcPause():``).

An every-op capture allocates about ten collector-tracked objects per op (records, rows, argument
tuples), a replay a few per op and fork (its changed values, row patches, log entries), every one
of them reachable from the trace or fork until the caller drops it. A collection meanwhile can
free none of them: it only walks them and promotes them to older generations, whose collections
then walk them again (the promotions also bring the next full collection of the whole process
nearer, and a full one walks every object torch and the model hold). Measured, each loop timed
whole so a deferred collection is paid wherever it lands: 0.07 of a plain forward less per trace
of the seed's tiny GPT-2 (100 ops); for a ``trace.forks`` replay of 12 ablations of GPT-2 small
(bench c8), 0.55 of a forward with the collector on, 0.51 with it off (medians of 25, each
replay timed right after a plain forward, on and off alternating in one process).

Reference counting frees everything else as usual. The collector is the process's: other threads'
cycles wait too. Holders in several threads (and nested ones) share one count: the collector is
enabled again when the last one exits, and only if it was enabled when the first one entered.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["GcPause"]


class GcPause:
    """``with GcPause():`` the cyclic collector is off (see the module docstring for why and where)."""

    __slots__ = ()

    def __enter__(self) -> GcPause:
        with _GC_LOCK:
            if not _GC_STATE[0]:
                _GC_STATE[1] = gc.isenabled()
                gc.disable()
            _GC_STATE[0] += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with _GC_LOCK:
            _GC_STATE[0] -= 1
            if not _GC_STATE[0] and _GC_STATE[1]:
                gc.enable()


_GC_LOCK = threading.Lock()
_GC_STATE: list = [0, False]  # (holders keeping the collector off, whether it was enabled before the first)
