"""What part of a file the kernel holds in its page cache (``mincore`` over a mapping).

Mapping a file does not read it, so asking does not change the answer. Linux only.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _check(result: int | None) -> None:
    if result is None or result in (_MAP_FAILED, -1):
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def resident_pages(path: Path, start: int, end: int) -> tuple[int, int]:
    """(pages in the page cache, pages) of the whole pages within ``[start, end)``."""
    page = mmap.PAGESIZE
    first, last = -(-start // page), end // page
    if last <= first:
        return 0, 0
    length = (last - first) * page
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, first * page)
        _check(address)
        try:
            vector = ctypes.create_string_buffer(last - first)
            _check(_libc.mincore(address, length, vector))
        finally:
            _libc.munmap(address, length)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in vector.raw), last - first


def on_tmpfs(path: Path) -> bool:
    """True if ``path`` lives on tmpfs, where there is no disk to drop pages to."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fstype = line.split()[:3]
            if str(path).startswith(point) and len(point) > len(best):
                best, kind = point, fstype
    return kind == "tmpfs"
