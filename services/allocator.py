"""The C allocator of a service process: keep freed message buffers for reuse.

Every produce request, replica fetch answer and consumer fetch answer is a buffer of
hundreds of kilobytes to tens of megabytes (gRPC's receive buffer, the Python ``bytes``
made from it, the response built for it). glibc's malloc serves such sizes with a fresh
``mmap`` and gives them back with ``munmap`` on free (or trims them off the top of its
heap), so the next message of the same size faults every page in again and the kernel
zeroes each one: on the reference VM, perf showed page faults and page clearing at ~10%
of a storage node's CPU during RF=1 produce (``docs/BENCHMARKS.md``, fifth pass), and
on a VM that hands freed memory back to its host each such page also pays the host's
first-touch cost.

``retain_freed_memory`` makes such buffers come from malloc's heap and stay there when
freed (up to ``TRIM_THRESHOLD_BYTES`` of free memory at the top of a heap), as a JVM
keeps its heap: the process holds on to its peak working set, which the server's limits
bound (in-flight requests x message size). An operator who wants glibc's behaviour back,
or other values, sets glibc's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
(or ``GLIBC_TUNABLES``): those win, and this module then changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Final

import structlog

_log = structlog.get_logger("tidelog.allocator")

MMAP_THRESHOLD_BYTES: Final = 64 * 1024 * 1024
"""Allocations below this come from malloc's heaps, not a fresh mmap each time: above the
largest message a service moves (the 64 MiB message limit of storage nodes; the gateway's
rare larger requests keep their own mmap)."""
TRIM_THRESHOLD_BYTES: Final = 1024 * 1024 * 1024
"""Free memory at the top of a heap is given back to the kernel only beyond this."""

_M_TRIM_THRESHOLD: Final = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD: Final = -3
_OVERRIDES: Final = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def retain_freed_memory() -> bool:
    """Apply the thresholds above with glibc's ``mallopt``. Returns True when applied;
    False when the C library is not glibc or the environment already sets malloc's
    thresholds (the operator's choice stands)."""
    overridden = [name for name in _OVERRIDES if name in os.environ]
    if overridden:
        _log.info("allocator_left_as_configured", variables=overridden)
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl has no mallopt)
        _log.info("allocator_left_as_is", reason="no mallopt in the C library")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    _log.info(
        "allocator_configured",
        applied=applied,
        mmap_threshold_bytes=MMAP_THRESHOLD_BYTES,
        trim_threshold_bytes=TRIM_THRESHOLD_BYTES,
    )
    return applied
