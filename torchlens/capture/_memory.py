"""The process's resident memory, read cheaply enough to check every few dozen ops (``max_bytes=``)."""

from __future__ import annotations

import os
import sys

try:
    import resource
except ImportError:  # Windows has no resource module: max_bytes= then reads no peak
    resource = None

__all__ = ["CHECK_EVERY", "CHECK_MASK", "CHECK_SHIFT", "resident_bytes"]

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
