"""Copies of big recorded tensors that share their unchanged memory pages (copy-on-write).

A fork that changed a few rows of a big recorded tensor (the logits, after an edit at the last
position) builds its whole value when something reads it whole: the recorded tensor with the
new rows written in. Twelve forks reading GPT-2's 1 x 64 logits copy 12.8 MB each, and on
Linux most of that time is the kernel handing out fresh zeroed pages, not the copy.

:func:`page_copy` instead copies the recorded tensor once into an anonymous in-memory file
(``memfd``) and gives each fork a private mapping of it: the fork's tensor reads the shared
pages, and the kernel copies a page only when it is written (the new rows). Values are the
same bytes a ``clone()`` gives; the tensor is an ordinary writable CPU tensor whose storage
cannot be resized. The shared copy lives as long as the recorded tensor (one extra copy of
each recorded tensor built this way). Elsewhere (no ``memfd``, small, strided, on a device,
tracked by autograd) :func:`page_copy` returns None and the caller clones.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

import torch

__all__ = ["MIN_BYTES", "page_copy"]

# Below this a clone is as fast as a mapping and needs no shared copy.
MIN_BYTES = 4 << 20
_CAN_MAP = hasattr(os, "memfd_create") and hasattr(mmap, "MAP_SHARED") and os.path.isdir("/proc/self/fd")


class _Frozen:
    """The shared copy of one recorded tensor: its in-memory file, as of ``version``."""

    __slots__ = ("fd", "size", "version", "ptr", "close")

    def __init__(self, fd: int, size: int, version: int, ptr: int, close: weakref.finalize) -> None:
        self.fd, self.size, self.version, self.ptr = fd, size, version, ptr
        self.close = close  # closes the file once: when the recorded tensor dies, or when replaced


_LOCK = threading.Lock()
_frozen: dict[int, _Frozen] = {}  # id(recorded tensor) -> its shared copy (removed when the tensor dies)


def _close_file(key: int, fd: int) -> None:
    entry = _frozen.get(key)
    if entry is not None and entry.fd == fd:
        del _frozen[key]
    os.close(fd)


def _freeze(base: torch.Tensor) -> _Frozen | None:
    size = base.nbytes
    try:
        fd = os.memfd_create("torchlens-recorded", os.MFD_CLOEXEC)
    except OSError:  # no memfd here (old kernel, sandbox): the caller clones
        return None
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as shared:
            pages = torch.frombuffer(shared, dtype=torch.uint8, count=size)
            pages.copy_(base.reshape(-1).view(torch.uint8))
            del pages  # the mapping closes only once no tensor exports it
    except (OSError, RuntimeError, ValueError):  # out of memory for the file, or a dtype bytes cannot show
        os.close(fd)
        return None
    old = _frozen.pop(id(base), None)
    if old is not None:  # the recorded tensor was written in place since its copy was made
        old.close()
    entry = _Frozen(fd, size, base._version, base.data_ptr(), weakref.finalize(base, _close_file, id(base), fd))
    _frozen[id(base)] = entry
    return entry


def page_copy(base: torch.Tensor) -> torch.Tensor | None:
    """A writable copy of ``base`` sharing its pages until written (None: clone it instead).

    Args:
        base: a recorded tensor that is not written afterwards (a later in-place write is
            noticed through its version counter and makes a new shared copy).

    Returns:
        a CPU tensor equal to ``base`` bit for bit, with the same shape and dtype, or None where
        mapping does not apply (see the module docstring).
    """
    if not _CAN_MAP or base.device.type != "cpu" or base.layout != torch.strided or base.is_quantized \
            or base.requires_grad or base.nbytes < MIN_BYTES or not base.is_contiguous() or base.is_conj() \
            or base.is_neg():
        return None
    # one thread at a time: another could otherwise replace (and close) the file between lookup and mapping
    with _LOCK:
        entry = _frozen.get(id(base))
        if entry is None or entry.version != base._version or entry.ptr != base.data_ptr() \
                or entry.size != base.nbytes:
            entry = _freeze(base)
            if entry is None:
                return None
        try:  # torch maps the file privately and closes its own descriptor: none is held per copy
            private = torch.from_file(f"/proc/self/fd/{entry.fd}", shared=False, size=base.numel(), dtype=base.dtype)
        except (OSError, RuntimeError):  # no /proc, out of address space or mappings: the caller clones
            return None
    return private.view(base.shape)
