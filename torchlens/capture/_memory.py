"""The process's resident memory, read cheaply enough to check every few dozen ops (``max_bytes=``),
and the cyclic garbage collector held off while an in-memory capture builds its records."""

from __future__ import annotations

import gc
import os
import sys
import threading

try:
    import resource
except ImportError:  # Windows has no resource module: max_bytes= then reads no peak
    resource = None

__all__ = ["CHECK_EVERY", "CHECK_MASK", "CHECK_SHIFT", "GcPause", "resident_bytes"]

CHECK_EVERY = 64  # ops between two reads of the resident size (max_bytes=); a power of two
CHECK_MASK = CHECK_EVERY - 1
CHECK_SHIFT = CHECK_EVERY.bit_length() - 1  # index >> CHECK_SHIFT: which run of CHECK_EVERY ops


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


_STATM: list[int | None] = [None, None]  # (pid, fd) kept open: a pread is ~1 us, an open() several


def _statm() -> int | None:
    pid = os.getpid()
    if _STATM[0] != pid:  # first use, or a forked child: /proc/self was resolved for the parent
        try:
            _STATM[1] = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            _STATM[1] = None
        _STATM[0] = pid
    return _STATM[1]


def resident_bytes() -> int:
    """The process's resident memory now (Linux), or its peak so far where that is all there is."""
    try:
        fd = _statm()
        if fd is None:
            raise OSError("no /proc/self/statm")
        return int(os.pread(fd, 128, 0).split()[1]) * _PAGE
    except OSError:
        if resource is None:
            return 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


class GcPause:
    """Hold the cyclic garbage collector off while an in-memory capture runs (``with GcPause():``).

    Why: an every-op capture allocates about ten collector-tracked objects per op (records, rows,
    argument tuples), every one of them reachable from the trace until the trace is dropped. A
    collection during the capture can free none of them; it only walks them and promotes them to
    older generations, whose collections then walk them again (the promotions also bring the
    next full collection of the whole process nearer). Measured on the seed's tiny GPT-2 (100
    ops), base + trace back to back, the whole loop timed so a deferred collection is paid
    wherever it lands: 0.07 of a plain forward less per trace.

    Only in-memory captures hold it: with ``save=``, ``store=`` or ``offload_values=`` the
    capture promises a bounded peak, and cyclic garbage the model's forward makes must stay
    collectable. Reference counting frees everything else as usual. The collector is the
    process's: other threads' cycles wait too. Captures in several threads (and nested ones)
    share one count: the collector is enabled again when the last one exits, and only if it
    was enabled when the first one entered.
    """

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
_GC_STATE: list = [0, False]  # (captures holding the collector off, whether it was enabled before the first)
