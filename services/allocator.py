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

In a container the retained memory counts against the memory limit, and glibc keeps free
memory per arena: a new thread gets an arena of its own, up to 8 per core, so a
gRPC server's many threads each keep up to the trim threshold, and a burst freed on one
thread's arena is not reused by the next burst on another. Under a cgroup memory limit
the threads therefore share ``ARENAS_UNDER_LIMIT`` arenas, and the thresholds shrink with
the limit (``thresholds_for``) so that all arenas together keep at most an eighth of it
free. Why it matters: during a full ``tidelog bench`` run (2026-11-25, uncapped values, no
limit) the gateway's peak resident set (VmHWM) reached ~740 MB and a storage node's
~580 MB; a gateway in a 512 MiB memory cgroup (the dev overlay's limit, deploy/k8s) was
OOM-killed by the suite's produce and consume cases while its arenas were uncapped, and
peaked at 460 MiB through all of them with two (docs/BENCHMARKS.md, eighth pass).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import structlog

_log = structlog.get_logger("tidelog.allocator")

MMAP_THRESHOLD_BYTES: Final = 64 * 1024 * 1024
"""Allocations below this come from malloc's heaps, not a fresh mmap each time: above the
largest message a service moves (the 64 MiB message limit of storage nodes; the gateway's
rare larger requests keep their own mmap)."""
TRIM_THRESHOLD_BYTES: Final = 1024 * 1024 * 1024
"""Free memory at the top of a heap is given back to the kernel only beyond this."""

LIMIT_SHARE_TRIM: Final = 8
"""Under a memory limit, the arenas' trim thresholds add up to at most limit / this."""
ARENAS_UNDER_LIMIT: Final = 2
"""Under a memory limit, malloc arenas the threads share (glibc's ``M_ARENA_MAX``; its own
default is 8 per core). Two rather than one: the gRPC threads' allocations outside the GIL
still rarely wait for each other."""
LIMIT_SHARE_MMAP: Final = 16
"""Under a memory limit, the mmap threshold is at most limit / this."""
NO_LIMIT_BYTES: Final = 1 << 62
"""cgroup v1 writes "no limit" as a page-rounded 2**63 - 1; anything this large is none."""

_M_TRIM_THRESHOLD: Final = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD: Final = -3
_M_ARENA_MAX: Final = -8
_OVERRIDES: Final = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_ARENA_MAX",
    "GLIBC_TUNABLES",
)


def cgroup_limit_files(proc_cgroup: Path = Path("/proc/self/cgroup")) -> list[Path]:
    """The files that may hold this process's memory limit: cgroup v2's ``memory.max``
    and v1's ``memory.limit_in_bytes``, at the mount root (what a container sees through
    its cgroup namespace) and under the process's own cgroup path (a host or a runtime
    without a cgroup namespace)."""
    v2 = Path("/sys/fs/cgroup")
    v1 = Path("/sys/fs/cgroup/memory")
    files = [v2 / "memory.max", v1 / "memory.limit_in_bytes"]
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return files
    for line in lines:
        _, controllers, path = line.split(":", 2)
        relative = path.lstrip("/")
        if not relative:
            continue
        if controllers == "":
            files.append(v2 / relative / "memory.max")
        elif "memory" in controllers.split(","):
            files.append(v1 / relative / "memory.limit_in_bytes")
    return files


def memory_limit_bytes(files: Sequence[Path]) -> int | None:
    """The smallest memory limit among ``files`` (cgroup format: bytes, or ``max``);
    None when none is set or readable."""
    limits: list[int] = []
    for path in files:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < NO_LIMIT_BYTES:
            limits.append(int(text))
    return min(limits) if limits else None


def thresholds_for(limit_bytes: int | None) -> tuple[int, int]:
    """(mmap threshold, trim threshold) in bytes for a process under ``limit_bytes``; the
    trim threshold holds for each of the ``arena_max_for(limit_bytes)`` arenas."""
    if limit_bytes is None:
        return MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES
    return (
        min(MMAP_THRESHOLD_BYTES, limit_bytes // LIMIT_SHARE_MMAP),
        min(TRIM_THRESHOLD_BYTES, limit_bytes // (LIMIT_SHARE_TRIM * ARENAS_UNDER_LIMIT)),
    )


def arena_max_for(limit_bytes: int | None) -> int | None:
    """The arenas a process under ``limit_bytes`` may have; None: glibc's default."""
    return None if limit_bytes is None else ARENAS_UNDER_LIMIT


def retain_freed_memory(limit_files: Sequence[Path] | None = None) -> bool:
    """Apply the thresholds above (shrunk under a cgroup memory limit, read from
    ``limit_files``, by default ``cgroup_limit_files()``) with glibc's ``mallopt``.
    Returns True when applied; False when the C library is not glibc or the environment
    already sets malloc's thresholds (the operator's choice stands)."""
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
    limit = memory_limit_bytes(cgroup_limit_files() if limit_files is None else limit_files)
    mmap_threshold, trim_threshold = thresholds_for(limit)
    arena_max = arena_max_for(limit)
    applied = bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )
    if arena_max is not None:
        # Before the server's threads exist: a thread keeps the arena it first got.
        applied = bool(mallopt(_M_ARENA_MAX, arena_max)) and applied
    _log.info(
        "allocator_configured",
        applied=applied,
        memory_limit_bytes=limit,
        mmap_threshold_bytes=mmap_threshold,
        trim_threshold_bytes=trim_threshold,
        arena_max=arena_max,
    )
    return applied
