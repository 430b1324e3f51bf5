"""The operating system's page cache: evict files from it, and measure how much of a file it holds.

A file read a second time usually comes from RAM (the page cache), not the disk: a "cold" read
measurement must evict the files first and check that the eviction worked. Linux only; elsewhere
`evict` does nothing and `resident_bytes` returns None, and callers say the cold figure is unknown.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

_PAGE = mmap.PAGESIZE  # bytes per page of the cache


def can_evict() -> bool:
    """True where files can be dropped from the page cache without root (Linux's posix_fadvise)."""
    return sys.platform.startswith("linux") and hasattr(os, "posix_fadvise")


def evict(paths: Iterable[str | os.PathLike]) -> None:
    """Write each file's dirty pages to disk, then ask the kernel to drop its cached pages.

    POSIX_FADV_DONTNEED drops only clean pages, hence the fsync first. A file another process
    has mapped and is using may stay partly cached: check with `resident_bytes`.
    """
    if not can_evict():
        return
    for path in paths:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


_libc = None


def _mincore():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        )
        _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        _libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    return _libc


def resident_bytes(paths: Iterable[str | os.PathLike]) -> int | None:
    """Bytes of these files held in the page cache now (whole pages), from mincore(2); None off Linux.

    Mapping a file does not read it: mincore reports residency without changing it, as `fincore` does.
    """
    if not sys.platform.startswith("linux"):
        return None
    libc = _mincore()
    total = 0
    for path in paths:
        size = Path(path).stat().st_size
        if size == 0:
            continue
        descriptor = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap failed for {path}")
            try:
                pages = (size + _PAGE - 1) // _PAGE
                vector = (ctypes.c_ubyte * pages)()
                if libc.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore failed for {path}")
                total += sum(byte & 1 for byte in bytes(vector)) * _PAGE
            finally:
                libc.munmap(address, size)
        finally:
            os.close(descriptor)
    return total
