"""Drop-behind: keep only a window of a segment file's newest bytes in the page cache.

Kafka leaves every written byte in the OS page cache until the kernel needs the memory;
so does tidelog when ``page.cache.window.bytes`` is 0. Otherwise, as a segment grows:

* every ``step`` bytes (a quarter of the window) the new range is handed to the disk with
  ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: writeback starts now and goes on in the
  background, instead of the kernel flushing gigabytes of dirty pages in one burst later;
* the range more than ``window`` bytes behind the newest writeback start is waited for
  (normally long finished) and dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``.

Why (measured on the reference VM, ``docs/BENCHMARKS.md``): a page-cache write into memory
the host has not backed runs at ~450 MB/s of CPU, one into pages just freed at several
GB/s; with free page reporting the guest hands freed memory back within seconds, so a
growing cache always pays the slow price. Dropping pages behind the window recycles them
into the next writes. It also bounds the dirty data a broker leaves for the kernel to
flush (the write-back bursts that stalled other work), and the page cache a container's
memory limit is charged for. Readers of the newest ``window`` bytes - followers, consumers
at the tail - still read from memory; older data comes from the disk, and a read brings
it back into the cache until the kernel reclaims it.

Neither call changes what the file holds or what is durable: the dropped pages are clean
(written and waited for), and fsync remains the only durability step (``flush.*``).

Invariant: ``dropped_to <= writeback_to <= the file size seen by the last call``; both
positions only move forward, except ``truncated`` which pulls them back to the new size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Callable
from typing import Final

MIN_STEP_BYTES: Final = 64 << 10
"""Writeback and drop calls cover at least this much (a quarter of the default window is
16 MiB): a tiny window, as the chaos run sets, still costs no syscall per small append."""

FOLIO_OVERLAP_BYTES: Final = 2 << 20
"""Each drop starts this far before the previous one ended. The kernel caches a file in
folios of up to 2 MiB (x86-64's PMD size) and drops only folios wholly inside the range
asked, so a folio across the previous boundary is retried here; pages already gone cost
a lookup each."""

_WAIT_BEFORE: Final = 1  # SYNC_FILE_RANGE_WAIT_BEFORE
_WRITE: Final = 2  # SYNC_FILE_RANGE_WRITE
_WAIT_AFTER: Final = 4  # SYNC_FILE_RANGE_WAIT_AFTER


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux only; Python's ``os`` lacks it), or None."""
    name = ctypes.util.find_library("c")
    try:
        function = ctypes.CDLL(name, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


_UNSUPPORTED_ERRNOS: Final = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE})
"""What a file system without these calls answers: the window is then off for the file.
Anything else (EIO above all) is a disk failure and propagates like a failed write."""


def _range_call(fd: int, start: int, length: int, flags: int) -> None:
    assert _sync_file_range is not None
    if _sync_file_range(fd, start, length, flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"sync_file_range: {os.strerror(code)}")


SUPPORTED: Final = _sync_file_range is not None and hasattr(os, "posix_fadvise")
"""False where the calls do not exist (not Linux): the window is then ignored."""


class CacheWindow:
    """The drop-behind state of one open segment file; see the module docstring."""

    __slots__ = ("_fd", "dropped_to", "enabled", "writeback_to")

    def __init__(self, fd: int, start: int) -> None:
        self._fd = fd
        self.enabled = SUPPORTED
        # Bytes before ``start`` (a segment opened from disk) are left as they are.
        self.writeback_to = start
        # Drops cover whole pages (the kernel keeps a partly covered page): page-aligned.
        self.dropped_to = start - start % mmap.PAGESIZE

    def appended(self, end: int, window_bytes: int) -> None:
        """The file now ends at ``end``: start writeback and drop what fell behind."""
        if window_bytes <= 0 or not self.enabled:
            return
        step = max(window_bytes // 4, MIN_STEP_BYTES)
        try:
            if end - self.writeback_to >= step:
                _range_call(self._fd, self.writeback_to, end - self.writeback_to, _WRITE)
                self.writeback_to = end
            limit = self.writeback_to - window_bytes
            limit -= limit % mmap.PAGESIZE
            if limit - self.dropped_to >= step:
                self._drop(limit)
        except OSError as exc:
            self._unless_unsupported(exc)

    def release(self, end: int) -> None:
        """Write back and drop everything up to ``end`` (a retired segment's whole file)."""
        if not self.enabled or end <= self.dropped_to:
            return
        try:
            if end > self.writeback_to:
                _range_call(self._fd, self.writeback_to, end - self.writeback_to, _WRITE)
                self.writeback_to = end
            self._drop(end)
        except OSError as exc:
            self._unless_unsupported(exc)

    def truncated(self, size: int) -> None:
        self.writeback_to = min(self.writeback_to, size)
        self.dropped_to = min(self.dropped_to, size - size % mmap.PAGESIZE)

    def _drop(self, limit: int) -> None:
        start = max(0, self.dropped_to - FOLIO_OVERLAP_BYTES)
        length = limit - start
        # DONTNEED skips dirty pages and pages still being written, so wait for this
        # range's writeback (started at least a window ago: normally done) first.
        _range_call(self._fd, start, length, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        os.posix_fadvise(self._fd, start, length, os.POSIX_FADV_DONTNEED)
        self.dropped_to = limit

    def _unless_unsupported(self, exc: OSError) -> None:
        if exc.errno not in _UNSUPPORTED_ERRNOS:
            raise exc
        self.enabled = False
